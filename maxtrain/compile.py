"""Entry point: `python -m maxtrain.compile` (ahead-of-time compile of the train step; maxtrain/aot/compile.py)."""

import sys

from maxtrain.aot.compile import main

if __name__ == "__main__":
  sys.exit(main())
