"""`python -m maxtrain.generate: text from a checkpoint (maxtrain/cli/generate.py)."""

import sys

from maxtrain.cli.generate import main

if __name__ == "__main__":
  sys.exit(main())
