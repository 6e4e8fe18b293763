"""Which tier a run resumes from: the newest verified step across the local tier (node-local, per process)
and the durable one (`checkpoint.dir`, shared or S3).

A local step counts only when every process has it complete, verified and saved on this layout: the
processes each list theirs and exchange the lists through the coordination service's key-value store
(runtime/kv.py; no device collective), so all of them take the same decision from the same inputs.
The durable tier is one directory every process reads alike, so its newest good step is the same
everywhere. The newer of the two wins (the durable one on a tie: it survives the node); the reason is
logged and put in the `restore` event.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Sequence

log = logging.getLogger("maxtrain")
LOCAL, DURABLE = "local", "durable"
AGREE_TIMEOUT_S = 600.0  # the other processes list their local steps at the same point of start-up


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


def choose(per_process: Sequence[Sequence[int]], durable_step: int | None, before: int | None = None,
           verified: bool = True) -> Choice:
  """The step to restore (below `before` if given): the newest of the local steps every process holds
  and the durable tier's newest good step; the durable one on a tie. `verified`: the local steps were checked
  against their manifests (checkpoint.verify), which the reason says only then."""
  def below(steps):
    return [s for s in steps if before is None or s < before]

  local = below(common_steps(per_process))
  durable = durable_step if durable_step is not None and (before is None or durable_step < before) else None
  newest_local = local[-1] if local else None
  missing = [i for i, steps in enumerate(per_process) if not below(steps)]
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


class Agreement:
  """Exchanges each process's usable local steps; rounds are numbered so a later search (a rollback)
  never reads an earlier round's lists."""

  def __init__(self, kv, process_index: int, process_count: int):
    self.kv, self.process_index, self.process_count = kv, process_index, process_count
    self._round = 0

  def gather(self, mine):
    """Every process's `mine` (any JSON value), in process order."""
    if self.kv is None:
      return [json.loads(json.dumps(mine))]
    self._round += 1
    self.kv.set(f"ckpt-local/{self._round}/{self.process_index}", json.dumps(mine))
    lists = []
    for process in range(self.process_count):
      value = self.kv.get(f"ckpt-local/{self._round}/{process}", AGREE_TIMEOUT_S)
      if value is None:
        raise RuntimeError(f"process {process} did not list its local checkpoints within {AGREE_TIMEOUT_S:.0f}s")
      lists.append(json.loads(value))
    return lists


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
