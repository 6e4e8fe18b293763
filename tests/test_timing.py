"""The benchmarks' timing harness (`maxtrain/monitor/timing.py`): warm-up calls untimed, rounds that visit
every variant in turn, medians of wall and CPU time, and jitted work waited for inside the timing."""

import statistics
import time

import jax
import jax.numpy as jnp
import pytest

from maxtrain.monitor import timing


def test_rounds_interleave_the_variants_after_their_warmup():
  calls, befores = [], []
  variants = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
  timed = timing.interleaved(variants, 3, warmup=2, before=befores.append)
  assert calls == ["a", "a", "b", "b", "c", "c"] + ["a", "b", "c"] * 3
  assert befores == ["a", "b", "c"] * 3  # only before the timed calls
  assert list(timed) == ["a", "b", "c"] and all(len(t.walls) == len(t.cpus) == 3 for t in timed.values())


def test_median_wall_and_cpu_and_per_step():
  sleeps = iter([0.0, 0.05, 0.0, 0.01, 0.03])
  t = timing.repeated(lambda: time.sleep(next(sleeps)), 4, warmup=1)  # the first (0 s) call is the warm-up
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

  assert timing.repeated(spin, 2, warmup=0).cpu >= 0.02


def test_jitted_work_is_waited_for():
  f = jax.jit(lambda x: jnp.linalg.matrix_power(x, 64))
  x = jnp.eye(256) * 1.001
  f(x).block_until_ready()  # compiled outside the timing
  _, _, result = timing.once(lambda: f(x))
  assert result.is_ready()  # dispatch returns at once; the harness waited for the result
