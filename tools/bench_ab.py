"""Interleaved A/B of config variants in one process: which of them makes the train step faster?

  python tools/bench_ab.py --variant= --variant=model.scan_unroll=1 --variant=model.attention=dot \
      [--rounds 4] [--steps 8] [--config=PATH] [--config.key=value ...]

Each `--variant` is a comma list of `key=value` overrides on top of the shared `--config.*` ones (empty:
the shared config as is). Every variant is compiled first; then the rounds time `--steps` steps of each
variant in turn (`tools/harness.py`), so a machine shared with other jobs slows all of them
alike. Prints, per variant, the median wall and CPU time per step (all of this process's threads: the scheduler disturbs it far less
than wall time) and each as a speed ratio to the first variant. Why in one process: separate runs on a
shared machine differ up to 4x in wall time (BENCHMARKS.md), far more than the effects measured here.
"""

from __future__ import annotations

import argparse

import jax

import harness
from maxtrain import config as config_lib


class Variant(harness.CompiledStep):
  """A compiled step with its own state and batches, named; a call runs `steps` steps."""

  def __init__(self, name: str, argv: list[str], steps: int):
    super().__init__(config_lib.load(argv), steps)
    self.name = name or "(shared config)"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--variant", action="append", required=True, help="comma list of key=value overrides")
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--steps", type=int, default=8, help="timed steps per variant per round")
  args, shared = parser.parse_known_args()
  harness.load(shared)  # the platform's environment before the backend starts, as the trainer does
  variants = [Variant(v, shared + [f"--config.{kv}" for kv in v.split(",") if kv], args.steps) for v in args.variant]
  # Keyed by position: two variants may share a name.
  timed = harness.interleaved({str(i): v for i, v in enumerate(variants)}, args.rounds, warmup=1)
  timed = [timed[str(i)].per(args.steps) for i in range(len(variants))]
  base_wall, base_cpu = timed[0].wall, timed[0].cpu
  print(f"{jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}; {args.rounds} rounds x "
        f"{args.steps} steps; speed ratios vs {variants[0].name}")
  for v, t in zip(variants, timed):
    wall, cpu = t.wall, t.cpu
    print(f"{v.name}: compile {v.compile_s:.1f}s; wall {wall * 1e3:.1f} ms/step ({base_wall / wall:.3f}x, "
          f"{v.tokens / wall:,.0f} tokens/s); CPU {cpu * 1e3:.1f} ms/step ({base_cpu / cpu:.3f}x); "
          f"rounds (wall ms): {' '.join(f'{w * 1e3:.0f}' for w in t.walls)}")


if __name__ == "__main__":
  main()
