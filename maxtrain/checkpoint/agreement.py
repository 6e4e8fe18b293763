"""How the processes take one checkpoint decision together, through the coordination service's key-value store
(runtime/kv.py; no device collective): each lists its local steps and reads everyone's (`gather`), so all of them
choose the same tier and step from the same inputs; process 0 decides a stop request's plan and the others read it
(`plan`); the others wait until process 0 has moved abandoned steps aside (`barrier`). Without a key-value store
(one process) each is a no-op. The decisions themselves are policy.py's."""

from __future__ import annotations

import dataclasses
import json

from maxtrain.checkpoint import policy

AGREE_TIMEOUT_S = 600.0  # the other processes list their local steps at the same point of start-up


class Agreement:
  """Rounds of `gather` are numbered so a later search (a rollback) never reads an earlier round's lists."""

  def __init__(self, kv, process_index: int, process_count: int):
    self.kv, self.process_index, self.process_count = kv, process_index, process_count
    self._round = 0
    self._barriers = 0  # numbers the barrier keys: each abandon waits for its own

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

  def plan(self, step: int, plan: policy.PreemptionPlan) -> policy.PreemptionPlan:
    """Process 0's preemption plan at `step` on every process (the durable save is collective)."""
    if self.kv is None:
      return plan
    key = f"ckpt-preempt/{step}"
    if self.process_index == 0:
      self.kv.set(key, json.dumps(dataclasses.asdict(plan)))
      return plan
    value = self.kv.get(key, AGREE_TIMEOUT_S)
    if value is None:
      raise RuntimeError(f"process 0 did not say which tiers the stop at step {step} saves within "
                         f"{AGREE_TIMEOUT_S:.0f}s")
    return policy.PreemptionPlan(**json.loads(value))

  def abandoned(self) -> bool:
    """After process 0 moved the abandoned durable steps aside: the others wait for it. True when there are
    other processes (they must then list the durable tier afresh)."""
    if self.kv is None:
      return False
    self._barriers += 1
    key = f"ckpt-abandon/{self._barriers}"
    if self.process_index == 0:
      self.kv.set(key, "done")
    elif self.kv.get(key, AGREE_TIMEOUT_S) is None:
      raise RuntimeError("process 0 did not set aside the abandoned durable steps within "
                         f"{AGREE_TIMEOUT_S:.0f}s")
    return True
