"""The loop's events, for host work that rides on the loop without the loop knowing what it is (the
drills: `loop/drills.py` registers them, the one place they are wired). With no observer registered an
event does nothing and a batch goes to the step as it was read.

Events, in a step's order:
  batch(step, batch) -> batch   the batch of the step that will complete as `step`, before it is run
  step_ran(step)                the step ran (before the guards' verdict: a rollback redoes it)
  step_done(step)               after the step's eval and watchdog beat; before the stop request and the
                                checkpoint schedule
  save_started(step)            a checkpoint's (async) write started
  saved(step, path)             a checkpoint is complete on disk
and the async RL rollout side's (`posttrain/async_rollout.py`):
  rollout(round, stopping) -> bool   before the producer samples a round: True when an observer held it until
                                `stopping` (a hung worker), and the producer ends; an observer that raises
                                is a producer that dies
  publish(version) -> bool      whether a weight publish may complete (False: the transfer never does)
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

EVENTS = ("batch", "step_ran", "step_done", "save_started", "saved", "rollout", "publish")


class Observers:
  def __init__(self) -> None:
    self._on: dict[str, list[Callable]] = {name: [] for name in EVENTS}

  def on(self, event: str, fn: Callable) -> None:
    if event not in self._on:  # a typo would register a drill that never fires: fail where it is wired
      raise ValueError(f"unknown loop event {event!r}: one of {EVENTS}")
    self._on[event].append(fn)

  def batch(self, step: int, batch: dict[str, Any]) -> dict[str, Any]:
    for fn in self._on["batch"]:
      batch = fn(step, batch)
    return batch

  def step_ran(self, step: int) -> None:
    for fn in self._on["step_ran"]:
      fn(step)

  def step_done(self, step: int) -> None:
    for fn in self._on["step_done"]:
      fn(step)

  def save_started(self, step: int) -> None:
    for fn in self._on["save_started"]:
      fn(step)

  def saved(self, step: int, path: Path) -> None:
    for fn in self._on["saved"]:
      fn(step, path)

  def rollout(self, round_: int, stopping: threading.Event) -> bool:
    return any([fn(round_, stopping) for fn in self._on["rollout"]])

  def publish(self, version: int) -> bool:
    # Every observer is asked (each records what it fired), not only up to the first that says no.
    return all([fn(version) for fn in self._on["publish"]])
