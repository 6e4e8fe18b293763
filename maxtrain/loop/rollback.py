"""Rollback, in one place: the host side of the guards (`program/guards.py` does the in-graph part)
decides what to do about a step whose update was skipped for a non-finite loss or a loss spike (log
it, roll back to a checkpoint, or stop); the rollback budget is kept beside the checkpoints; and
`Rollbacks.perform` restores the newest checkpoint from before the fault.

The flags are read one step late: after dispatching step n the host reads step n-1's flags, which
are ready (or nearly) by then, so the device never waits for the host. The last step is read at once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Sequence

import jax

from maxtrain.config import schema
from maxtrain.errors import Aborted, UserError
from maxtrain.monitor import events as ev

log = logging.getLogger("maxtrain")
ROLLBACKS_FILE = "maxtrain_rollbacks.json"  # beside the step directories: the run's rollback count
FLAGS = ("nonfinite", "nonfinite_update", "spike", "loss_zscore", "consecutive_bad", "loss")


@dataclasses.dataclass(frozen=True)
class Rollback:
  step: int  # the step at which the fault was seen
  first_bad: int  # restore a checkpoint from before this step
  reason: str


class GuardPolicy:
  def __init__(self, guards_cfg: schema.Guards, events: ev.EventLog, rollbacks_used: int, *,
               unit: str = "step", signal: str = "loss"):
    self.cfg = guards_cfg
    self.events = events
    self.rollbacks = rollbacks_used
    self._unread: tuple[int, Any] | None = None  # (step, metrics) whose flags are read at the next step
    # What a step is and which value the in-graph spike check watches (RL: "round", "grad_norm").
    self.unit, self.signal = unit, signal

  def after_step(self, step: int, metrics: Any, *, last: bool) -> Rollback | None:
    """Reads the previous step's flags (and this one's if it is the last); a Rollback to perform, or
    None. Raises Aborted when the policy says stop."""
    ready = [self._unread] if self._unread else []
    self._unread = (step, metrics)
    if last:
      ready, self._unread = ready + [self._unread], None
    for checked_step, checked_metrics in ready:
      rollback = self._check(checked_step, jax.device_get({k: checked_metrics[k] for k in FLAGS}))
      if rollback is not None:
        self._unread = None  # the steps after the fault are undone with it
        return self._use_budget(rollback)
    return None

  def after_updates(self, step: int, updates: Sequence[dict], per_step: int) -> Rollback | None:
    """A step made of `per_step` guarded optimizer updates whose flags are all read at once (a GRPO
    round; the events name the update): a Rollback to perform, or None. Raises Aborted like after_step."""
    for i, flags in enumerate(jax.device_get(list(updates)), start=1):
      rollback = self._check(step, flags, update=i, per_step=per_step)
      if rollback is not None:
        return self._use_budget(rollback)
    return None

  def _check(self, step: int, flags: dict, update: int = 0, per_step: int = 1) -> Rollback | None:
    g, signal, at = self.cfg, self.signal, f"{self.unit} {step}" + (f", update {update}" if update else "")
    extra = {"update": update} if update else {}
    if flags["nonfinite"]:
      what = "update or new parameters (finite loss and gradients)" if flags["nonfinite_update"] else \
          "loss or gradients"
      bad = int(flags["consecutive_bad"])
      self.events.emit(ev.NAN_SKIP, step, count=1, consecutive=bad, what=what, **extra)
      log.warning("%s: non-finite %s; update skipped (%d in a row)", at, what, bad)
      if bad >= g.max_consecutive_bad:
        done = (step - 1) * per_step + max(update, 1)  # optimizer updates so far; the streak's first is done - bad + 1
        return Rollback(step, first_bad=(done - bad) // per_step + 1,
                        reason=f"{bad} non-finite {'updates' if update else 'steps'} in a row")
    if flags["spike"]:
      self.events.emit(ev.SPIKE, step, **{signal: float(flags[signal])}, zscore=float(flags["loss_zscore"]),
                       action=g.spike_action, **extra)
      log.warning("%s: %s spike %.4f (z-score %.1f > %.1f); update skipped; action %s", at, signal, flags[signal],
                  flags["loss_zscore"], g.spike_zscore, g.spike_action)
      if g.spike_action == "abort":
        raise Aborted(f"{signal} spike at {at}: {signal} {flags[signal]:.4f}, z-score {flags['loss_zscore']:.1f} > "
                      f"guards.spike_zscore={g.spike_zscore} (guards.spike_action=abort)")
      if g.spike_action == "rollback":
        return Rollback(step, first_bad=step, reason=f"{signal} spike (z-score {flags['loss_zscore']:.1f})")
    return None

  def _use_budget(self, rollback: Rollback) -> Rollback:
    if self.rollbacks >= self.cfg.max_rollbacks:
      raise Aborted(f"{rollback.reason} at {self.unit} {rollback.step}, and guards.max_rollbacks={self.cfg.max_rollbacks} "
                    "rollbacks were already used in this run")
    self.rollbacks += 1
    return rollback


class RollbackBudget:
  """The run's rollback count, kept with the checkpoints, not re-counted from the telemetry log: a file
  beside them, rewritten at each rollback (so a crash right after one still counts it), and each
  checkpoint's meta (so it travels with a checkpoint to object storage and a new machine). The larger
  of the two counts."""

  def __init__(self, checkpoint_dir: Path):
    self.file = checkpoint_dir / ROLLBACKS_FILE

  def used(self, resume_meta: dict | None) -> int:
    counts = [0, int((resume_meta or {}).get("rollbacks", 0))]
    if self.file.exists():
      try:
        counts.append(int(json.loads(self.file.read_text())["rollbacks"]))
      except (ValueError, KeyError, TypeError):
        raise UserError(f"{self.file} is not maxtrain's rollback record (expected {{\"rollbacks\": N}}): "
                        "restore it, or delete it to reset the run's rollback budget (guards.max_rollbacks)") from None
    return max(counts)

  def record(self, count: int, record: dict) -> None:
    if jax.process_index() == 0:
      tmp = self.file.with_suffix(".tmp")
      tmp.write_text(json.dumps({"rollbacks": count, "last": record}) + "\n")
      os.replace(tmp, self.file)  # atomic: a crash leaves the old count or the new one


class Rollbacks:
  """The run's rollback component: the policy over the guards' flags, the budget, and the restore."""

  def __init__(self, guards_cfg: schema.Guards, events: ev.EventLog, checkpoints: Any,
               resume_path: Path | None, *, unit: str = "step", signal: str = "loss"):
    self.budget = RollbackBudget(checkpoints.store.directory)
    meta = checkpoints.read_meta(resume_path) if resume_path is not None else None
    self.policy = GuardPolicy(guards_cfg, events, self.budget.used(meta), unit=unit, signal=signal)
    self.checkpoints, self.events, self.max_rollbacks = checkpoints, events, guards_cfg.max_rollbacks

  @property
  def used(self) -> int:
    """The run's rollbacks so far, restarts included: saved in every checkpoint's meta (identity.RunIdentity)."""
    return self.policy.rollbacks

  def after_step(self, step: int, metrics: Any, *, last: bool) -> Rollback | None:
    return self.policy.after_step(step, metrics, last=last)

  def after_updates(self, step: int, updates: Sequence[dict], per_step: int) -> Rollback | None:
    return self.policy.after_updates(step, updates, per_step)

  def perform(self, rollback: Rollback, state_spec: Any, initialize: Any, per_step: int = 1) -> Any:
    """The newest checkpoint's state from before the fault (`initialize()` when there is none). The data
    loader keeps going forward, so the batches that led to the fault are not replayed. `per_step`:
    optimizer steps per loop step (a GRPO round's updates), for the step the event names."""
    t0 = time.monotonic()
    state = self.checkpoints.restore_before(rollback.first_bad, state_spec)
    if state is None:
      state = initialize()
    step, count = int(state.step) // per_step, self.policy.rollbacks
    record = self.events.emit(ev.ROLLBACK, step, from_step=rollback.step, to_step=step,
                              seconds=time.monotonic() - t0, reason=rollback.reason)
    self.budget.record(count, record)
    log.warning("rollback %d/%d: %s at %s %d; restored %s %d; the data skips ahead past the fault", count,
                self.max_rollbacks, rollback.reason, self.policy.unit, rollback.step, self.policy.unit, step)
    return state
