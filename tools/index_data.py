"""Tokenizes text files into maxtrain token stores; see maxtrain/data/indexing.py.

Runs from a checkout: python tools/index_data.py --input DIR --output PREFIX
"""

import os
import sys

# Lets the script import the checkout's `maxtrain` without installing it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxtrain.data.indexing import main  # pylint: disable=g-import-not-at-top

if __name__ == "__main__":
  main()
