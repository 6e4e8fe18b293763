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
  other             inside an attempt but in none of the above (logging, shutdown, unrecorded steps)

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


def _segments(records: list[dict], live: _LiveSteps) -> tuple[list[_Segment], list[tuple[_Segment, _StepsRecord]],
                                                              list[_StepsRecord], list[tuple[float, float]], Counter]:
  """Walks the records in wall order: step bookkeeping, segments, step-time samples, event counts."""
  reporter = _reporting_processes(records)
  spans = _attempt_spans(records)
  segments = [_Segment(s, e, a, "other", {"other": 1.0}) for a, (s, e) in spans.items()]
  step_segments: list[tuple[_Segment, _StepsRecord]] = []
  samples: list[tuple[float, float]] = []
  counts: Counter = Counter()
  first_step_wall: dict[int, float] = {}
  last_progress_wall: dict[int, float] = {}
  save_start: dict[tuple[int, Any], float] = {}
  blocked: set[tuple[int, Any]] = set()
  seen: set[tuple] = set()
  all_steps: list[_StepsRecord] = []

  for r in records:
    kind, attempt, wall = r["kind"], r["attempt"], r["wall"]
    # N processes report the same NaN skip or hang: count it once per attempt and step.
    once = (kind, attempt, r["step"], r["process"] if r["process"] < 0 else None)
    if once not in seen:
      seen.add(once)
      counts[kind] += int(_num(r, "count", 1)) if kind == ev.NAN_SKIP else 1
    if kind in _STEP_KINDS and r["process"] != reporter.get(attempt):
      continue
    if kind == ev.FIRST_STEP:
      # Its time is start-up (it may include lazy compilation), but its progress counts like any step.
      first_step_wall.setdefault(attempt, wall)
      rec = _StepsRecord(int(r["step"]), int(r["step"]), None)
      live.add(rec)
      all_steps.append(rec)
    elif kind == ev.STEPS:
      seconds, last = _num(r, "seconds"), int(r["step"])
      count = int(r.get("count") or last - int(r.get("first", last)) + 1)
      first = int(r.get("first", last - count + 1))
      times = r.get("step_times")
      rec = _StepsRecord(first, last, [float(t) for t in times] if times and len(times) == count else None)
      live.add(rec)
      all_steps.append(rec)
      wait = min(max(_num(r, "data_wait_s"), 0.0), seconds)
      seg = _Segment(wall - seconds, wall, attempt, "steps", {})
      if seconds > 0:
        seg.parts["data_wait"] = wait / seconds
      step_segments.append((seg, rec))
      segments.append(seg)
      first_step_wall.setdefault(attempt, wall - seconds)
      samples += [(t, 1.0) for t in rec.weights] if rec.weights else [(seconds / max(count, 1), float(count))]
    elif kind == ev.RESTORE:
      live.discard_from(int(r["step"]) + 1)
    elif kind == ev.ROLLBACK:
      to_step = int(r.get("to_step", r["step"]))
      live.discard_from(to_step + 1)
      seconds = _num(r, "seconds")
      segments.append(_Segment(wall - seconds, wall, attempt, "rollback", {"lost_progress": 1.0}))
    elif kind == ev.EVAL:
      segments.append(_Segment(wall - _num(r, "seconds"), wall, attempt, "eval", {"eval": 1.0}))
    elif kind == ev.CHECKPOINT_SAVE_START:
      save_start[(attempt, r["step"])] = wall
    elif kind == ev.CHECKPOINT_BLOCKED:
      blocked.add((attempt, r["step"]))
      start = save_start.pop((attempt, r["step"]), wall - _num(r, "blocking_s"))
      segments.append(_Segment(start, wall, attempt, "checkpoint", {"checkpoint": 1.0}))
    elif kind == ev.CHECKPOINT_SAVE_END and (attempt, r["step"]) not in blocked:
      blocking = _num(r, "blocking_s")
      start = save_start.pop((attempt, r["step"]), wall - blocking)
      segments.append(_Segment(start, start + blocking, attempt, "checkpoint", {"checkpoint": 1.0}))
    elif kind == ev.HANG:
      start = wall - r["idle_s"] if r.get("idle_s") is not None else last_progress_wall.get(attempt, spans[attempt][0])
      segments.append(_Segment(start, wall, attempt, "hang", {"hang": 1.0}))
    if kind in (ev.FIRST_STEP, ev.STEPS) and r["process"] >= 0:
      last_progress_wall[attempt] = wall

  for attempt, (start, end) in spans.items():
    startup_end = first_step_wall.get(attempt, end)
    segments.append(_Segment(start, startup_end, attempt, "startup_compile", {"startup_compile": 1.0}))
  return segments, step_segments, all_steps, samples, counts


def _sweep(segments: list[_Segment], t0: float, t1: float) -> dict[str, float]:
  """Assigns every instant of [t0, t1] to one category: the winning segment's, else downtime."""
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
      if active:
        winner = segments[max(active, key=lambda j: segments[j].key())]
        for category, share in winner.parts.items():
          totals[category] += (t - prev) * share
      else:
        totals["downtime"] += t - prev
      prev = t
    (active.add if is_start else active.discard)(i)
  totals["downtime"] += max(t1 - prev, 0.0)
  return totals


def compute(records: Iterable[dict]) -> dict:
  """The goodput report of an event log's records (see the module doc); JSON-serialisable."""
  defaults = {"attempt": 0, "process": 0, "step": None, "kind": ""}
  records = sorted(({**defaults, **r} for r in records if isinstance(r.get("wall"), (int, float))),
                   key=lambda r: r["wall"])
  if not records:
    raise ValueError("no events: nothing to report")
  t0, t1 = records[0]["wall"], records[-1]["wall"]
  live = _LiveSteps()
  segments, step_segments, all_steps, samples, counts = _segments(records, live)
  # Kept vs lost is known only now: split each steps segment's non-waiting time accordingly.
  for seg, rec in step_segments:
    working = 1.0 - seg.parts.get("data_wait", 0.0) if seg.end > seg.start else 0.0
    seg.parts["productive"] = working * (1.0 - rec.lost_fraction)
    seg.parts["lost_progress"] = working * rec.lost_fraction
  seconds = _sweep(segments, t0, t1)
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
                                          ev.RESTART, ev.CHECKPOINT_SAVE_END) if counts[k]},
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
  return "\n".join(lines)
