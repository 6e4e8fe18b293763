"""Interleaved A/B of config variants in one process: which of them makes the train step faster?

  python tools/bench_ab.py --variant= --variant=model.scan_unroll=1 --variant=model.attention=dot \
      [--rounds 4] [--steps 8] [--config=PATH] [--config.key=value ...]

Each `--variant` is a comma list of `key=value` overrides on top of the shared `--config.*` ones (empty:
the shared config as is). Every variant is compiled first; then the rounds time `--steps` steps of each
variant in turn, so a machine shared with other jobs slows all of them alike. Prints, per variant, the
median wall and CPU time per step (all of this process's threads: the scheduler disturbs it far less
than wall time) and each as a speed ratio to the first variant. Why in one process: separate runs on a
shared machine differ up to 4x in wall time (BENCHMARKS.md), far more than the effects measured here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

from maxtrain.program import build as program_lib, state as state_lib  # noqa: E402
from maxtrain import config as config_lib
from maxtrain.loop.data import Data  # noqa: E402
from maxtrain.runtime import platform as platform_env  # noqa: E402
from maxtrain.program.plan import validate  # noqa: E402


class Variant:
  """A compiled step with its own state and batches, timed `steps` steps at a time."""

  def __init__(self, name: str, argv: list[str], steps: int):
    cfg = config_lib.load(argv)
    self.name, self.tokens = name or "(shared config)", cfg.data.batch_size * cfg.data.seq_len
    program = program_lib.build(cfg, validate(cfg, jax.device_count(), jax.process_count()))
    self.mesh, self.state = program.mesh, state_lib.initialize(program.state, program.mesh)
    data = Data(cfg, program.batch_shardings)
    self.batches = [data.next_batch()[0] for _ in range(steps)]
    with jax.set_mesh(self.mesh):
      t0 = time.perf_counter()
      self.compiled = program.train_step.lower(self.state, self.batches[0]).compile()
      self.compile_s = time.perf_counter() - t0
    self.run()  # warm-up
    self.walls, self.cpus = [], []

  def run(self) -> tuple[float, float]:
    """(wall, CPU) seconds per step over the batches."""
    with jax.set_mesh(self.mesh):
      t0, c0 = time.perf_counter(), time.process_time()
      for batch in self.batches:
        self.state, metrics = self.compiled(self.state, batch)
      jax.block_until_ready(metrics)
    n = len(self.batches)
    return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--variant", action="append", required=True, help="comma list of key=value overrides")
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--steps", type=int, default=8, help="timed steps per variant per round")
  args, shared = parser.parse_known_args()
  platform_env.apply(config_lib.load(shared).runtime)  # before the backend starts, as the trainer does
  variants = [Variant(v, shared + [f"--config.{kv}" for kv in v.split(",") if kv], args.steps) for v in args.variant]
  for _ in range(args.rounds):
    for v in variants:
      wall, cpu = v.run()
      v.walls.append(wall)
      v.cpus.append(cpu)
  base_wall, base_cpu = statistics.median(variants[0].walls), statistics.median(variants[0].cpus)
  print(f"{jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}; {args.rounds} rounds x "
        f"{args.steps} steps; speed ratios vs {variants[0].name}")
  for v in variants:
    wall, cpu = statistics.median(v.walls), statistics.median(v.cpus)
    print(f"{v.name}: compile {v.compile_s:.1f}s; wall {wall * 1e3:.1f} ms/step ({base_wall / wall:.3f}x, "
          f"{v.tokens / wall:,.0f} tokens/s); CPU {cpu * 1e3:.1f} ms/step ({base_cpu / cpu:.3f}x); "
          f"rounds (wall ms): {' '.join(f'{w * 1e3:.0f}' for w in v.walls)}")


if __name__ == "__main__":
  main()
