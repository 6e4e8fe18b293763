"""Train-step throughput for a config: `python tools/bench.py [--config=...] [--config.key=value ...]`.

Builds the sharded state and the jitted step with the trainer's builder (`maxtrain/program/build.py`, through
the tools' harness `tools/harness.py`), feeds real batches from the configured token store, and prints step
time, tokens/s, achieved model FLOP/s (see `ModelConfig.train_flops_per_token`) and MFU against the device's
peak (`maxtrain/monitor/mfu.py`: the table by device kind, `mfu.peak_flops` when set, or on CPU a matmul peak
measured once per machine). Timing excludes compilation and a warm-up run of the steps.
"""

from __future__ import annotations

import argparse
import platform
import tempfile

import jax

import harness
from maxtrain.models.registry import param_count
from maxtrain.monitor import mfu, profiler


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
  parser.add_argument("--rounds", type=int, default=1, help="rounds of --steps steps; the median round is reported")
  parser.add_argument("--top-ops", type=int, default=0,
                      help="after timing, trace the steps again and print the N ops that took the most time")
  args, rest = parser.parse_known_args()
  cfg = harness.load(rest)
  step = harness.CompiledStep(cfg, args.steps)
  program, mesh, compile_s = step.program, step.mesh, step.compile_s
  # One warm-up run of the steps outside the timing, then the median round.
  timed = harness.repeated(step, args.rounds, warmup=1).per(args.steps)
  step_s, cpu_s = timed.wall, timed.cpu
  if args.top_ops:
    with jax.set_mesh(mesh):
      step.state = print_top_ops(step.compiled, step.state, step.batches, args.top_ops, step_s)
  state, compiled = step.state, step.compiled
  tokens = cfg.data.batch_size * cfg.data.seq_len
  flops_per_token = program.flops_per_token
  flops = flops_per_token * tokens
  peak, peak_source, peak_contended = mfu.peak_info(jax.devices()[0], cfg.mfu.peak_flops)
  utilisation = mfu.mfu(tokens / step_s, flops_per_token, jax.device_count(), peak)
  print(f"machine: {platform.machine()} {jax.device_count()} x {jax.devices()[0].device_kind}, "
        f"python {platform.python_version()}, jax {jax.__version__}")
  print(f"model: {param_count(state.params) / 1e6:.2f}M params, mesh {dict(mesh.shape)}, "
        f"batch {cfg.data.batch_size} x {cfg.data.seq_len}")
  print(f"compile {compile_s:.1f}s; step {step_s:.3f}s; {tokens / step_s:,.0f} tokens/s; "
        f"{flops / step_s / 1e9:.1f} model GFLOP/s ({flops_per_token / 1e6:.1f} "
        f"MFLOP/token)")
  # On a shared machine wall time depends on how the scheduler slices the cores; CPU time much less.
  print(f"CPU time {cpu_s:.3f}s per step (all of this process's threads)")
  print(f"peak: {peak * jax.device_count() / 1e9:,.1f} GFLOP/s over {jax.device_count()} device(s) ({peak_source})")
  note = (" (against a peak measured while other processes held the cores: reads high; it is re-measured at the "
          "next start)" if peak_contended else "")
  print(f"MFU: {utilisation:.1%}{note}" if utilisation is not None
        else "MFU: unavailable (unknown peak; set --config.mfu.peak_flops)")
  memory = compiled.memory_analysis()
  if memory is not None:  # per device; activations and other temporaries of the step
    print(f"optimizer {cfg.optimizer.name}, grad_accum_steps {program.plan.batch.num_microbatches}: "
          f"temporary memory {memory.temp_size_in_bytes / 2**20:.1f} MiB")


def print_top_ops(compiled, state, batches: list, n: int, step_s: float):
  """Traces `batches` (outside the timing: the trace costs time) and prints the top `n` ops."""
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    for batch in batches:
      state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    jax.profiler.stop_trace()
    ops = profiler.top_ops(trace_dir, len(batches), n)
  lines = profiler.hlo_op_lines(compiled.as_text(), [name for name, _, _ in ops])
  print(f"top {n} ops (ms per step, share of the {step_s * 1e3:.0f} ms step, runs per step; a while spans its body):")
  for name, ms, runs in ops:
    print(f"  {ms:8.1f} ms {ms / 1e3 / step_s:6.1%} {runs:5.0f}x  {name}: {lines.get(name, '')[:110]}")
  return state


if __name__ == "__main__":
  main()
