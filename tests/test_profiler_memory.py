"""Profiler capture into the TensorBoard dir, and memory reporting (host fallback on CPU)."""

import types

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.monitor import memory, profiler


def test_profiler_writes_trace_of_chosen_steps(tmp_path):
  logdir = tmp_path / "tensorboard"
  prof = profiler.Profiler(logdir, start_step=1, num_steps=2)
  f = jax.jit(lambda x: jnp.tanh(x @ x))
  x = jnp.ones((64, 64))
  active = []
  for step in range(4):
    prof.maybe_start(step)
    with prof.step_annotation(step):
      x = f(x)
    active.append(prof.active)
    prof.maybe_stop(step, x)
  prof.stop()
  assert active == [False, True, True, False]
  traces = list(logdir.glob("plugins/profile/*/*.xplane.pb"))
  assert len(traces) == 1 and traces[0].stat().st_size > 0


def test_profiler_window_logic(monkeypatch):
  calls = []
  monkeypatch.setattr(jax.profiler, "start_trace", lambda logdir: calls.append(("start", logdir)))
  monkeypatch.setattr(jax.profiler, "stop_trace", lambda: calls.append(("stop",)))

  def run(start_step, num_steps, steps):
    calls.clear()
    prof = profiler.Profiler("tb", start_step, num_steps)
    traced = []
    for step in steps:
      prof.maybe_start(step)
      traced.append(prof.active)
      prof.maybe_stop(step)
    prof.stop()
    return [s for s, t in zip(steps, traced) if t], [c[0] for c in calls]

  assert run(-1, 3, range(10)) == ([], [])  # off
  assert run(2, 3, range(10)) == ([2, 3, 4], ["start", "stop"])
  assert run(2, 3, range(3, 10)) == ([3, 4], ["start", "stop"])  # resumed inside the window
  assert run(2, 3, range(6, 10)) == ([], [])  # resumed past it
  assert run(8, 5, range(10)) == ([8, 9], ["start", "stop"])  # loop ended first: stop() closes it


def test_memory_falls_back_to_host_rss_on_cpu():
  before = memory.device_memory()
  assert before["source"] == "host" and before["bytes_limit"] is None
  block = np.ones(128 * 2**20, np.uint8)  # Touched pages: RSS must grow by about 128 MiB.
  after = memory.device_memory()
  assert after["bytes_in_use"] - before["bytes_in_use"] > 100 * 2**20
  assert after["peak_bytes_in_use"] >= after["bytes_in_use"] > 0
  del block
  scalars = memory.memory_scalars(after)
  assert set(scalars) == {"memory/host_in_use_gib", "memory/host_peak_gib"}


def test_memory_reports_the_fullest_device():
  def dev(in_use, peak):
    stats = {"bytes_in_use": in_use, "peak_bytes_in_use": peak, "bytes_limit": 80 * 2**30}
    return types.SimpleNamespace(memory_stats=lambda: stats)

  mem = memory.device_memory([dev(1 * 2**30, 2 * 2**30), dev(3 * 2**30, 5 * 2**30)])
  assert mem == {"source": "device", "bytes_in_use": 3 * 2**30, "peak_bytes_in_use": 5 * 2**30,
                 "bytes_limit": 80 * 2**30}
  assert memory.memory_scalars(mem) == {"memory/device_in_use_gib": 3.0, "memory/device_peak_gib": 5.0}
