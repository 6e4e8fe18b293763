"""Straggler detection: which process makes every step of the job slower, and by how much.

In an SPMD job a step runs when the last process has submitted it: the collectives inside make the
others wait, so every process's wall time per step is the same and says nothing about who is slow.
What differs is *when* each process submits (dispatches) each step. A process whose host work is
slow (input, a stalled disk, a busy CPU, an injected `faults.slow_step_s`) dispatches late; the
others dispatch early and then wait inside the runtime. So each process records the wall-clock time
at which it dispatches every step, and per step

    late_p(s) = dispatch_p(s) - dispatch of the median process (the lower median for an even count)

Every `log_every` steps (never per step) each process publishes its dispatch times for the interval
in the coordination service's key-value store (runtime/kv.py); process 0 collects them and, per
process, takes the median lateness over the interval's steps (one hiccup does not flag a host), and
the median over processes of their mean step time in the interval (the period). A process is a straggler when its lateness exceeds
`fleet.straggler_threshold` x the period and `fleet.straggler_min_s`: a `straggler` event names it
(`slow_process`, `host`, `late_s`, `step_s`, `ratio`), where ratio = step / (step - late) is how much
longer every step takes than it would without that process's delay. TensorBoard gets that ratio of
the slowest process as `fleet/step_time_max_over_median` (1.0 = nobody late) and its index as
`fleet/slowest_process`.

Clocks: dispatch times are `time.time()` of each host; NTP keeps hosts within milliseconds, well
under a step. A slow *device* (its host dispatches on time) is not seen here.
"""

from __future__ import annotations

import json
import logging
import socket
import statistics
import time

from maxtrain.config.sections import Fleet
from maxtrain.monitor import events as ev
from maxtrain.runtime.kv import KeyValue

log = logging.getLogger("maxtrain")


def lateness(dispatch: dict[int, dict[int, float]]) -> dict[int, float]:
  """{process: median lateness} from {process: {step: dispatch time}}; only the steps every process
  recorded count."""
  steps = sorted(set.intersection(*(set(times) for times in dispatch.values())))
  late: dict[int, list[float]] = {p: [] for p in dispatch}
  for s in steps:
    reference = statistics.median_low(times[s] for times in dispatch.values())
    for p, times in dispatch.items():
      late[p].append(times[s] - reference)
  return {p: statistics.median(v) if v else 0.0 for p, v in late.items()}


def find_stragglers(stats: dict[int, dict], threshold: float, min_s: float) -> tuple[list[dict], dict[str, float]]:
  """(stragglers, fleet scalars) from every process's {"host", "dispatch": {step: time}, "step_s"} (its
  mean step time over the interval); see the module doc."""
  late = lateness({p: s["dispatch"] for p, s in stats.items()})
  period = statistics.median(s["step_s"] for s in stats.values())
  slowest = max(late, key=late.get)

  def ratio(p: int) -> float:
    if late[p] <= 0:
      return 1.0
    return period / (period - late[p]) if period > late[p] else float("inf")

  scalars = {"fleet/step_time_max_over_median": ratio(slowest), "fleet/slowest_process": float(slowest)}
  found = [{"slow_process": p, "host": stats[p]["host"], "late_s": late[p], "step_s": period, "ratio": ratio(p)}
           for p in sorted(late) if late[p] > threshold * period and late[p] >= min_s]
  return found, scalars


class StragglerMonitor:
  """This process's dispatch times; at log steps the exchange and (process 0) the verdict."""

  def __init__(self, kv: KeyValue | None, events: ev.EventLog, cfg: Fleet):
    self.kv, self.events, self.cfg = kv, events, cfg  # config.fleet, typed (config/sections.py)
    self.host = socket.gethostname()
    self._dispatch: dict[int, float] = {}  # step -> wall time its dispatch began, since the last exchange

  @property
  def active(self) -> bool:
    return self.kv is not None and self.cfg.straggler_threshold > 0

  def dispatching(self, step: int) -> None:
    """The loop is about to dispatch the step that completes as `step`."""
    if self.active:
      self._dispatch[step] = time.time()

  def reset(self) -> None:
    """Drops the open interval (after a rollback the step numbers repeat)."""
    self._dispatch = {}

  def exchange(self, step: int) -> dict[str, float]:
    """At a log step, on every process: publishes this interval's dispatch times; process 0 returns
    the fleet scalars (and emits `straggler` events), the others {}."""
    if not self.active:
      return {}
    if not self._dispatch:
      return {}  # the attempt's first interval may hold only its compile step, which is not timed
    # This process's mean step time: from the interval's first dispatch to now (its last step done).
    step_s = (time.time() - min(self._dispatch.values())) / len(self._dispatch)
    mine = {"host": self.host, "step_s": step_s, "dispatch": {str(s): t for s, t in self._dispatch.items()}}
    self._dispatch = {}
    self.kv.set(f"fleet/{step}/{self.kv.process_index}", json.dumps(mine))
    if self.kv.process_index != 0:
      return {}
    stats = self._collect(step)
    if stats is None:
      return {}
    for s in stats.values():
      s["dispatch"] = {int(k): t for k, t in s["dispatch"].items()}
    found, scalars = find_stragglers(stats, self.cfg.straggler_threshold, self.cfg.straggler_min_s)
    for s in found:
      self.events.emit(ev.STRAGGLER, step, **s)
      log.warning("straggler: process %d (%s) dispatches its steps %.3fs after the median process: every %.3fs "
                  "step waits for it (%.2fx)", s["slow_process"], s["host"], s["late_s"], s["step_s"], s["ratio"])
    return scalars

  def _collect(self, step: int) -> dict[int, dict] | None:
    collected = {}
    for p in range(self.kv.process_count):
      text = self.kv.get(f"fleet/{step}/{p}", self.cfg.exchange_timeout_s)
      if text is None:
        log.warning("straggler check at step %d skipped: process %d sent no dispatch times within "
                    "fleet.exchange_timeout_s=%gs", step, p, self.cfg.exchange_timeout_s)
        return None
      collected[p] = json.loads(text)
    self.kv.delete(f"fleet/{step}")
    return collected
