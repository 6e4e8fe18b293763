"""Device and host memory of the train step with the optimizer state on the device, offloaded and moved in all
at once, and offloaded and streamed (`optimizer.offload_groups`), on the accelerator at hand; then two steps of
each from the same state on the same batches, compared bitwise.

  python tools/offload_memory_check.py                     # LLaMA 3 8B widths, 2 layers, one 4 x 512 batch
  python tools/offload_memory_check.py --config.model.num_layers=4 --groups 1,4,16
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tools/offload_memory_check.py \
      --config.runtime.platform=cpu --config.model.d_model=64 ...   # the same on CPU, shrunk

The default config is one where the moments dominate the step (1.5B parameters, 12 GB of fp32 moments, a
few hundred MB of activations): there an update that brings every moment to the device at once raises the
peak by about the moments, and the streamed one by about the largest group's (docs/optimizers.md). On
XLA:CPU the script runs too (shrink the widths), but its figures cannot show the difference: it lowers the
copies to nothing (one RAM), so every variant's temporaries are the same there.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from maxtrain import config as config_lib
from maxtrain.optim import offload
from maxtrain.program import build, fit, state as state_lib
from maxtrain.runtime import platform as platform_env

DEFAULTS = ["--config=configs/llama3_8b.py", "--config.hardware=", "--config.model.num_layers=2",
            "--config.data.seq_len=512", "--config.optimizer.microbatch_size=0",
            "--config.optimizer.grad_accum_steps=1", "--config.mesh.fsdp=-1"]
MB = 1e6


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--groups", default="1,16", help="optimizer.offload_groups values to compile with offload=host")
  parser.add_argument("--steps", type=int, default=2, help="steps run from one state to compare losses (0: none)")
  args, rest = parser.parse_known_args()
  # The platform's XLA flags (runtime.platform, default gpu here) before the backend starts, as the trainer does.
  platform_env.apply(config_lib.load(DEFAULTS + ["--config.runtime.platform=gpu"] + rest).runtime)
  devices = jax.devices()
  base = DEFAULTS + ["--config.runtime.platform=gpu", f"--config.data.batch_size={4 * len(devices)}"] + rest
  variants = [("none", ["--config.optimizer.offload=none"])]
  variants += [(f"host, {g} group(s)", ["--config.optimizer.offload=host", f"--config.optimizer.offload_groups={g}"])
               for g in args.groups.split(",")]
  print(f"{len(devices)} x {devices[0].device_kind}, jax {jax.__version__}")
  results = {}
  for name, extra in variants:
    cfg = config_lib.load(base + extra)
    program = build.program_for(cfg, devices, require_data=False)
    start = time.perf_counter()
    compiled = program.lower().compile()
    m = compiled.memory_analysis()
    mem = fit.Memory.of(compiled)
    moments = offload.sharded_bytes(program.state.abstract.opt_state, program.state.shardings.opt_state)
    sizes = [x.size for x in jax.tree.leaves(program.state.abstract.params)]
    groups = offload.stream_groups(sizes, cfg.optimizer.offload_groups) if offload.enabled(cfg.optimizer) else []
    largest = max((sum(sizes[i] for i in g) for g in groups), default=0) / max(sum(sizes), 1) * moments
    print(f"{name:<20} compiled in {time.perf_counter() - start:5.1f} s; per device: optimizer state {moments / MB:9.1f} MB"
          + (f" ({len(groups)} groups, largest {largest / MB:.1f} MB)" if groups else ""))
    print(f"  device: arguments {mem.arguments / MB:9.1f}  temporaries {mem.temporaries / MB:9.1f}  peak {mem.peak / MB:9.1f} MB")
    print(f"  host:   arguments {mem.host_arguments / MB:9.1f}  temporaries {mem.host_temporaries / MB:9.1f}  "
          f"total {mem.host / MB:9.1f} MB   (raw memory_analysis: {m})")
    results[name] = (program, compiled)
  if args.steps:
    check_bitwise(results, args.steps)


def synthetic_batch(shapes: dict, step: int) -> dict:
  """One packed row per sequence: random tokens, positions 0..T-1, one segment, every target counted."""
  rng = np.random.default_rng(step)
  b, t = shapes["inputs"].shape
  rows = {"inputs": rng.integers(0, 256, (b, t)), "targets": rng.integers(0, 256, (b, t)),
          "segment_ids": np.ones((b, t)), "positions": np.broadcast_to(np.arange(t), (b, t)),
          "loss_mask": np.ones((b, t))}
  return {k: jax.device_put(np.asarray(v, shapes[k].dtype), shapes[k].sharding) for k, v in rows.items()}


def check_bitwise(results: dict, steps: int) -> None:
  """Every variant's losses and final parameters over `steps` steps from one initial state, against `none`'s."""
  reference = None
  for name, (program, compiled) in results.items():
    state = state_lib.initialize(program.state, program.mesh)
    batch_shapes = program.abstract_batch()
    losses = []
    with jax.set_mesh(program.mesh):
      for step in range(steps):
        batch = synthetic_batch(batch_shapes, step)
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))
    params = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    if reference is None:
      reference = (losses, params)
      print(f"losses, none: {losses}")
      continue
    same = losses == reference[0] and all(np.array_equal(a, b) for a, b in zip(params, reference[1]))
    print(f"losses, {name}: {losses}; {'bitwise the same as none' if same else 'DIFFERENT from none'}")


if __name__ == "__main__":
  main()
