"""CPU time per train step of the circular pipeline as its microbatches grow, at fixed tokens per step:

  python tools/bench_pipeline.py [--microbatches 4,8,16] [--repeats 1,2] [--schedules gpipe,1f1b,zb,interleaved_1f1b] [--rounds 5]
                                 [--config.key=value ...]

On 8 fake CPU devices, `mesh.pipeline=4 x mesh.fsdp=2` (by default), one compiled step per
(microbatches, repeats) variant, all built first and then timed in alternation (`harness.interleaved`:
round after round, each variant once per round), so the machine's load drifts over all of them alike.
Prints each variant's median CPU and wall time per step, its ratio to the first variant, and the bubble
the schedule reports, (S-1)/(R*M+S-1). CPU time (all of this process's threads), because on a shared
machine wall time mostly measures the scheduler.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

from maxtrain.runtime.platform import fake_cpu_devices

fake_cpu_devices(8)  # before jax starts its backend
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import harness  # noqa: E402
from maxtrain import config as config_lib  # noqa: E402

# A deeper default model (8 layers: 4 stages x 2 repeats) with enough rows per batch shard for 16 microbatches.
BASE = ["--config.mesh.pipeline=4", "--config.mesh.fsdp=2", "--config.model.num_layers=8",
        "--config.data.batch_size=32", "--config.model.scan_unroll=1"]


def build(rest: list[str], microbatches: int, repeats: int, steps: int, schedule: str = "gpipe"):
  """A callable running `steps` compiled steps of the variant, and its schedule."""
  cfg = config_lib.load(BASE + rest + [f"--config.pipeline.microbatches={microbatches}",
                                       f"--config.pipeline.repeats={repeats}", f"--config.pipeline.schedule={schedule}"])
  step = harness.CompiledStep(cfg, steps)
  return step, step.program.plan.pipeline, cfg


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--microbatches", default="4,8,16", help="comma-separated pipeline.microbatches")
  parser.add_argument("--repeats", default="1,2", help="comma-separated pipeline.repeats")
  parser.add_argument("--schedules", default="gpipe", help="comma-separated pipeline.schedule (1f1b, zb: repeats 1 only; interleaved_1f1b: > 1)")
  parser.add_argument("--steps", type=int, default=3, help="steps per timed call")
  parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; medians are reported")
  args, rest = parser.parse_known_args()
  variants, schedules = {}, {}
  for kind in args.schedules.split(","):
    for r in map(int, args.repeats.split(",")):
      for m in map(int, args.microbatches.split(",")):
        if (kind in ("1f1b", "zb") and r > 1) or (kind == "interleaved_1f1b" and r == 1):
          continue
        name = f"M={m} R={r}" + ("" if kind == "gpipe" else f" {kind}")
        variants[name], schedules[name], cfg = build(rest, m, r, args.steps, kind)
  print(f"machine: {platform.machine()} {os.cpu_count()} cores, {jax.device_count()} x {jax.devices()[0].device_kind}; "
        f"python {platform.python_version()}, jax {jax.__version__}; load average {os.getloadavg()[0]:.2f} at start")
  print(f"model: {cfg.model.num_layers} layers, d_model {cfg.model.d_model}; batch {cfg.data.batch_size} x "
        f"{cfg.data.seq_len} tokens per step (fixed); {args.rounds} alternating rounds of {args.steps} steps")
  results = harness.interleaved(variants, args.rounds, warmup=1)
  first = next(iter(results))
  print(f"{'variant':>15} {'CPU s/step':>11} {'vs ' + first:>12} {'wall s/step':>12} {'bubble':>8} {'iterations':>10}")
  for name, t in results.items():
    s = schedules[name]
    ratios = [c / f for c, f in zip(t.cpus, results[first].cpus)]  # per round: the two ran back to back
    print(f"{name:>15} {t.cpu / args.steps:11.3f} {statistics.median(ratios):12.3f} {t.wall / args.steps:12.3f} "
          f"{s.bubble:8.4f} {s.iterations:10d}")
  print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
  sys.exit(main())
