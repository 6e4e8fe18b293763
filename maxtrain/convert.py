"""`python -m maxtrain.convert: Hugging Face checkpoints in and out (maxtrain/cli/convert.py)."""

import sys

from maxtrain.cli.convert import main

if __name__ == "__main__":
  sys.exit(main())
