"""Goodput and badput of a run, from its event log (`maxtrain.monitor.events`).

goodput = seconds of steps whose progress was kept / wall seconds from the first to the last event of
all attempts. Every second of that span goes to exactly one category, so they sum to the total:

  productive        step time of kept steps (excluding their data wait)
  startup_compile   attempt start (first event) to its first completed step: init, restore, compile
  data_wait         `steps.data_wait_s`: the loop waiting for input
  checkpoint        the loop blocked by a save: `checkpoint_blocked.blocking_s` (written as soon as
                    the loop resumes), else `checkpoint_save_end.blocking_s`
  eval              `eval.seconds`
  lost_progress     step time of steps that were computed again after a restart or rollback (every
                    computation of step n except the last one, and steps past a final rollback), and
                    the rollback's own restore time
  hang              from the last completed step to the watchdog's `hang` event (`idle_s` if given)
  downtime          no attempt alive: wall time outside the union of the attempts' spans. An
                    attempt's span runs from its supervisor `restart` record (written after the
                    backoff) or its first trainer record to its last trainer record, or to the
                    supervisor's `crash` record when the trainer died without an `exit` record
                    (SIGKILL): after an `exit`, process teardown and backoff are downtime. A trainer
                    that recorded its own `crash` is dead from then on: its teardown up to `exit`
                    (closing files, waiting for an in-flight save) is downtime too.
  other             inside an attempt but in none of the above (logging, shutdown, steps of a process
                    killed before it recorded them)

Steps after the last `steps` record: a trainer's `hang`, `crash`, `preemption`, `checkpoint_save_start`
or `exit` record names the last completed step, so the steps since the last record were computed in
the time since it (up to a hang's idle window): they count as step time, kept or lost like any other.
Incidents (`hang`, `crash`, `preemption`) are counted once per attempt, however many processes and
the supervisor recorded them; an attempt that hung is not also a crash.

How overlaps resolve: each record that covers time becomes a segment on the wall clock (a `steps`
record ends at its `wall` and lasts `seconds`). Where segments overlap -- two attempts alive at once,
or N processes reporting the same interval -- each instant is counted once, for the segment that
made kept progress, else the higher of checkpoint > eval > rollback > steps > hang > startup > other,
else the later attempt. Step bookkeeping (which steps were kept) uses one process per attempt: the
lowest JAX process index that wrote records.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Iterable

from maxtrain.monitor import checkpoint_report
from maxtrain.monitor import events as ev

CATEGORIES = ("productive", "startup_compile", "data_wait", "checkpoint", "eval", "lost_progress", "hang",
              "downtime", "other")
# Segment priority where segments overlap (higher wins); kept progress beats all of them.
_PRIORITY = {"other": 0, "startup_compile": 1, "hang": 2, "steps": 3, "rollback": 4, "eval": 5, "checkpoint": 6}
_STEP_KINDS = {ev.FIRST_STEP, ev.STEPS, ev.EVAL, ev.CHECKPOINT_SAVE_START, ev.CHECKPOINT_BLOCKED,
               ev.CHECKPOINT_SAVE_END,
               ev.RESTORE, ev.ROLLBACK}


@dataclasses.dataclass
class _StepsRecord:
  first: int
  last: int
  weights: list[float] | None  # Per-step seconds, when the record had them.
  lost_weight: float = 0.0

  def weight(self, lo: int, hi: int) -> float:
    if self.weights is None:
      return float(hi - lo + 1)
    return float(sum(self.weights[lo - self.first: hi - self.first + 1]))

  @property
  def lost_fraction(self) -> float:
    total = self.weight(self.first, self.last)
    return self.lost_weight / total if total > 0 else 0.0


class _LiveSteps:
  """Which computation of each step number currently stands: ascending, non-overlapping ranges."""

  def __init__(self):
    self.ranges: list[list[Any]] = []  # [lo, hi, record]

  def discard_from(self, step: int) -> None:
    """Steps >= `step` are being recomputed (or were rolled back): their current computation is lost."""
    while self.ranges and self.ranges[-1][1] >= step:
      lo, hi, rec = self.ranges[-1]
      cut = max(lo, step)
      rec.lost_weight += rec.weight(cut, hi)
      if cut == lo:
        self.ranges.pop()
      else:
        self.ranges[-1][1] = cut - 1
        break

  def add(self, rec: _StepsRecord) -> None:
    self.discard_from(rec.first)
    self.ranges.append([rec.first, rec.last, rec])

  def count(self) -> int:
    return sum(hi - lo + 1 for lo, hi, _ in self.ranges)


@dataclasses.dataclass
class _Segment:
  start: float
  end: float
  attempt: int
  kind: str  # A _PRIORITY key.
  parts: dict[str, float]  # Category -> share of this segment's time; sums to 1.

  def key(self) -> tuple:
    return (self.parts.get("productive", 0.0) > 0, _PRIORITY[self.kind], self.attempt)


def _num(record: dict, name: str, default: float = 0.0) -> float:
  value = record.get(name)
  return default if value is None else float(value)


def _percentiles(pairs: list[tuple[float, float]]) -> dict[str, float | None]:
  """Weighted nearest-rank percentiles of (value, weight) pairs."""
  pairs = sorted(p for p in pairs if p[1] > 0)
  out: dict[str, float | None] = {"p50": None, "p90": None, "p99": None, "max": None}
  if not pairs:
    return out
  total = sum(w for _, w in pairs)
  for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
    acc = 0.0
    for value, weight in pairs:
      acc += weight
      if acc >= q * total - 1e-9:
        out[name] = value
        break
  out["max"] = pairs[-1][0]
  return out


def _reporting_processes(records: list[dict]) -> dict[int, int]:
  by_attempt: dict[int, int] = {}
  for r in records:
    if r["process"] >= 0:
      a = r["attempt"]
      by_attempt[a] = min(by_attempt.get(a, r["process"]), r["process"])
  return by_attempt


def _attempt_spans(records: list[dict]) -> dict[int, list[float]]:
  """attempt -> [first, last] wall time of its records; a crashed attempt ends at its trainer's crash."""
  spans: dict[int, list[float]] = {}
  exited = {r["attempt"] for r in records if r["kind"] == ev.EXIT and r["process"] >= 0}
  for r in records:
    if r["process"] < 0 and r["kind"] != ev.RESTART and r["attempt"] in exited:
      continue  # after the trainer's own exit record, the supervisor's notice is teardown, not the attempt
    span = spans.setdefault(r["attempt"], [r["wall"], r["wall"]])
    span[0], span[1] = min(span[0], r["wall"]), max(span[1], r["wall"])
  crashed: dict[int, float] = {}  # attempt -> its trainer's (last) crash record
  for r in records:
    if r["kind"] == ev.CRASH and r["process"] >= 0:
      crashed[r["attempt"]] = max(crashed.get(r["attempt"], r["wall"]), r["wall"])
  for attempt, wall in crashed.items():
    spans[attempt][1] = min(spans[attempt][1], wall)
  return spans


# A trainer record with a step beyond the last `steps` record tells that those steps were computed
# (their time, since the last record of progress, is step time): a hang, crash, stop or exit.
_PROGRESS_WITNESSES = {ev.HANG, ev.CRASH, ev.EXIT, ev.PREEMPTION, ev.CHECKPOINT_SAVE_START}
_INCIDENTS = (ev.HANG, ev.CRASH, ev.PREEMPTION)  # counted once per attempt, whoever recorded them


class _Walk:
  """Walks the records in wall order: step bookkeeping, segments, step-time samples, event counts."""

  def __init__(self, records: list[dict], live: _LiveSteps):
    self.live = live
    self.reporter = _reporting_processes(records)
    self.spans = _attempt_spans(records)
    self.segments = [_Segment(s, e, a, "other", {"other": 1.0}) for a, (s, e) in self.spans.items()]
    self.step_segments: list[tuple[_Segment, _StepsRecord]] = []
    self.samples: list[tuple[float, float]] = []
    self.counts: Counter = Counter()
    self.all_steps: list[_StepsRecord] = []
    self.first_step_wall: dict[int, float] = {}
    self.progress: dict[int, tuple[float, int]] = {}  # attempt -> (wall, step) of its reporter's last progress
    self.save_start: dict[tuple[int, Any], float] = {}
    self.blocked: set[tuple[int, Any]] = set()
    self.seen: set[tuple] = set()
    for r in records:
      self._count(r)
      if r["process"] == self.reporter.get(r["attempt"]) and r["kind"] in _PROGRESS_WITNESSES:
        self._unrecorded_steps(r)
      if r["kind"] in _STEP_KINDS and r["process"] != self.reporter.get(r["attempt"]):
        continue
      self._record(r)
    for attempt, (start, end) in self.spans.items():
      startup_end = self.first_step_wall.get(attempt, end)
      self.segments.append(_Segment(start, startup_end, attempt, "startup_compile", {"startup_compile": 1.0}))
    self._count_incidents(records)

  def _count(self, r: dict) -> None:
    # N processes report the same NaN skip: count it once per attempt and step.
    once = (r["kind"], r["attempt"], r["step"], r["process"] if r["process"] < 0 else None)
    if once not in self.seen:
      self.seen.add(once)
      self.counts[r["kind"]] += int(_num(r, "count", 1)) if r["kind"] == ev.NAN_SKIP else 1

  def _count_incidents(self, records: list[dict]) -> None:
    """A hang is recorded by every process's watchdog and seen by the supervisor as a failed attempt;
    a crash by the trainer and the supervisor: one incident per attempt, a hang's exit not a crash."""
    attempts = {kind: {r["attempt"] for r in records if r["kind"] == kind} for kind in _INCIDENTS}
    attempts[ev.CRASH] -= attempts[ev.HANG]
    for kind in _INCIDENTS:
      self.counts[kind] = len(attempts[kind])

  def _add_steps(self, rec: _StepsRecord, seg: _Segment | None) -> None:
    self.live.add(rec)
    self.all_steps.append(rec)
    if seg is not None:
      self.step_segments.append((seg, rec))
      self.segments.append(seg)

  def _unrecorded_steps(self, r: dict) -> None:
    """Steps computed after the last `steps` record, witnessed by `r`'s step: step time, kept or lost."""
    attempt = r["attempt"]
    if r["step"] is None or attempt not in self.progress or int(r["step"]) <= self.progress[attempt][1]:
      return
    wall, last = self.progress[attempt]
    end = r["wall"] - _num(r, "idle_s") if r["kind"] == ev.HANG else r["wall"]
    end = max(end, wall)
    self._add_steps(_StepsRecord(last + 1, int(r["step"]), None), _Segment(wall, end, attempt, "steps", {}))
    self.progress[attempt] = (end, int(r["step"]))

  def _record(self, r: dict) -> None:
    kind, attempt, wall = r["kind"], r["attempt"], r["wall"]
    if kind == ev.FIRST_STEP:
      # Its time is start-up (it may include lazy compilation), but its progress counts like any step.
      self.first_step_wall.setdefault(attempt, wall)
      self._add_steps(_StepsRecord(int(r["step"]), int(r["step"]), None), None)
      self.progress[attempt] = (wall, int(r["step"]))
    elif kind == ev.STEPS:
      self._steps(r)
    elif kind in (ev.RESTORE, ev.ROLLBACK):
      to_step = int(r.get("to_step", r["step"]))
      self.live.discard_from(to_step + 1)
      if attempt in self.progress:
        self.progress[attempt] = (wall, to_step)
      if kind == ev.ROLLBACK:
        self.segments.append(_Segment(wall - _num(r, "seconds"), wall, attempt, "rollback", {"lost_progress": 1.0}))
    elif kind == ev.EVAL:
      self.segments.append(_Segment(wall - _num(r, "seconds"), wall, attempt, "eval", {"eval": 1.0}))
    elif kind == ev.CHECKPOINT_SAVE_START:
      self.save_start[(attempt, r["step"])] = wall
    elif kind == ev.CHECKPOINT_BLOCKED:
      self.blocked.add((attempt, r["step"]))
      start = self.save_start.pop((attempt, r["step"]), wall - _num(r, "blocking_s"))
      self.segments.append(_Segment(start, wall, attempt, "checkpoint", {"checkpoint": 1.0}))
    elif kind == ev.CHECKPOINT_SAVE_END and (attempt, r["step"]) not in self.blocked:
      blocking = _num(r, "blocking_s")
      start = self.save_start.pop((attempt, r["step"]), wall - blocking)
      self.segments.append(_Segment(start, start + blocking, attempt, "checkpoint", {"checkpoint": 1.0}))
    elif kind == ev.HANG:
      progress = self.progress.get(attempt, (self.spans[attempt][0], None))[0]
      start = wall - r["idle_s"] if r.get("idle_s") is not None else progress
      self.segments.append(_Segment(start, wall, attempt, "hang", {"hang": 1.0}))

  def _steps(self, r: dict) -> None:
    attempt, wall = r["attempt"], r["wall"]
    seconds, last = _num(r, "seconds"), int(r["step"])
    count = int(r.get("count") or last - int(r.get("first", last)) + 1)
    first = int(r.get("first", last - count + 1))
    times = r.get("step_times")
    rec = _StepsRecord(first, last, [float(t) for t in times] if times and len(times) == count else None)
    seg = _Segment(wall - seconds, wall, attempt, "steps", {})
    if seconds > 0:
      seg.parts["data_wait"] = min(max(_num(r, "data_wait_s"), 0.0), seconds) / seconds
    self._add_steps(rec, seg)
    self.first_step_wall.setdefault(attempt, wall - seconds)
    self.progress[attempt] = (wall, last)
    self.samples += [(t, 1.0) for t in rec.weights] if rec.weights else [(seconds / max(count, 1), float(count))]


def _sweep(segments: list[_Segment], t0: float, t1: float,
           intervals: list[tuple[float, float, dict[str, float]]] | None = None) -> dict[str, float]:
  """Assigns every instant of [t0, t1] to one category: the winning segment's, else downtime.
  `intervals` (if given) receives every elementary interval as (start, end, {category: share})."""
  totals = dict.fromkeys(CATEGORIES, 0.0)
  points = []
  for i, seg in enumerate(segments):
    start, end = max(seg.start, t0), min(seg.end, t1)
    if end > start:
      points += [(start, 1, i), (end, 0, i)]  # Ends sort before starts at the same instant.
  points.sort()
  active: set[int] = set()
  prev = t0
  for t, is_start, i in points:
    if t > prev:
      parts = segments[max(active, key=lambda j: segments[j].key())].parts if active else {"downtime": 1.0}
      for category, share in parts.items():
        totals[category] += (t - prev) * share
      if intervals is not None:
        intervals.append((prev, t, parts))
      prev = t
    (active.add if is_start else active.discard)(i)
  totals["downtime"] += max(t1 - prev, 0.0)
  if intervals is not None and t1 > prev:
    intervals.append((prev, t1, {"downtime": 1.0}))
  return totals


def _sorted_records(records: Iterable[dict]) -> list[dict]:
  defaults = {"attempt": 0, "process": 0, "step": None, "kind": ""}
  records = sorted(({**defaults, **r} for r in records if isinstance(r.get("wall"), (int, float))),
                   key=lambda r: r["wall"])
  if not records:
    raise ValueError("no events: nothing to report")
  return records


def _analyse(records: list[dict], t0: float, t1: float, intervals: list | None = None):
  """(walk, live steps, seconds per category) of time-sorted records over [t0, t1]."""
  live = _LiveSteps()
  walk = _Walk(records, live)
  # Kept vs lost is known only now: split each steps segment's non-waiting time accordingly.
  for seg, rec in walk.step_segments:
    working = 1.0 - seg.parts.get("data_wait", 0.0) if seg.end > seg.start else 0.0
    seg.parts["productive"] = working * (1.0 - rec.lost_fraction)
    seg.parts["lost_progress"] = working * rec.lost_fraction
  return walk, live, _sweep(walk.segments, t0, t1, intervals)


def timeline(records: Iterable[dict]) -> dict:
  """The report's intervals on the wall clock, for a picture: {"t0", "t1", "report", "rows": [(label,
  [(start, end, {category: share}), ...])]}; the first row is the whole job (the report's numbers),
  then one row per process when there are several (its own records and the supervisor's)."""
  records = _sorted_records(records)
  t0, t1 = records[0]["wall"], records[-1]["wall"]
  rows = []
  processes = sorted({r["process"] for r in records if r["process"] >= 0})
  groups = [("job", records)]
  if len(processes) > 1:
    groups += [(f"process {p}", [r for r in records if r["process"] in (p, ev.SUPERVISOR)]) for p in processes]
  for label, group in groups:
    intervals: list = []
    _analyse(group, t0, t1, intervals)
    rows.append((label, intervals))
  restarts = [r["wall"] for r in records if r["kind"] == ev.RESTART]
  return {"t0": t0, "t1": t1, "rows": rows, "restarts": restarts, "report": compute(records)}


def _stragglers(records: list[dict]) -> list[dict]:
  found: dict[int, dict] = {}
  for r in records:
    if r["kind"] == ev.STRAGGLER and "slow_process" in r:
      entry = found.setdefault(r["slow_process"], {"process": r["slow_process"], "host": r.get("host"), "events": 0,
                                                    "max_ratio": 0.0, "max_late_s": 0.0})
      entry["events"] += 1
      entry["max_ratio"] = max(entry["max_ratio"], _num(r, "ratio"))
      entry["max_late_s"] = max(entry["max_late_s"], _num(r, "late_s"))
  return [found[p] for p in sorted(found)]


def compute(records: Iterable[dict]) -> dict:
  """The goodput report of an event log's records (see the module doc); JSON-serialisable."""
  records = _sorted_records(records)
  t0, t1 = records[0]["wall"], records[-1]["wall"]
  walk, live, seconds = _analyse(records, t0, t1)
  all_steps, samples, counts = walk.all_steps, walk.samples, walk.counts
  total = t1 - t0
  computed = sum(rec.last - rec.first + 1 for rec in all_steps)
  kept = live.count()
  attempts = sorted({r["attempt"] for r in records})
  return {
      "total_s": total,
      "goodput": seconds["productive"] / total if total > 0 else 0.0,
      "seconds": seconds,
      "fractions": {k: (v / total if total > 0 else 0.0) for k, v in seconds.items()},
      "steps": {"kept": kept, "computed": computed, "lost": computed - kept,
                "last": live.ranges[-1][1] if live.ranges else None},
      "step_time_s": _percentiles(samples),
      "attempts": len(attempts),
      "processes": len({r["process"] for r in records if r["process"] >= 0}),
      "events": {k: counts[k] for k in (ev.NAN_SKIP, ev.SPIKE, ev.ROLLBACK, ev.HANG, ev.PREEMPTION, ev.CRASH,
                                          ev.STRAGGLER, ev.RESTART, ev.CHECKPOINT_SAVE_END) if counts[k]},
      "stragglers": _stragglers(records),
      "checkpoints": checkpoint_report.section(records),
  }


def format_table(report: dict, title: str = "") -> str:
  """The report as a fixed-width text table."""
  total = report["total_s"]
  lines = [f"goodput report{': ' + title if title else ''}",
           f"  {report['attempts']} attempt(s), {report['processes']} process(es), wall {total:,.1f} s", ""]
  lines.append(f"  {'category':<18}{'seconds':>12}{'share':>9}")
  for name in CATEGORIES:
    lines.append(f"  {name:<18}{report['seconds'][name]:>12,.1f}{report['fractions'][name]:>9.1%}")
  lines.append(f"  {'total':<18}{sum(report['seconds'].values()):>12,.1f}{1.0 if total else 0.0:>9.1%}")
  lines.append("")
  lines.append(f"  goodput {report['goodput']:.1%}")
  s = report["steps"]
  lines.append(f"  steps: {s['kept']} kept (last {s['last']}), {s['computed']} computed, {s['lost']} recomputed/lost")
  p = report["step_time_s"]
  if p["max"] is not None:
    lines.append("  step time (s): " + "  ".join(f"{k} {p[k]:.4f}" for k in ("p50", "p90", "p99", "max")))
  if report["events"]:
    lines.append("  events: " + ", ".join(f"{k} {v}" for k, v in report["events"].items()))
  for s in report.get("stragglers", []):
    lines.append(f"  straggler: process {s['process']} ({s['host']}) flagged {s['events']} time(s), up to "
                 f"{s['max_late_s']:.3f}s late per step ({s['max_ratio']:.2f}x the step time without it)")
  lines += checkpoint_report.format_lines(report.get("checkpoints", {}))
  return "\n".join(lines)
