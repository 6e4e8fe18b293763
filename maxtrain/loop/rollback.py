"""The host side of the guards (`guards.py` does the in-graph part): what to do about a step whose
update was skipped for a non-finite loss or a loss spike: log it, roll back to a checkpoint, or stop.

The flags are read one step late: after dispatching step n the host reads step n-1's flags, which
are ready (or nearly) by then, so the device never waits for the host. The last step is read at once.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import ml_collections

from maxtrain.errors import Aborted
from maxtrain.monitor import events as ev

log = logging.getLogger("maxtrain")
FLAGS = ("nonfinite", "nonfinite_update", "spike", "loss_zscore", "consecutive_bad", "loss")


@dataclasses.dataclass(frozen=True)
class Rollback:
  step: int  # the step at which the fault was seen
  first_bad: int  # restore a checkpoint from before this step
  reason: str


class GuardPolicy:
  def __init__(self, guards_cfg: ml_collections.ConfigDict, events: ev.EventLog, rollbacks_used: int):
    self.cfg = guards_cfg
    self.events = events
    self.rollbacks = rollbacks_used
    self._unread: tuple[int, Any] | None = None  # (step, metrics) whose flags are read at the next step

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

  def _check(self, step: int, flags: dict) -> Rollback | None:
    g = self.cfg
    if flags["nonfinite"]:
      what = "update or new parameters (finite loss and gradients)" if flags["nonfinite_update"] else \
          "loss or gradients"
      self.events.emit(ev.NAN_SKIP, step, count=1, consecutive=int(flags["consecutive_bad"]), what=what)
      log.warning("step %d: non-finite %s; update skipped (%d in a row)", step, what, flags["consecutive_bad"])
      if flags["consecutive_bad"] >= g.max_consecutive_bad:
        return Rollback(step, first_bad=step - int(flags["consecutive_bad"]) + 1,
                        reason=f"{flags['consecutive_bad']} non-finite steps in a row")
    if flags["spike"]:
      self.events.emit(ev.SPIKE, step, loss=float(flags["loss"]), zscore=float(flags["loss_zscore"]),
                       action=g.spike_action)
      log.warning("step %d: loss spike %.4f (z-score %.1f > %.1f); update skipped; action %s", step, flags["loss"],
                  flags["loss_zscore"], g.spike_zscore, g.spike_action)
      if g.spike_action == "abort":
        raise Aborted(f"loss spike at step {step}: loss {flags['loss']:.4f}, z-score {flags['loss_zscore']:.1f} > "
                      f"guards.spike_zscore={g.spike_zscore} (guards.spike_action=abort)")
      if g.spike_action == "rollback":
        return Rollback(step, first_bad=step, reason=f"loss spike (z-score {flags['loss_zscore']:.1f})")
    return None

  def _use_budget(self, rollback: Rollback) -> Rollback:
    if self.rollbacks >= self.cfg.max_rollbacks:
      raise Aborted(f"{rollback.reason} at step {rollback.step}, and guards.max_rollbacks={self.cfg.max_rollbacks} "
                    "rollbacks were already used in this run")
    self.rollbacks += 1
    return rollback
