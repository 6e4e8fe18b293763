"""`--help` for the entry points that take a config: usage and every key with its value and meaning,
generated from the declarations (`keys.py`)."""

from __future__ import annotations

from typing import Sequence

from maxtrain.config.keys import flat_keys, key_docs
from maxtrain.config.loader import load_file, parse_args

USAGE = "usage: python -m {prog} [--config=PATH] [--config.KEY=VALUE ...]"


def help_text(argv: Sequence[str], prog: str) -> str:
  """Usage and every config key with its value (the defaults, or those of `--config=PATH`) and meaning."""
  path, _ = parse_args([a for a in argv if a not in ("--help", "-h")])
  cfg, _ = load_file(path)
  docs = key_docs()
  lines = [USAGE.format(prog=prog), "", f"config keys (values from {path}; set with --config.KEY=VALUE):"]
  declared = [k for k in docs if k in set(flat_keys(cfg))]
  for key in declared + sorted(set(flat_keys(cfg)) - set(declared)):
    value = cfg
    for part in key.split("."):
      value = value[part]
    lines.append(f"  {key} = {value!r}\n      {docs.get(key) or '(undocumented)'}")
  return "\n".join(lines)
