"""Per-step cost of the multi-process stop check: `python tools/bench_stop_check.py [--steps N]`.

Starts 2 JAX processes x 4 CPU devices on localhost (jax.distributed, gloo) and, in each, times a loop
of a small jitted step over all 8 devices (a sharded matmul whose result is read back every step, as
the trainer's guards read the step's flags) three ways: no stop check; the former check (a
one-element `process_allgather` every step: a device collective and a host sync); and the current one
(`StopRequest.requested`: a lock and two comparisons; agreement through the coordination service only
once a stop is requested). Prints process 0's per-step times (median of 5 interleaved repetitions of N steps) and
the bare cost of one check call.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys


def worker(process_id: int, port: int, steps: int) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import multihost_utils

  import harness
  from maxtrain import config as config_lib
  from maxtrain.runtime.kv import KeyValue
  from maxtrain.runtime.preemption import StopRequest
  from maxtrain.sharding import mesh as mesh_lib
  from maxtrain.sharding import rules as rules_lib
  from maxtrain.sharding.layout import Layout

  jax.distributed.initialize(f"127.0.0.1:{port}", 2, process_id)
  # The default config's mesh over all 8 devices (FSDP); the rows split as the trainer splits a batch's.
  mesh_cfg = config_lib.load([]).mesh
  mesh_layout = mesh_lib.from_config(mesh_cfg, jax.device_count())
  mesh = mesh_lib.make_mesh(mesh_layout)
  sharding = Layout(mesh_layout.sizes, rules_lib.get(mesh_cfg.rules)).batch_sharding(mesh)
  x = jax.make_array_from_callback((1024, 256), sharding, lambda idx: np.ones((1024, 256), np.float32)[idx])
  w = jnp.ones((256, 256), jnp.float32) * 1e-3

  @jax.jit
  def step(x):
    y = jnp.tanh(x @ w)
    return y, jnp.sum(y)  # the sum is a cross-device reduction, read back every step

  stop = StopRequest(KeyValue.current())

  def old_check() -> bool:
    return bool(np.any(multihost_utils.process_allgather(np.array(False, np.int32))))

  checks = {"none": lambda s: False, "allgather (before)": lambda s: old_check(), "kv agreement (after)": stop.requested}

  def steps_with(check):
    def run() -> None:  # float() already waited for each step
      nonlocal x
      for s in range(steps):
        x, total = step(x)
        float(total)
        check(s)
    return run

  def calls_of(check):
    def run() -> None:
      for s in range(200):
        check(s)
    return run

  # Both processes run the same rounds in the same order; a barrier starts each timed run together.
  timed = harness.interleaved({name: steps_with(check) for name, check in checks.items()}, 5, warmup=1,
                             before=lambda name: multihost_utils.sync_global_devices(f"bench-{name}"))
  results = {name: t.per(steps).wall for name, t in timed.items()}
  timed = harness.interleaved({name: calls_of(check) for name, check in checks.items()}, 1, warmup=0,
                             before=lambda name: multihost_utils.sync_global_devices(f"bare-{name}"))
  bare = {name: t.per(200).wall for name, t in timed.items()}
  if process_id == 0:
    print(f"jax {jax.__version__}, 2 processes x 4 CPU devices, {steps} steps x 5 repetitions")
    print(f"{'stop check':<24}{'step (ms)':>12}{'added (ms)':>12}{'bare call (us)':>16}")
    for name in checks:
      print(f"{name:<24}{results[name] * 1e3:>12.3f}{(results[name] - results['none']) * 1e3:>12.3f}"
            f"{bare[name] * 1e6:>16.1f}")


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker is not None:
    worker(args.worker, args.port, args.steps)
    return 0
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
  procs = [subprocess.Popen([sys.executable, __file__, f"--worker={i}", f"--port={port}", f"--steps={args.steps}"],
                            env=env) for i in range(2)]
  return max(p.wait() for p in procs)


if __name__ == "__main__":
  sys.exit(main())
