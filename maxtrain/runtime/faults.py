"""Fault injection for tests and drills (off unless configured).

Each fault fires at most once per output_dir, even across restarts, so a recovered run does not
fault again: a fired fault is recorded in `<output_dir>/faults_fired.json` (process N > 0:
`faults_fired.processN.json`). With several processes,
`faults.process` picks the one process that faults (-1: all; `faults.sigterm_process` may pick
another for the SIGTERM, so that one run can stop one process and hang another); `faults.slow_step_s` makes it a
straggler for the whole run (it is not a one-off, so it is not recorded).

This module is the drills themselves: the host side (`Faults`) and the in-graph side (`INPUT`, `attach`,
`inject`). No production module calls them: the builder wraps the step in `program/drills.py` only when an
in-graph drill is set (`in_graph_armed`), and `loop/drills.py` registers `Faults` on the loop's events
(`loop/observers.py`), the one place they are wired. The in-graph faults reach the wrapped step through one
replicated input, f32[2] = (make this step NaN?, loss scale), so one compiled program runs every step of a
drilled run; the default step has no such input.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from maxtrain.config import schema
from maxtrain.errors import UserError

log = logging.getLogger("maxtrain")
INPUT = "fault"  # the batch field that carries the step's in-graph fault
NONE = (0.0, 1.0)  # (not NaN, loss x 1): nothing injected
IN_GRAPH = ("nan_at_step", "spike_at_step")  # the drills that ride in the step (the rest are host-side)


def in_graph_armed(faults_cfg: schema.FaultDrills) -> bool:
  """Whether an in-graph drill is set: only then does the step take the fault input (`program/drills.py`)."""
  return any(faults_cfg[name] != -1 for name in IN_GRAPH)


def replicated(batch: dict[str, jax.Array]) -> NamedSharding:
  """The fault input's sharding for `batch`: replicated over the mesh its rows live on (the step's in_sharding)."""
  return NamedSharding(batch["inputs"].sharding.mesh, P())


def attach(batch: dict[str, jax.Array], fault: tuple[float, float], sharding: NamedSharding) -> dict[str, jax.Array]:
  """The train step's batch: `batch` and its fault input (NONE: nothing injected)."""
  return {**batch, INPUT: jax.device_put(np.asarray(fault, np.float32), sharding)}


def split(batch: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], jax.Array | None]:
  """(the batch's token rows, its fault input or None): the rows go to the model and its microbatches."""
  rows = dict(batch)
  return rows, rows.pop(INPUT, None)


def inject(fault: jax.Array | None, loss: jax.Array, grads: Any) -> tuple[jax.Array, Any]:
  """In the step: the loss and gradients with the step's fault applied (NaN, or x a spike factor);
  unchanged without a fault input (an eval batch, a caller that injects nothing)."""
  if fault is None:  # trace time: which program, not which step
    return loss, grads
  scale = jnp.where(fault[0] > 0, jnp.nan, fault[1])
  return loss * scale, jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)


class Faults:
  def __init__(self, faults_cfg: schema.FaultDrills, output_dir: Path, process_index: int = 0,
               before_kill: Any = lambda: None):
    self.cfg, self.process_index = faults_cfg, process_index
    self.targeted = faults_cfg.process in (-1, process_index)
    sigterm_process = faults_cfg.process if faults_cfg.sigterm_process == -1 else faults_cfg.sigterm_process
    self._sigterm_targeted = sigterm_process in (-1, process_index)
    # One record per process: processes that fire different faults never overwrite each other's.
    self._record = output_dir / ("faults_fired.json" if process_index == 0 else f"faults_fired.process{process_index}.json")
    self._fired = self._read() if self._record.exists() else set()
    self.before_kill = before_kill  # the trainer's: wait for the checkpoint saves in flight

  def _read(self) -> set[str]:
    try:
      fired = json.loads(self._record.read_text())
      if not isinstance(fired, list) or not all(isinstance(name, str) for name in fired):
        raise ValueError
      return set(fired)
    except (OSError, ValueError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
      raise UserError(f"{self._record} is not a JSON list of fault names (the record of injected faults that "
                      "already fired): fix or delete it (deleting re-arms every config.faults.* fault)") from None

  def _fire(self, name: str, step: int) -> bool:
    if not self._armed(name, step):
      return False
    self._fired.add(name)
    self._record.write_text(json.dumps(sorted(self._fired)))
    log.warning("fault injection: %s at step %d", name, step)
    return True

  def fire(self, name: str, step: int) -> bool:
    """Whether the fault `name` (a config.faults key) fires at `step`, recording it as fired (once)."""
    return self._fire(name, step)

  def after_step(self, step: int) -> None:
    if self.targeted and self.cfg.slow_step_s > 0:
      time.sleep(self.cfg.slow_step_s)  # the fault itself: this host's work per step takes longer
    self.in_graph_ran(step)
    if self._fire("sigterm_at_step", step):
      os.kill(os.getpid(), signal.SIGTERM)
    if self._fire("crash_at_step", step):
      raise RuntimeError(f"fault injection: crash after step {step}")
    if self._fire("kill_at_step", step) or self._kill_every(step):
      self.before_kill()  # a deterministic drill: the saves in flight land first (kill_during_save covers them)
      os.kill(os.getpid(), signal.SIGKILL)
    if self._fire("hang_at_step", step):
      threading.Event().wait()  # blocks forever, like a hung collective; the watchdog must fire

  def in_graph_ran(self, step: int) -> None:
    """Records the in-graph faults of a completed step as fired (`after_step` does it too); a loop that
    reacts to the step before `after_step` (a rollback) calls it first, so a redone step is clean."""
    for name in ("nan_at_step", "spike_at_step"):
      self._fire(name, step)

  def _kill_every(self, step: int) -> bool:
    """Every `kill_every_steps` steps since this attempt's first, until `kill_times` kills were recorded."""
    every = self.cfg.kill_every_steps
    if every <= 0 or not self.targeted:
      return False
    self._attempt_first = getattr(self, "_attempt_first", step)
    kills = sum(name.startswith("kill_every#") for name in self._fired)
    if kills >= self.cfg.kill_times or step - self._attempt_first + 1 < every:
      return False
    self._fired.add(f"kill_every#{kills + 1}")
    self._record.write_text(json.dumps(sorted(self._fired)))
    log.warning("fault injection: kill_every_steps (%d of %d) at step %d", kills + 1, self.cfg.kill_times, step)
    return True

  def _armed(self, name: str, step: int) -> bool:
    # The in-graph faults feed a replicated input: every process must agree on them.
    targeted = {"nan_at_step": True, "spike_at_step": True, "sigterm_at_step": self._sigterm_targeted}.get(
        name, self.targeted)
    return targeted and self.cfg[name] == step and name not in self._fired

  def in_graph(self, step: int) -> tuple[float, float]:
    """(NaN flag, loss scale) for the step that will complete as `step`: the step's `fault` input.
    Recorded as fired only when that step completes (`after_step`): a batch built but never run
    (the process died first) does not use the fault up."""
    if self._armed("nan_at_step", step):
      return 1.0, 1.0
    if self._armed("spike_at_step", step):
      return 0.0, float(self.cfg.spike_factor)
    return 0.0, 1.0

  def after_save_complete(self, step: int, path: Path) -> None:
    # Bit rot in a finished checkpoint: the next read (resume, rollback, generate) must catch it. Process 0
    # only: the files are shared, and a second flip of the same byte would undo the first.
    if self.process_index == 0 and self._fire("corrupt_checkpoint_at_step", step):
      victim = max((p for p in path.rglob("*") if p.is_file() and p.name != "maxtrain_manifest.json"),
                   key=lambda p: p.stat().st_size)
      data = bytearray(victim.read_bytes())
      data[len(data) // 2] ^= 0xFF
      victim.write_bytes(bytes(data))

  def after_save_started(self, step: int) -> None:
    # The async write is in flight: SIGKILL now leaves an incomplete checkpoint behind.
    if self._fire("kill_during_save_at_step", step):
      os.kill(os.getpid(), signal.SIGKILL)
