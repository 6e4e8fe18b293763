"""`python -m maxtrain.launch: the supervisor (maxtrain/cli/launch.py)."""

import sys

from maxtrain.cli.launch import main

if __name__ == "__main__":
  sys.exit(main())
