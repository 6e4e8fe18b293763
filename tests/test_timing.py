"""The tools' compiled-step harness (`tools/harness.py`, outside the package): warm-up calls untimed, rounds that
visit every variant in turn, medians of wall and CPU time, jitted work waited for inside the timing, and the
compiled step it builds is the trainer's."""

import importlib.util
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.program import state as state_lib
from tiny import TINY_MODEL

# Tools import it as `import harness` (tools/ is on sys.path when one runs); a test loads it by path.
_SPEC = importlib.util.spec_from_file_location("harness", Path(__file__).resolve().parents[1] / "tools/harness.py")
harness = sys.modules["harness"] = importlib.util.module_from_spec(_SPEC)  # dataclasses look their module up
_SPEC.loader.exec_module(harness)


def test_rounds_interleave_the_variants_after_their_warmup():
  calls, befores = [], []
  variants = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
  timed = harness.interleaved(variants, 3, warmup=2, before=befores.append)
  assert calls == ["a", "a", "b", "b", "c", "c"] + ["a", "b", "c"] * 3
  assert befores == ["a", "b", "c"] * 3  # only before the timed calls
  assert list(timed) == ["a", "b", "c"] and all(len(t.walls) == len(t.cpus) == 3 for t in timed.values())


def test_median_wall_and_cpu_and_per_step():
  sleeps = iter([0.0, 0.05, 0.0, 0.01, 0.03])
  t = harness.repeated(lambda: time.sleep(next(sleeps)), 4, warmup=1)  # the first (0 s) call is the warm-up
  # No bounds on how long a sleep took (a loaded machine oversleeps): each call is timed at least as long
  # as it slept, in order, and the figures are the median and the minimum of those timings.
  assert len(t.walls) == 4 and all(w >= s for w, s in zip(t.walls, [0.05, 0.0, 0.01, 0.03]))
  assert t.walls[0] == max(t.walls) and t.wall == statistics.median(t.walls) and t.min_wall == min(t.walls)
  assert t.cpu < 0.01  # sleeping uses no CPU: the figure a shared machine disturbs least
  assert t.per(4).walls == pytest.approx([w / 4 for w in t.walls])


def test_spinning_counts_as_cpu_time():
  def spin():
    end = time.process_time() + 0.02
    while time.process_time() < end:
      pass

  assert harness.repeated(spin, 2, warmup=0).cpu >= 0.02


def test_jitted_work_is_waited_for():
  f = jax.jit(lambda x: jnp.linalg.matrix_power(x, 64))
  x = jnp.eye(256) * 1.001
  f(x).block_until_ready()  # compiled outside the timing
  _, _, result = harness.once(lambda: f(x))
  assert result.is_ready()  # dispatch returns at once; the harness waited for the result


def test_the_compiled_step_is_the_trainers_step(store, tmp_path):
  """Two steps through the harness equal two steps of the builder's jitted train_step from a fresh state on the
  same batches (bitwise: one program, compiled ahead of time or on first call)."""
  cfg = harness.load([*TINY_MODEL, f"--config.data.path={store}", f"--config.output_dir={tmp_path}"])
  devices = jax.devices()[:1]
  step = harness.CompiledStep(cfg, 2, devices)
  fresh = state_lib.initialize(step.program.state, step.mesh)  # before the harness's state is donated
  metrics = step()
  assert int(step.state.step) == 2 and step.compile_s > 0 and step.tokens == 8 * 32
  with jax.set_mesh(step.mesh):
    for batch in step.batches:
      fresh, expected = step.program.train_step(fresh, batch)
  np.testing.assert_array_equal(np.asarray(metrics["loss"]), np.asarray(expected["loss"]))
