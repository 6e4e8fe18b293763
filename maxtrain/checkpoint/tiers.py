"""The one interface both checkpoint tiers implement: the durable tier (storage.Checkpointer: Orbax, one directory
every process reads alike, or s3:// staged) and the node-local tier (local.LocalTier: each process its own shards).
The run's component (schedule.py) and the resume search (resume.py) ask a tier only this; which tier a step comes
from, and when each saves, is policy.py's."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Protocol


@dataclasses.dataclass
class Restored:
  step: int  # the step its tier saved it under (its directory's name), not the state's update counter
  state: Any
  data_state: dict
  meta: dict
  path: str


def saved_step(meta: dict, path: Path, state: Any) -> int:
  """The loop step a checkpoint holds: the number its tier saved it under (meta `step`, its directory's name), which
  is what the tiers' step lists, the abandon and promote logic and the events compare. Never the state's counter:
  that counts optimizer updates, and a GRPO round makes ppo_epochs x minibatches of them."""
  if "step" in meta:
    return int(meta["step"])
  if Path(path).name.isdigit():
    return int(Path(path).name)
  return int(state.step)  # saved before meta held its step and copied under another name: one update a step then


class Tier(Protocol):
  def steps(self) -> list[int]:
    """Complete steps, ascending (a save cut short is never one)."""

  def path(self, step: int) -> Path:
    """The local directory of a complete step (the durable tier downloads a mirrored one first)."""

  def save(self, step: int, state: Any, data_state: dict, meta: dict) -> Any:
    """Starts a save of `state` with `meta` (the run's: config, mesh, identity.RunIdentity's fields); the loop
    blocks only for the device-to-host copy. Its record, or None when nothing was started."""

  def poll(self) -> list:
    """Records of the saves finished since the last call."""

  def wait(self) -> list:
    """Blocks until the save in flight is complete; returns like poll()."""

  def verify(self, path: Path) -> None:
    """Checks a step against its manifest; manifest.CorruptCheckpoint (exit 2, naming the file) if damaged."""

  def restore(self, path: Path, abstract_state: Any, shardings: Any) -> Restored:
    """The step onto this run's devices, per `shardings`."""

  def read_meta(self, path: Path) -> dict:
    """The step's meta item (config, mesh, identity, ...) without restoring it."""

  def move_aside(self, step: int, why: str = "corrupt") -> Path:
    """Renames a step out of the tier's sight (nothing is deleted); its new place."""

  def close(self) -> None:
    """Waits for the last save, then lets go of the tier's directory."""
