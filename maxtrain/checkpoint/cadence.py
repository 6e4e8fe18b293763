"""When each checkpoint tier saves: every N steps (`fixed`), every M minutes, or from the measured save
cost and failure rate (`auto`).

`auto` chooses each tier's interval near the Young/Daly optimum tau = sqrt(2 C M): C is the save's
measured cost to the loop (its blocking seconds, the mean of the tier's saves so far), M the run's
mean time between failures from its event history (wall span of the run / (failures + 1), with the
configured prior counted as one more failure-free interval, so the first attempt uses the prior alone).
Expected lost work per failure is then about tau / 2 of recomputation (plus the restart).

Time-based intervals are converted to steps with the measured step time, and the conversion happens
only at decision points every process reaches at the same step (the attempt's third step, then each save
of the tier): process 0 decides and the others read its decision from the key-value store, so every process
saves at the same step (the durable save is collective) without a per-step exchange. Each decision is
an event (`checkpoint_cadence`) with its inputs.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from maxtrain.checkpoint import policy
from maxtrain.monitor import events as ev

log = logging.getLogger("maxtrain")
WARMUP_STEPS = 3  # the first decision, this many steps into an attempt: compiled, and two steps timed
_DECISION_TIMEOUT_S = 600.0


def observed_mtbf(records: list[dict], prior_s: float, now_wall: float) -> tuple[float, int, float]:
  """policy.observed_mtbf over a run's events: a failure is an attempt that ended in a crash or a hang."""
  return policy.observed_mtbf(records, prior_s, now_wall, (ev.CRASH, ev.HANG))


class Cadence:
  """Per tier (`local`, `durable`): is a save due at this step."""

  def __init__(self, ck: Any, events: Any, kv: Any = None, process_index: int = 0, events_path: Path | None = None):
    self.ck, self.events, self.kv, self.process_index = ck, events, kv, process_index
    self.every = {"durable": int(ck.every_steps), "local": int(ck.local_every_steps)}
    self.mode = ck.cadence
    self.next: dict[str, int | None] = {"durable": None, "local": None}
    self.costs: dict[str, list[float]] = {"durable": [], "local": []}
    self._last_t: float | None = None
    self._first_step: int | None = None  # the attempt's first step (a resumed run starts past 0)
    self._decisions = 0  # numbers the key-value keys: a step run again after a rollback decides anew
    self._step_times: list[float] = []
    self.mtbf = (ck.mtbf_prior_minutes * 60.0, 0, 0.0)
    if self.mode == "auto" and events_path is not None and events_path.exists():
      self.mtbf = observed_mtbf(ev.read_events(events_path), ck.mtbf_prior_minutes * 60.0, time.time())

  @property
  def timed(self) -> bool:
    return self.mode == "auto" or self.ck.every_minutes > 0

  def observe(self, step: int, seconds_outside: float = 0.0) -> None:
    """Called after each step: the host's time between steps (less a save's blocking) is the step time."""
    now = time.monotonic()
    if self._first_step is None:
      self._first_step = step
    if self._last_t is not None:
      self._step_times = (self._step_times + [max(now - self._last_t - seconds_outside, 1e-6)])[-20:]
    self._last_t = now

  def step_time_s(self) -> float:
    return policy.median_step_s(self._step_times)

  def due(self, tier: str, step: int) -> bool:
    warmup = self._first_step is not None and step == self._first_step + WARMUP_STEPS - 1
    if self.timed and warmup and self.next[tier] is None:
      self.decide(tier, step, saved=False)
    return policy.is_due(step, self.every[tier], self.next[tier], self.mode == "auto" and bool(self.costs[tier]))

  def saved(self, tier: str, step: int, cost_s: float) -> None:
    """A save of `tier` at `step` cost the loop `cost_s`: the next interval is decided now."""
    self.costs[tier].append(cost_s)
    if self.timed:
      self.decide(tier, step, saved=True)

  def decide(self, tier: str, step: int, *, saved: bool) -> int | None:
    self._decisions += 1
    key = f"ckpt-cadence/{tier}/{self._decisions}"
    if self.kv is not None and self.process_index != 0:
      value = self.kv.get(key, _DECISION_TIMEOUT_S)
      self.next[tier] = None if value in (None, "none") else int(value)
      return self.next[tier]
    decision = self._interval(tier)
    self.next[tier] = None if decision is None else step + decision["interval_steps"]
    if self.kv is not None:
      self.kv.set(key, "none" if self.next[tier] is None else str(self.next[tier]))
    if decision is not None:
      self.events.emit(ev.CHECKPOINT_CADENCE, step, tier=tier, mode=self.mode, next_step=self.next[tier], **decision)
      log.info("checkpoint cadence (%s, %s tier): next save at step %d, every %d steps (%.2fs): %s", self.mode, tier,
               self.next[tier], decision["interval_steps"], decision["interval_s"], decision["why"])
    return self.next[tier]

  def _interval(self, tier: str) -> dict | None:
    return policy.cadence_interval(self.mode, tier, self.costs[tier], self.mtbf, self.step_time_s(),
                                   self.ck.every_minutes, self.ck.mtbf_prior_minutes)
