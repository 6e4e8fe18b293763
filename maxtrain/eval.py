"""`python -m maxtrain.eval`: lm-eval tasks on a checkpoint (maxtrain/cli/eval.py)."""

import sys

from maxtrain.cli.eval import main

if __name__ == "__main__":
  sys.exit(main())
