"""The goodput report's checkpoint section, from the event log: each tier's save profile (phase by phase,
bytes, upload rate), its restores, whether the durable tier fell behind, the cadence in force, and per
failure the work lost (steps recomputed after the restart) beside the work the cadence expected to lose.

Lost work per failure: the attempt's last recorded step minus the step the next attempt restored (fresh
start: 0). Expected: half the interval between saves of the most frequent tier in force at the failure
(Young/Daly's tau / 2), in steps and in seconds of the cadence's measured step time.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from maxtrain.monitor import events as ev

_PHASES = ("device_to_host_s", "serialise_s", "write_s", "manifest_s", "save_s")


def _mean(values: list[float]) -> float | None:
  values = [v for v in values if v is not None]
  return statistics.fmean(values) if values else None


def _tiers(records: list[dict]) -> dict[str, dict]:
  saves, restores = defaultdict(list), defaultdict(list)
  for r in records:
    if r["kind"] == ev.CHECKPOINT_SAVE_END:
      saves[r.get("tier", "durable")].append(r)
    elif r["kind"] == ev.RESTORE:
      restores[r.get("tier", "durable")].append(r)
  out = {}
  for tier in sorted(set(saves) | set(restores)):
    entry: dict[str, Any] = {"saves": len(saves[tier]), "restores": len(restores[tier])}
    for phase in _PHASES:
      entry[phase] = _mean([r.get(phase) for r in saves[tier]])
    entry["bytes"] = _mean([r.get("bytes") for r in saves[tier]])
    entry["restore_s"] = _mean([r.get("seconds") for r in restores[tier]])
    entry["verify_s"] = _mean([r.get("verify_s") for r in restores[tier]])
    out[tier] = entry
  uploads = [r for r in records if r["kind"] == ev.CHECKPOINT_UPLOAD]
  if uploads:
    out.setdefault("durable", {})["upload_bytes_per_s"] = _mean([r.get("bytes_per_s") for r in uploads])
    out["durable"]["uploads"] = len(uploads)
  return out


def _failures(records: list[dict]) -> list[dict]:
  """Per failed attempt (a crash or a hang): the last step it recorded, the step the next attempt restored."""
  lowest = {}
  for r in records:
    if r["process"] >= 0:
      lowest[r["attempt"]] = min(lowest.get(r["attempt"], r["process"]), r["process"])
  failed = sorted({r["attempt"] for r in records if r["kind"] in (ev.CRASH, ev.HANG)})
  cadence = [r for r in records if r["kind"] == ev.CHECKPOINT_CADENCE]
  out = []
  for attempt in failed:
    mine = [r for r in records if r["attempt"] == attempt and r["process"] == lowest.get(attempt)]
    last = max((r["step"] for r in mine if r["kind"] in (ev.STEPS, ev.FIRST_STEP) and r["step"] is not None),
               default=None)
    later = [r for r in records if r["attempt"] > attempt and r["process"] >= 0]
    if last is None or not later:
      continue
    next_attempt = min(r["attempt"] for r in later)
    restored = [r["step"] for r in later if r["attempt"] == next_attempt and r["kind"] == ev.RESTORE]
    restored_step = restored[0] if restored else 0
    entry = {"attempt": attempt, "last_step": last, "restored_step": restored_step,
             "restored_tier": next((r.get("tier") for r in later if r["attempt"] == next_attempt
                                    and r["kind"] == ev.RESTORE), None),
             "recomputed_steps": last - restored_step}
    end = max(r["wall"] for r in mine)
    in_force = {}
    for r in cadence:
      if r["wall"] <= end:
        in_force[r["tier"]] = r
    if in_force:
      best = min(in_force.values(), key=lambda r: r["interval_steps"])
      entry.update(expected_steps=best["interval_steps"] / 2, expected_s=best["interval_steps"] * best["step_time_s"] / 2,
                   actual_s=entry["recomputed_steps"] * best["step_time_s"], cadence_tier=best["tier"])
    out.append(entry)
  return out


def section(records: list[dict]) -> dict:
  """The report's `checkpoints` entry (empty when the run saved and restored nothing)."""
  tiers = _tiers(records)
  behind = [r for r in records if r["kind"] == ev.CHECKPOINT_BEHIND]
  decisions = [r for r in records if r["kind"] == ev.CHECKPOINT_CADENCE]
  if not tiers and not behind and not decisions:
    return {}
  last = {}
  for r in decisions:
    last[r["tier"]] = {k: r.get(k) for k in ("mode", "interval_s", "interval_steps", "step_time_s", "cost_s", "mtbf_s",
                                             "failures")}
  return {"tiers": tiers, "behind_events": len(behind), "max_behind": max((r["pending"] for r in behind), default=0),
          "cadence": last, "failures": _failures(records)}


def format_lines(report: dict) -> list[str]:
  """The section as text lines for goodput.format_table."""
  if not report:
    return []
  lines = ["", "  checkpoints (mean per save; seconds unless marked)"]
  for tier, t in report["tiers"].items():
    phases = "  ".join(f"{p.removesuffix('_s')} {t[p]:.4f}" for p in _PHASES if t.get(p) is not None)
    size = f"  {t['bytes'] / 1e6:.1f} MB" if t.get("bytes") else ""
    upload = f"  upload {t['upload_bytes_per_s'] / 1e6:.1f} MB/s" if t.get("upload_bytes_per_s") else ""
    restore = (f"; {t['restores']} restore(s), {t['restore_s']:.3f}s (verify {t['verify_s']:.3f}s)"
               if t.get("restores") and t.get("restore_s") is not None and t.get("verify_s") is not None else "")
    lines.append(f"  {tier:<8} {t.get('saves', 0)} saves: {phases}{size}{upload}{restore}")
  if report["behind_events"]:
    lines.append(f"  durable tier fell behind {report['behind_events']} time(s), up to {report['max_behind']} saves")
  for tier, c in report["cadence"].items():
    inputs = f" from C={c['cost_s']:.4f}s, M={c['mtbf_s']:.0f}s" if c.get("cost_s") is not None else ""
    lines.append(f"  cadence {c['mode']} ({tier}): every {c['interval_steps']} steps ({c['interval_s']:.2f}s){inputs}")
  for f in report["failures"]:
    expected = (f", expected {f['expected_steps']:.1f} steps ({f['expected_s']:.2f}s), actual {f['actual_s']:.2f}s"
                if "expected_steps" in f else "")
    lines.append(f"  failure in attempt {f['attempt']}: step {f['last_step']} -> restored {f['restored_step']} "
                 f"({f['restored_tier'] or 'fresh start'}): {f['recomputed_steps']} steps lost{expected}")
  return lines
