"""Train-step throughput for a config: `python tools/bench.py [--config=...] [--config.key=value ...]`.

Builds the sharded state and the jitted step exactly as the trainer does, feeds real batches from the
configured token store, and prints step time, tokens/s, achieved model FLOP/s (see
`ModelConfig.train_flops_per_token`) and MFU against the device's peak (`maxtrain/monitor/mfu.py`: the
table by device kind, `mfu.peak_flops` when set, or on CPU a matmul peak measured once per machine).
Timing excludes compilation and a warm-up step.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from maxtrain import config as config_lib, optim, state as state_lib, step as step_lib  # noqa: E402
from maxtrain import platform as platform_env  # noqa: E402
from maxtrain.data import pipeline  # noqa: E402
from maxtrain.models.llama import ModelConfig, param_count  # noqa: E402
from maxtrain.monitor import mfu  # noqa: E402
from maxtrain.sharding.mesh import make_mesh  # noqa: E402
from maxtrain.trainer import open_stores  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--steps", type=int, default=10, help="timed steps")
  args, rest = parser.parse_known_args()
  cfg = config_lib.load(rest)
  platform_env.apply(cfg.runtime)  # XLA/Neuron flags of runtime.platform, before the backend starts
  layout = config_lib.validate(cfg, jax.device_count(), jax.process_count())
  train_store, _ = open_stores(cfg.data, cfg.model.vocab_size)
  mesh = make_mesh(layout)
  model_cfg = ModelConfig.from_config(cfg.model)
  optimizer = optim.make(cfg.optimizer, cfg.steps)
  state_spec = state_lib.spec(model_cfg, optimizer.tx, mesh, cfg.seed, guard_window=cfg.guards.spike_window)
  state = state_lib.initialize(state_spec, mesh)
  shardings = step_lib.batch_shardings(mesh)
  loader = pipeline.TrainLoader(train_store.prefix, cfg.data.seq_len, cfg.data.batch_size, cfg.seed)
  no_fault = jax.device_put(np.asarray([0.0, 1.0], np.float32), shardings["fault"])
  batches = [{**pipeline.to_global(next(loader), shardings["inputs"]), "fault": no_fault}
             for _ in range(args.steps + 1)]
  with jax.set_mesh(mesh):
    step = step_lib.jit_train_step(cfg, state_spec, optimizer, mesh)
    t0 = time.perf_counter()
    compiled = step.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    state, metrics = compiled(state, batches[0])
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for batch in batches[1:]:
      state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    step_s = (time.perf_counter() - t0) / args.steps
  tokens = cfg.data.batch_size * cfg.data.seq_len
  flops_per_token = model_cfg.train_flops_per_token(cfg.data.seq_len)
  flops = flops_per_token * tokens
  peak, peak_source = mfu.peak_flops(jax.devices()[0], cfg.mfu.peak_flops if "mfu" in cfg else 0.0)
  utilisation = mfu.mfu(tokens / step_s, flops_per_token, jax.device_count(), peak)
  print(f"machine: {platform.machine()} {jax.device_count()} x {jax.devices()[0].device_kind}, "
        f"python {platform.python_version()}, jax {jax.__version__}")
  print(f"model: {param_count(state.params) / 1e6:.2f}M params, mesh {dict(mesh.shape)}, "
        f"batch {cfg.data.batch_size} x {cfg.data.seq_len}")
  print(f"compile {compile_s:.1f}s; step {step_s:.3f}s; {tokens / step_s:,.0f} tokens/s; "
        f"{flops / step_s / 1e9:.1f} model GFLOP/s ({model_cfg.train_flops_per_token(cfg.data.seq_len) / 1e6:.1f} "
        f"MFLOP/token)")
  print(f"peak: {peak * jax.device_count() / 1e9:,.1f} GFLOP/s over {jax.device_count()} device(s) ({peak_source})")
  print(f"MFU: {utilisation:.1%}" if utilisation is not None else "MFU: unavailable (unknown peak; set --config.mfu.peak_flops)")
  memory = compiled.memory_analysis()
  if memory is not None:  # per device; activations and other temporaries of the step
    print(f"optimizer {cfg.optimizer.name}, grad_accum_steps {cfg.optimizer.grad_accum_steps}: "
          f"temporary memory {memory.temp_size_in_bytes / 2**20:.1f} MiB")


if __name__ == "__main__":
  main()
