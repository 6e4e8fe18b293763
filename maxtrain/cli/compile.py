"""Ahead-of-time compile of the train step: will this config compile, and fit, on the target mesh?

  python -m maxtrain.compile --config=PATH [--config.key=value ...] [--devices N] [--device-memory-gb G]

Lowers and compiles the real train step (`program.build`, the program the trainer runs) for a
mesh of N devices, from abstract inputs (`jax.ShapeDtypeStruct`s carrying the state and batch
shardings): no parameter is allocated and no data is read. It always compiles on N fake CPU devices,
whatever `runtime.platform` says, so a laptop can check a 64-device Trainium or GPU layout. The
memory figures are XLA:CPU's for the same sharded program; the GPU and Neuron compilers fuse and
schedule differently, so they are an estimate to keep a margin against, not a guarantee.

With `runtime.platform=neuron` it also lints the lowered step for what the Neuron compiler rejects
(`maxtrain/aot/hlo_lint.py`).

Exit codes: 0 compiled (and fits under --device-memory-gb when given, and passes the Neuron lint on
neuron), 2 bad config, does not fit, or fails the lint.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from maxtrain.aot.compile import check_fits, compile_train_step, default_devices, neuron_lint
from maxtrain.cli import shell


def parser() -> argparse.ArgumentParser:
  p = shell.ArgumentParser(prog="python -m maxtrain.compile", description=__doc__.split("\n\n")[0],
                              epilog="Other arguments: --config=PATH and --config.KEY=VALUE, as for maxtrain.train.")
  p.add_argument("--devices", type=int, default=0,
                 help="devices of the target mesh (default: one node of the hardware preset's mesh)")
  p.add_argument("--device-memory-gb", type=float, default=0.0,
                 help="memory per device in GiB; exit 2 when the compiled step's peak exceeds it (0: no check)")
  p.add_argument("--standin", choices=("auto", "on", "off"), default="auto",
                 help="compile the model's memory stand-in where XLA:CPU lowers a part far from a GPU's memory "
                 "(dropless MoE's ragged_dot, remat in unscanned layers; docs/fitting.md). auto: for a GPU or "
                 "Trainium target (runtime.platform)")
  return p


COMMAND = shell.Command(name="maxtrain.compile", prog="python -m maxtrain.compile", parser=parser)


def compile_step(invocation: shell.Invocation) -> None:
  args, cfg = invocation.args, invocation.load_config()
  num_devices = args.devices or default_devices(cfg)
  print(f"maxtrain.compile: {num_devices} devices, hardware preset {cfg.hardware or '(none)'}", flush=True)
  report = compile_train_step(cfg, num_devices, {"auto": None, "on": True, "off": False}[args.standin])
  print(report.describe())
  if cfg.runtime.platform == "neuron":
    print(neuron_lint(report))
  if args.device_memory_gb > 0:
    print(check_fits(report, args.device_memory_gb))


def main(argv: Sequence[str] | None = None) -> int:
  return shell.run(COMMAND, compile_step, argv)


if __name__ == "__main__":
  sys.exit(main())
