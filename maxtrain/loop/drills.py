"""The one place the host-side drills (config.faults.*, `runtime/faults.py`) are wired: each is an
observer of the loop's events (`loop/observers.py`), and a drilled run's batches get their step's fault
input here (the step takes it only then: `program/drills.py`). No other module of `loop/`, `posttrain/`,
`program/` or `models/` names a fault (tests/test_architecture.py checks it).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from maxtrain.config import schema
from maxtrain.loop.observers import Observers
from maxtrain.runtime import faults


def install(observers: Observers, faults_cfg: schema.FaultDrills, out_dir: Path, process_index: int,
            settle: Callable[[], None]) -> faults.Faults:
  """Registers config.faults' drills on `observers`. Reads the record of the drills that already fired
  (UserError when it is unreadable: exit 2, before compiling). `settle`: waits for the saves in flight
  (a kill drill lets them land first)."""
  host = faults.Faults(faults_cfg, out_dir, process_index, before_kill=settle)
  if faults.in_graph_armed(faults_cfg):  # the drilled step (program/drills.py) takes a fault input on every batch
    observers.on("batch", lambda step, batch: faults.attach(batch, host.in_graph(step), faults.replicated(batch)))
  observers.on("step_ran", host.in_graph_ran)  # before a rollback: a redone step is clean
  observers.on("step_done", host.after_step)
  observers.on("save_started", host.after_save_started)
  observers.on("saved", host.after_save_complete)
  observers.on("rollout", lambda round_, stopping: _rollout_drills(host, round_, stopping))
  observers.on("publish", lambda version: not host.fire("publish_stall_at_step", version))
  return host


def _rollout_drills(host: faults.Faults, round_: int, stopping: threading.Event) -> bool:
  """The async rollout side's drills before a round: True when it hung (until the run stopped)."""
  if host.fire("rollout_hang_at_step", round_):
    stopping.wait()  # a rollout worker that hangs
    return True
  if host.fire("rollout_die_at_step", round_):  # a rollout worker that dies: the producer's exception
    raise RuntimeError(f"fault injection: the rollout producer died before round {round_}")
  return False
