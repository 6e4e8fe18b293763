"""The checkpoint decisions, as functions from measurements and state to decisions: when each tier saves
(cadence), which tiers a stop request saves (the preemption plan), which tier and step a run resumes from (the
tier choice), and what a `checkpoint.resume` request allows (a fresh start over old steps, an explicit step,
branching, all candidates corrupt).

Nothing here reads a file, a clock, the key-value store or a device (tests/test_architecture.py checks its
imports): the callers (cadence.py, resume.py, schedule.py) measure, then ask here, then act, so every rule is
unit-tested with plain values. A refusal is a UserError whose message names the key and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Collection, Mapping, Sequence

from maxtrain.errors import UserError

LOCAL, DURABLE = "local", "durable"


# ---- cadence ----------------------------------------------------------------------------------

def young_daly_s(cost_s: float, mtbf_s: float) -> float:
  """The save interval near the optimum of lost work: tau = sqrt(2 C M) (Young/Daly)."""
  return math.sqrt(2.0 * cost_s * mtbf_s)


def observed_mtbf(records: Sequence[Mapping], prior_s: float, now_wall: float,
                  failure_kinds: Collection[str]) -> tuple[float, int, float]:
  """(M seconds, failures, observed span seconds) from a run's event records: the span from its first record to
  `now_wall`, plus the prior, over failures + 1. A failure is an attempt with a record of a `failure_kinds` kind
  (counted once per attempt, however many processes and the supervisor reported it)."""
  if not records:
    return prior_s, 0, 0.0
  span = max(0.0, now_wall - min(r["wall"] for r in records))
  failed = {r.get("attempt") for r in records if r.get("kind") in failure_kinds}
  return (span + prior_s) / (len(failed) + 1), len(failed), span


def median_step_s(step_times: Sequence[float]) -> float:
  """The step time: the median, so a save or an eval in the window does not skew it; NaN before any."""
  if not step_times:
    return float("nan")
  ordered = sorted(step_times)
  return ordered[len(ordered) // 2]


def cadence_interval(mode: str, tier: str, costs: Sequence[float], mtbf: tuple[float, int, float], step_s: float,
                     every_minutes: float, prior_minutes: float) -> dict | None:
  """The next interval of `tier` (seconds, steps, and why), or None when it is not time-based (or no step was
  timed yet). `auto` with measured `costs`: Young/Daly from the mean cost and `mtbf` (observed_mtbf's triple);
  else `every_minutes` (durable tier only)."""
  if not math.isfinite(step_s):
    return None
  if mode == "auto" and costs:
    cost = sum(costs) / len(costs)
    mtbf_s, failures, span = mtbf
    interval_s = young_daly_s(cost, mtbf_s)
    why = (f"sqrt(2 C M), C={cost:.4f}s (mean blocking of {len(costs)} saves), M={mtbf_s:.1f}s "
           f"({failures} failures in {span:.0f}s + prior {prior_minutes:g} min)")
    fields = {"cost_s": cost, "mtbf_s": mtbf_s, "failures": failures, "span_s": span}
  elif every_minutes > 0 and tier == DURABLE:
    interval_s, fields = every_minutes * 60.0, {}
    why = f"checkpoint.every_minutes={every_minutes:g}"
  else:
    return None
  steps = max(1, round(interval_s / step_s))
  return {"interval_s": interval_s, "interval_steps": steps, "step_time_s": step_s, "why": why, **fields}


def is_due(step: int, every_steps: int, next_step: int | None, measured_auto: bool) -> bool:
  """Whether a tier saves at `step`: at the decided `next_step`; also every `every_steps` unless `measured_auto`
  (cadence=auto once a save of the tier was measured: the measured interval replaces the configured one)."""
  if measured_auto:
    return next_step == step
  return (every_steps > 0 and step % every_steps == 0) or next_step == step


# ---- which tiers a stop request saves -------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PreemptionPlan:
  tiers: list[str]  # saved, in this order
  skipped: list[str]
  why: str


def preemption_plan(remaining_s: float | None, costs: dict[str, float | None]) -> PreemptionPlan:
  """Which tiers a stop request saves to, from what is left of the grace period (None: unknown) and each
  tier's measured save time (None: not measured yet). Fastest first, each while its cost fits in what
  is left after the ones before it: a save the kill would cut short is time lost (both tiers rename a step
  into place only once it is complete, so it would never be restored). When none fits, the fastest is
  still tried: nothing else can keep the step. A tier not measured yet is tried when time is left and no
  faster tier was skipped (it is counted as the fastest when local, the slowest when durable)."""
  unmeasured = {LOCAL: 0.0, DURABLE: float("inf")}  # the local tier (a node-local write) is the faster one
  order = sorted(costs, key=lambda t: (unmeasured[t] if costs[t] is None else costs[t], t != LOCAL))
  if remaining_s is None:
    return PreemptionPlan(order, [], "the grace period is unknown (checkpoint.preemption_grace_s=0): every tier, "
                          "fastest first")
  left, chosen, skipped, notes = remaining_s, [], [], []
  for tier in order:
    cost = costs[tier]
    if cost is None:
      fits = left > 0 and not skipped  # a tier assumed slower than one that did not fit does not fit either
      notes.append(f"{tier} not measured yet, {'tried' if fits else 'skipped'} with {left:.2f}s left")
    else:
      fits = cost <= left
      verdict = "saved" if fits else "skipped, it would not complete"
      notes.append(f"{tier} takes {cost:.2f}s, {left:.2f}s left: {verdict}")
    if fits:
      chosen.append(tier)
      left -= cost or 0.0
    else:
      skipped.append(tier)
  if not chosen:
    chosen, skipped = [order[0]], order[1:]
    notes.append(f"none fits: {order[0]}, the fastest, is tried anyway")
  return PreemptionPlan(chosen, skipped, f"{remaining_s:.2f}s of the grace period left; " + "; ".join(notes))


def mean_save_s(save_s: Sequence[float], upload_s: Sequence[float] | None = None) -> float | None:
  """A tier's save cost for the preemption plan: the mean seconds from the start of a save to its being complete,
  plus the mean upload when the tier mirrors to object storage (`upload_s` given); None before one was measured."""
  if not save_s or (upload_s is not None and not upload_s):
    return None
  cost = sum(save_s) / len(save_s)
  return cost + sum(upload_s) / len(upload_s) if upload_s is not None else cost


# ---- which tier and step a run resumes from ----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Choice:
  tier: str | None  # LOCAL, DURABLE, or None: a fresh start
  step: int | None
  reason: str


def common_steps(per_process: Sequence[Sequence[int]]) -> list[int]:
  """The local steps every process can restore, ascending."""
  if not per_process:
    return []
  common = set(per_process[0])
  for steps in per_process[1:]:
    common &= set(steps)
  return sorted(common)


def _below(steps: Sequence[int], before: int | None) -> list[int]:
  return [s for s in steps if before is None or s < before]


def choose(per_process: Sequence[Sequence[int]], durable_step: int | None, before: int | None = None,
           verified: bool = True) -> Choice:
  """The step to restore (below `before` if given): the newest of the local steps every process holds
  and the durable tier's newest good step; the durable one on a tie. `verified`: the local steps were checked
  against their manifests (checkpoint.verify), which the reason says only then."""
  local = _below(common_steps(per_process), before)
  durable = durable_step if durable_step is not None and (before is None or durable_step < before) else None
  newest_local = local[-1] if local else None
  missing = [i for i, steps in enumerate(per_process) if not _below(steps, before)]
  if newest_local is not None and (durable is None or newest_local > durable):
    checked = "complete and verified" if verified else "complete (not verified: checkpoint.verify=False)"
    return Choice(LOCAL, newest_local, f"local step {newest_local} is {checked} on all "
                  f"{len(per_process)} processes and newer than the durable tier's "
                  f"{'step ' + str(durable) if durable is not None else 'none'}")
  if newest_local is None:
    if len(missing) == len(per_process):
      why = "the local tier holds no usable step"
    elif missing:
      why = f"no local step is complete on every process (process {', '.join(map(str, missing))} has none usable)"
    else:
      why = "the processes hold no local step in common"
  else:
    why = f"the newest local step every process holds is {newest_local}, not newer"
  if durable is None:
    return Choice(None, None, f"{why}; the durable tier has no verified step: a fresh start")
  return Choice(DURABLE, durable, f"durable step {durable}: {why}")


@dataclasses.dataclass(frozen=True)
class LocalDecision:
  choice: Choice
  move_aside: list[int]  # this process's corrupt local steps below `before`, newest first: moved aside (an event each)
  refuse: bool  # local steps exist but none is intact anywhere, the durable tier has none: exit 2, nothing moved
  start_over: bool  # none intact anywhere and no step chosen: the moves are checkpoint.start_over_if_corrupt's


def local_decision(lists: Sequence[Mapping[str, Sequence[int]]], mine_corrupt: Collection[int],
                   durable_step: int | None, before: int | None, verified: bool,
                   start_over_if_corrupt: bool) -> LocalDecision:
  """The agreed resume decision with a local tier, from every process's scan (`lists`: {"usable", "corrupt",
  "intact"} step lists in process order) and this process's corrupt steps. As in the durable tier: corrupt local
  steps are moved aside once a good step is chosen; when some exist but none is intact on any process and the
  durable tier has no step either, the run is refused with nothing moved, unless checkpoint.start_over_if_corrupt."""
  choice = choose([p["usable"] for p in lists], durable_step, before, verified=verified)
  anywhere = [s for p in lists for s in _below(p["corrupt"], before)]
  intact = [s for p in lists for s in _below(p["intact"], before)]
  nothing_good = choice.tier is None and not intact
  refuse = nothing_good and bool(anywhere) and not start_over_if_corrupt
  move = [] if refuse else sorted(_below(list(mine_corrupt), before), reverse=True)
  return LocalDecision(choice, move, refuse, nothing_good)


# ---- what a checkpoint.resume request allows ------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ResumeRequest:
  kind: str  # "auto", "never", "step" or "path"
  step: int | None = None  # kind "step"
  path: str | None = None  # kind "path", as written


def parse_resume(resume: str) -> ResumeRequest:
  """`checkpoint.resume` as a request (validated at load: auto, never, a step number or a path)."""
  resume = str(resume)
  if resume in ("auto", "never"):
    return ResumeRequest(resume)
  if resume.isdigit():
    return ResumeRequest("step", step=int(resume))
  return ResumeRequest("path", path=resume)


def check_fresh_start(steps: Sequence[int], where: str, local_key: str = "") -> None:
  """resume=never over existing steps: refused (a fresh run must not overwrite them). `where`: the durable tier's
  location; `local_key`: the local tier's key when `steps` are this run's local steps."""
  if not steps:
    return
  if local_key:
    raise UserError(f"checkpoint.resume=never but {local_key} holds this run's local steps {list(steps)}; a fresh run "
                    "must not overwrite them. Use another output_dir, or resume=auto.")
  raise UserError(f"checkpoint.resume=never but {where} already holds checkpoints at steps {list(steps)}; "
                  "a fresh run must not overwrite them. Use another output_dir/checkpoint.dir, or resume=auto.")


def check_explicit_step(step: int, steps: Sequence[int], where: str) -> None:
  """resume=N names a step the durable tier must hold complete."""
  if step not in steps:
    raise UserError(f"checkpoint.resume={step}: no complete checkpoint at step {step} in "
                    f"{where}; found steps {list(steps) or 'none'}")


def branch_steps(step: int, newer: Sequence[int], branch: bool, where: str, remote: bool = False,
                 local_key: str = "") -> list[int]:
  """resume=N while a tier holds newer steps: the steps to move aside (checkpoint.branch), else refused (continuing
  would train over them, and resume=auto would pick them up later). `local_key`: the local tier's key when it is the
  local tier's steps (this run's); `remote`: the durable tier is an s3:// one (branching it is not supported)."""
  if not newer:
    return []
  if not branch and local_key:
    raise UserError(f"checkpoint.resume={step} but {local_key} holds this run's newer local steps {list(newer)}: "
                    f"continuing from step {step} would train over them. Use resume=auto, or set "
                    f"checkpoint.branch=True to move the newer steps aside and continue from step {step}.")
  if not branch:
    raise UserError(f"checkpoint.resume={step} but {where} holds newer steps {list(newer)}: continuing from "
                    f"step {step} would train over them (and resume=auto would pick them up later). Use "
                    f"resume=auto to continue from step {newer[-1]}, or set checkpoint.branch=True to move the "
                    f"newer steps aside (renamed, not deleted) and continue from step {step}.")
  if remote and not local_key:
    raise UserError(f"checkpoint.branch=True with checkpoint.dir={where}: branching an s3:// "
                    "checkpoint directory is not supported; copy the step to a new checkpoint.dir instead")
  return list(newer)


def check_some_good(good: bool, corrupt: Sequence[tuple[int, object]], start_over_if_corrupt: bool,
                    where: str) -> None:
  """resume=auto over a durable tier whose steps all fail verification (`corrupt`: [(step, error)], newest first):
  refused with nothing moved (a rerun says the same), unless checkpoint.start_over_if_corrupt."""
  if good or not corrupt or start_over_if_corrupt:
    return
  raise UserError(f"checkpoint.dir={where}: no checkpoint verifies (steps {[s for s, _ in corrupt]}; "
                  f"newest: {corrupt[0][1]}). Nothing was moved or trained. Restore the files, resume a "
                  "step explicitly after checking it, or set checkpoint.start_over_if_corrupt=True to move "
                  "them aside and train from step 0.")
