"""Tokenizes text files into maxtrain token stores; see maxtrain/data/indexing.py.

Runs where maxtrain is installed (`pip install -e .`): python tools/index_data.py --input DIR --output PREFIX
"""

from maxtrain.data.indexing import main

if __name__ == "__main__":
  main()
