"""Parameters, FLOPs per token and per-device memory of a config, by arithmetic (no compile, no devices):

  python tools/estimate.py --config=configs/llama3_8b.py --config.hardware=h100x8 --devices 8 [--json]

The library is maxtrain/aot/estimate.py; `python -m maxtrain.compile` measures the compiled step instead.
Exit codes: 0, or 2 for a bad config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# Arithmetic only: never start an accelerator backend (tracing the abstract model may touch one).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from maxtrain import config as config_lib  # noqa: E402
from maxtrain.errors import UserError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   epilog="Other arguments: --config=PATH and --config.KEY=VALUE, as for maxtrain.train.")
  parser.add_argument("--devices", type=int, default=0,
                      help="devices of the target mesh (default: one node of the hardware preset's mesh)")
  parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
  args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
  try:
    from maxtrain.aot import compile as compile_lib, estimate

    cfg = config_lib.load(rest)
    num_devices = args.devices or compile_lib.default_devices(cfg)
    result = estimate.estimate(cfg, num_devices)
  except UserError as e:
    print(f"maxtrain: error: {e}", file=sys.stderr)
    return 2
  print(json.dumps(result.to_json(), indent=2) if args.json else result.table())
  return 0


if __name__ == "__main__":
  sys.exit(main())
