"""The tools' one compiled-step harness (outside production code: only tools/ and tests use it).

Timing: warm-up, then rounds that time every variant in turn, each timing wall and CPU time
(`time.process_time`: all of this process's threads), reported as medians.
Why interleaved rounds: on a machine shared with other jobs, load comes and goes; timing variant A's
runs then variant B's lets a burst land on one of them only, while round-robin spreads it over all.
Why CPU time beside wall time: the scheduler's slicing of the cores moves wall time far more than the
CPU work a variant does (BENCHMARKS.md).
A variant is a no-argument callable; what it returns is waited for (`jax.block_until_ready`) inside
the timing, so asynchronously dispatched work is counted.

The compiled step: `load` (the config with its platform environment applied before the backend starts),
`CompiledStep` (the trainer's program, an initialized state, real batches and the step compiled for them:
a call runs the steps) and `compiled_memory` (the step compiled from abstract inputs, for memory figures).
Host-only benchmarks import this module without starting jax: jax and the program are imported by the
functions that build a step, and a result can hold a jax array only once jax is imported.

Tools run as `python tools/x.py` (tools/ is then first on sys.path) and import it as `import harness`.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Any, Callable, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Timing:
  """One variant's timed runs, in seconds."""
  walls: tuple[float, ...]
  cpus: tuple[float, ...]

  @property
  def wall(self) -> float:
    return statistics.median(self.walls)

  @property
  def cpu(self) -> float:
    return statistics.median(self.cpus)

  @property
  def min_wall(self) -> float:
    return min(self.walls)

  def per(self, n: int) -> "Timing":
    """Each run divided by `n`: per step when a run is `n` steps."""
    return Timing(tuple(w / n for w in self.walls), tuple(c / n for c in self.cpus))


def _wait(result: Any) -> Any:
  if result is not None and "jax" in sys.modules:
    sys.modules["jax"].block_until_ready(result)  # leaves that are not arrays pass through
  return result


def once(fn: Callable[[], Any]) -> tuple[float, float, Any]:
  """(wall, CPU) seconds of one call of `fn`, its result waited for, and the result."""
  t0, c0 = time.perf_counter(), time.process_time()
  result = _wait(fn())
  return time.perf_counter() - t0, time.process_time() - c0, result


def interleaved(variants: Mapping[str, Callable[[], Any]], rounds: int, *, warmup: int = 1,
                before: Callable[[str], Any] | None = None) -> dict[str, Timing]:
  """Each variant called `warmup` times untimed (the first call of a jitted function compiles), then
  `rounds` rounds of one timed call of each variant in turn. `before(name)` runs untimed before each
  timed call (e.g. dropping the page cache, or a barrier between processes)."""
  for fn in variants.values():
    for _ in range(warmup):
      _wait(fn())
  walls: dict[str, list[float]] = {name: [] for name in variants}
  cpus: dict[str, list[float]] = {name: [] for name in variants}
  for _ in range(rounds):
    for name, fn in variants.items():
      if before is not None:
        before(name)
      wall, cpu, _ = once(fn)
      walls[name].append(wall)
      cpus[name].append(cpu)
  return {name: Timing(tuple(walls[name]), tuple(cpus[name])) for name in variants}


def repeated(fn: Callable[[], Any], rounds: int, *, warmup: int = 1) -> Timing:
  """One variant's `rounds` timed calls after `warmup` untimed ones."""
  return interleaved({"": fn}, rounds, warmup=warmup)[""]


def load(argv: Sequence[str]) -> Any:
  """The config of `--config=PATH --config.KEY=VALUE ...`, with `runtime.platform`'s XLA and plugin
  variables applied: they count only before the backend starts, as in the trainer."""
  from maxtrain import config as config_lib
  from maxtrain.runtime import platform as platform_env

  cfg = config_lib.load(argv)
  platform_env.apply(cfg.runtime)
  return cfg


class CompiledStep:
  """The trainer's compiled train step for `cfg`, with its own state and `steps` real batches (from the
  configured token store); a call runs the `steps` steps and returns the last step's metrics."""

  def __init__(self, cfg: Any, steps: int, devices: Sequence[Any] | None = None):
    import jax

    from maxtrain.loop.data import Data
    from maxtrain.program import build as program_lib, state as state_lib

    self.cfg, self.tokens = cfg, cfg.data.batch_size * cfg.data.seq_len
    self.program = program_lib.program_for(cfg, jax.devices() if devices is None else devices)
    self.mesh, self.state = self.program.mesh, state_lib.initialize(self.program.state, self.program.mesh)
    data = Data(cfg, self.program.batch_shardings)
    self.batches = [data.next_batch()[0] for _ in range(steps)]
    with jax.set_mesh(self.mesh):
      lowered = self.program.train_step.lower(self.state, self.batches[0])
      self.compile_s, _, self.compiled = once(lowered.compile)

  def __call__(self) -> Any:
    import jax

    with jax.set_mesh(self.mesh):
      for batch in self.batches:
        self.state, metrics = self.compiled(self.state, batch)
    return metrics


def compiled_memory(cfg: Any, devices: Sequence[Any] | None = None) -> tuple[Any, Any]:
  """(program, memory_analysis) of the train step compiled from abstract inputs: nothing allocated, no data read."""
  import jax

  from maxtrain.program import build as program_lib

  program = program_lib.program_for(cfg, jax.devices() if devices is None else devices, require_data=False)
  return program, program.lower().compile().memory_analysis()
