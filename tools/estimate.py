"""Parameters, FLOPs per token and per-device memory of a config, by arithmetic (no compile, no devices):

  python tools/estimate.py --config=configs/llama3_8b.py --config.hardware=h100x8 --devices 8 [--json]

The library is maxtrain/aot/estimate.py; `python -m maxtrain.compile` measures the compiled step instead.
Exit codes: 0, or 2 for a bad config.
"""

from __future__ import annotations

import json
import os
import sys

# Arithmetic only: never start an accelerator backend (tracing the abstract model may touch one).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from maxtrain.cli import shell  # noqa: E402


def parser() -> shell.ArgumentParser:
  p = shell.ArgumentParser(prog="python tools/estimate.py", description=__doc__.split("\n\n")[0],
                           epilog="Other arguments: --config=PATH and --config.KEY=VALUE, as for maxtrain.train.")
  p.add_argument("--devices", type=int, default=0,
                 help="devices of the target mesh (default: one node of the hardware preset's mesh)")
  p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
  return p


COMMAND = shell.Command(name="estimate", prog="python tools/estimate.py", parser=parser)


def estimate_config(invocation: shell.Invocation) -> None:
  from maxtrain.aot import compile as compile_lib, estimate

  args, cfg = invocation.args, invocation.load_config()
  result = estimate.estimate(cfg, args.devices or compile_lib.default_devices(cfg))
  print(json.dumps(result.to_json(), indent=2) if args.json else result.table())


def main(argv: list[str] | None = None) -> int:
  return shell.run(COMMAND, estimate_config, argv)

if __name__ == "__main__":
  sys.exit(main())
