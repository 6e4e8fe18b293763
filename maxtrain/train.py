"""`python -m maxtrain.train: the trainer (maxtrain/cli/train.py)."""

import sys

from maxtrain.cli.train import main

if __name__ == "__main__":
  sys.exit(main())
