"""`python -m maxtrain.compile: ahead-of-time compile of the train step (maxtrain/cli/compile.py)."""

import sys

from maxtrain.cli.compile import main

if __name__ == "__main__":
  sys.exit(main())
