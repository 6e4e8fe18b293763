"""Rollout tokens per second of the generator, static batch vs continuous batching (`post.continuous_batching`),
runs alternating (static, continuous R1, continuous R2, static, ...) after one warm-up (compiles) of each.

  python tools/bench_rollout.py [--prompts=64] [--max_new=64] [--rows=16,32] [--repeats=3] [--mean_len=16]

The default model (configs/default.py's shape, random initialisation) on one CPU device, sampled at
temperature 1 over the first --mean_len token ids (`vocab_limit`; a random model's distribution over them is
near uniform), EOS = id 0: completion lengths are about geometric with mean --mean_len, capped at --max_new,
the long tail of an RL batch (the static generator decodes every row max_new tokens; continuous batching
frees a row at its EOS). Figure: completion tokens (through the EOS) per wall second of the whole generate
call, the median of the repeats. Prints a table and the machine; the figures go into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import jax
import numpy as np
from flax import nnx

from maxtrain import config as config_lib
from maxtrain.inference import continuous, sampling
from maxtrain.models import registry


def completion_lengths(tokens_NM: np.ndarray, eos: int) -> np.ndarray:
  return np.array([list(r).index(eos) + 1 if eos in r else len(r) for r in tokens_NM])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--prompts", type=int, default=64)
  ap.add_argument("--max_new", type=int, default=64)
  ap.add_argument("--rows", default="16,32", help="continuous batching's decode rows, one arm each")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--mean_len", type=int, default=16)
  args = ap.parse_args()
  cfg = config_lib.base_config()
  model = registry.build(registry.model_config(cfg.model), rngs=nnx.Rngs(params=0))
  generator = sampling.Generator(model, jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)))
  rng = np.random.default_rng(0)
  vocab = cfg.model.vocab_size
  prompts = [rng.integers(1, vocab - 1, int(rng.integers(4, 25))).tolist() for _ in range(args.prompts)]
  limit, eos = int(args.mean_len), 0
  draw = sampling.Sampling(temperature=1.0, seed=1)

  def static_arm() -> tuple[float, np.ndarray, int]:
    t0 = time.monotonic()
    out, _, _ = generator.generate_scored(prompts, args.max_new, draw, vocab_limit=limit)
    return time.monotonic() - t0, completion_lengths(out, eos), len(prompts) * args.max_new

  def continuous_arm(rows: int):
    def run() -> tuple[float, np.ndarray, int]:
      t0 = time.monotonic()
      out, _, timing = continuous.batcher(generator, rows).generate_scored(prompts, args.max_new, draw, eos,
                                                                           vocab_limit=limit)
      return time.monotonic() - t0, completion_lengths(out, eos), timing["row_steps"]
    return run

  arms = {"static": static_arm, **{f"continuous {r}": continuous_arm(int(r)) for r in args.rows.split(",")}}
  for run in arms.values():
    run()  # warm-up: compiles
  seconds: dict[str, list[float]] = {name: [] for name in arms}
  lengths: dict[str, np.ndarray] = {}
  row_steps: dict[str, int] = {}
  for _ in range(args.repeats):
    for name, run in arms.items():
      s, n, steps = run()
      seconds[name].append(s)
      lengths[name], row_steps[name] = n, steps
  print(f"{args.prompts} prompts of 4-24 tokens, max_new {args.max_new}, temperature 1 over {limit} ids")
  print("| arm | completion length mean (min-max) | decode row-steps (useful share) | seconds (runs) | "
        "completion tokens/s (median) |")
  print("| --- | --- | --- | --- | --- |")
  for name in arms:
    med, n = statistics.median(seconds[name]), lengths[name]
    print(f"| {name} | {n.mean():.1f} ({n.min()}-{n.max()}) | {row_steps[name]} ({n.sum() / row_steps[name]:.0%}) | "
          f"{', '.join(f'{s:.3f}' for s in seconds[name])} | {n.sum() / med:.0f} |")
  print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, jax {jax.__version__}")


if __name__ == "__main__":
  main()
