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
import math
import time
from pathlib import Path
from typing import Any

from maxtrain.monitor import events as ev

log = logging.getLogger("maxtrain")
WARMUP_STEPS = 3  # the first decision, this many steps into an attempt: compiled, and two steps timed
_DECISION_TIMEOUT_S = 600.0


def young_daly_s(cost_s: float, mtbf_s: float) -> float:
  return math.sqrt(2.0 * cost_s * mtbf_s)


def observed_mtbf(records: list[dict], prior_s: float, now_wall: float) -> tuple[float, int, float]:
  """(M seconds, failures, observed span seconds) from a run's events: the span from its first record to
  now, plus the prior, over failures + 1. A failure is an attempt that ended in a crash or a hang (counted
  once per attempt, however many processes and the supervisor reported it)."""
  if not records:
    return prior_s, 0, 0.0
  span = max(0.0, now_wall - min(r["wall"] for r in records))
  failed = {r.get("attempt") for r in records if r.get("kind") in (ev.CRASH, ev.HANG)}
  return (span + prior_s) / (len(failed) + 1), len(failed), span


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
    if not self._step_times:
      return float("nan")
    ordered = sorted(self._step_times)
    return ordered[len(ordered) // 2]  # the median: a save or an eval in the window does not skew it

  def due(self, tier: str, step: int) -> bool:
    warmup = self._first_step is not None and step == self._first_step + WARMUP_STEPS - 1
    if self.timed and warmup and self.next[tier] is None:
      self.decide(tier, step, saved=False)
    if self.mode == "auto" and self.costs[tier]:
      return self.next[tier] == step  # the measured interval replaces the configured one
    fixed = self.every[tier] > 0 and step % self.every[tier] == 0
    return fixed or self.next[tier] == step

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
    step_s = self.step_time_s()
    if not math.isfinite(step_s):
      return None
    if self.mode == "auto" and self.costs[tier]:
      cost = sum(self.costs[tier]) / len(self.costs[tier])
      mtbf, failures, span = self.mtbf
      interval_s = young_daly_s(cost, mtbf)
      why = (f"sqrt(2 C M), C={cost:.4f}s (mean blocking of {len(self.costs[tier])} saves), M={mtbf:.1f}s "
             f"({failures} failures in {span:.0f}s + prior {self.ck.mtbf_prior_minutes:g} min)")
      fields = {"cost_s": cost, "mtbf_s": mtbf, "failures": failures, "span_s": span}
    elif self.ck.every_minutes > 0 and tier == "durable":
      interval_s, fields = self.ck.every_minutes * 60.0, {}
      why = f"checkpoint.every_minutes={self.ck.every_minutes:g}"
    else:
      return None
    steps = max(1, round(interval_s / step_s))
    return {"interval_s": interval_s, "interval_steps": steps, "step_time_s": step_s, "why": why, **fields}
