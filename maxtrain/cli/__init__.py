"""The command-line entry points (`python -m maxtrain.X` runs cli/X.py) and what they share."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def parse_with_overrides(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> tuple:
  """(args, overrides): the parser's own arguments and the `--config.KEY=VALUE` overrides; anything else is
  the parser's usage error (exit 2)."""
  args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
  unknown = [a for a in overrides if not (a.startswith("--config.") and "=" in a)]
  if unknown:
    parser.error(f"unrecognized arguments: {' '.join(unknown)} (config overrides are --config.KEY=VALUE)")
  return args, overrides
