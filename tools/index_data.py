"""Tokenizes text files into maxtrain token stores; see maxtrain/data/indexing.py.

Runs where maxtrain is installed (`pip install -e .`): python tools/index_data.py --input DIR --output PREFIX
Exit codes: 0, or 2 for bad input (one line: `index_data: error: ...`).
"""

import sys
from typing import Sequence

from maxtrain.cli import shell
from maxtrain.data import indexing

COMMAND = shell.Command(name="index_data", prog="python tools/index_data.py", parser=indexing.parser, config=False)


def main(argv: Sequence[str] | None = None) -> int:
  return shell.run(COMMAND, lambda invocation: indexing.index(invocation.args), argv)


if __name__ == "__main__":
  sys.exit(main())
