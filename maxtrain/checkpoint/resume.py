"""Which checkpoint a run resumes (or rolls back) from, in one place: `checkpoint.resume` (auto, never, a step, a
path) over the durable tier (storage.Checkpointer) and the optional local tier (local.LocalTier), every candidate
verified before it is chosen. The rules are policy.py's (pure: the tier choice, what a request allows); this module
lists, verifies, asks the policy, moves aside what it says (corrupt, branched; renamed, never deleted) and records
each move as an event. With several processes the local tier's lists are agreed first (agreement.py), so every
process takes the same decision.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from maxtrain.checkpoint import manifest, policy, timeline
from maxtrain.checkpoint.agreement import Agreement
from maxtrain.checkpoint.local import LocalTier
from maxtrain.checkpoint.storage import Checkpointer
from maxtrain.errors import UserError
from maxtrain.monitor import events as ev

log = logging.getLogger("maxtrain")


@dataclasses.dataclass(frozen=True)
class Resolved:
  """The resume decision: the step directory to restore (None: a fresh start), its tier, why, and the seconds
  spent listing and verifying the candidates (in the `restore` event)."""
  path: Path | None
  tier: str | None
  reason: str = ""
  verify_s: float | None = None


class Resume:
  """Resolves `checkpoint.resume` and a rollback's restore point over the run's tiers."""

  def __init__(self, ck: Any, store: Checkpointer, local: LocalTier | None, agreement: Agreement, events: Any,
               mesh_shape: dict, process_count: int):
    self.ck, self.store, self.local, self.agreement, self.events = ck, store, local, agreement, events
    self.mesh_shape, self.process_count = mesh_shape, process_count

  def resolve(self) -> Resolved:
    """The step to restore, or a fresh start (path None)."""
    request = policy.parse_resume(self.ck.resume)
    if self.local is not None and request.kind == "never":
      policy.check_fresh_start(self.local.own_steps(), self.store.location,
                               local_key=f"checkpoint.local_dir={self.ck.local_dir}")
    if request.kind == "step" and self.local is not None:  # every process takes this path: the search is agreed
      resolved = self._local_explicit(request.step)
      if resolved is not None:
        return resolved
    t0 = time.monotonic()
    path = self.durable(request)
    resolved = Resolved(path, policy.DURABLE if path is not None else None)
    if self.local is not None and request.kind == "auto":
      durable = int(path.name) if path is not None and path.name.isdigit() else None
      choice = self.choose_local(durable)
      log.info("resume: %s", choice.reason)
      resolved = dataclasses.replace(resolved, reason=choice.reason)
      if choice.tier == policy.LOCAL:
        resolved = dataclasses.replace(resolved, path=self.local.path(choice.step), tier=policy.LOCAL)
        self.store.reader.forget_prefetched()
    resolved = dataclasses.replace(resolved, verify_s=time.monotonic() - t0)  # listing and verifying the candidates
    if self.local is not None and request.kind == "step":
      self._branch_local(request.step)
    return resolved

  # ---- the durable tier ---------------------------------------------------------------------

  def durable(self, request: policy.ResumeRequest) -> Path | None:
    """The durable tier's step for `request`, verified against its manifest (`checkpoint.verify`): with `auto`,
    the newest that verifies (corrupt ones above it moved aside, an event each); an explicit step while newer ones
    exist is refused unless `checkpoint.branch` (then they are moved aside)."""
    timeline.check_step_dirs(self.store)
    steps = self.store.steps()
    if request.kind == "auto":
      return self._newest_good_moving_corrupt(steps)
    if request.kind == "never":
      policy.check_fresh_start(steps, self.store.location)
      return None
    if request.kind == "step":
      policy.check_explicit_step(request.step, steps, self.store.location)
      path = self.store.path(request.step)
      self.store.verify(path)  # a CorruptCheckpoint is a UserError: exit 2, naming the file
      self._branch_durable(request.step, [s for s in steps if s > request.step])
      return path
    path = Path(request.path).absolute()
    if not path.is_dir():
      raise UserError(f"checkpoint.resume={request.path!r}: not 'auto', 'never', a step number, nor an existing "
                      "checkpoint directory")
    if not ocp.step.is_checkpoint_finalized(path) or not (path / "state").is_dir():
      raise UserError(f"checkpoint.resume={request.path!r}: not a complete maxtrain checkpoint (it has no finished "
                      "'state' item; an interrupted save is never restored)")
    self.store.verify(path)
    return path

  def newest_good(self, steps: list[int]) -> tuple[Path | None, list[tuple[int, manifest.CorruptCheckpoint]]]:
    """(the newest of `steps` that verifies or None, [(step, error)] of the corrupt ones above it), newest
    first. Nothing is moved."""
    corrupt = []
    for step in reversed(steps):
      path = self.store.path(step)
      try:
        self.store.verify(path)
        return path, corrupt
      except manifest.CorruptCheckpoint as e:
        corrupt.append((step, e))
    return None, corrupt

  def _newest_good_moving_corrupt(self, steps: list[int]) -> Path | None:
    """The newest step that verifies; the corrupt ones above it moved aside. None verifying is exit 2 (nothing
    moved, so a rerun says the same) unless `start_over_if_corrupt`: then all are moved aside."""
    good, corrupt = self.newest_good(steps)
    policy.check_some_good(good is not None, corrupt, self.ck.start_over_if_corrupt, self.store.location)
    for step, error in corrupt:
      moved = self.store.move_aside(step)
      log.error("%s; moved aside to %s%s", error, moved, "" if good else " (checkpoint.start_over_if_corrupt)")
      self._corrupt(step, error, moved)
    return good

  def _branch_durable(self, step: int, newer: list[int]) -> None:
    newer = policy.branch_steps(step, newer, self.ck.branch, self.store.location, remote=self.store.remote is not None)
    self._move_branched(step, newer, self.store, policy.DURABLE, "newer steps")

  # ---- the local tier -----------------------------------------------------------------------

  def _local_explicit(self, step: int) -> Resolved | None:
    """resume=N with a local tier, as in the durable tier: the durable tier's step N when it has one (None: resolved
    there), else this run's local step N if it is usable on every process (exit 2 if not)."""
    timeline.check_step_dirs(self.store)
    if step in self.store.steps():
      return None  # the durable tier's step N: resolved there
    if not self.ck.branch:
      self._branch_local(step)  # newer local steps: exit 2 before anything is read or moved
    choice = self.choose_local(None, before=step + 1)
    if choice.step != step:
      raise UserError(f"checkpoint.resume={step}: no complete checkpoint at step {step} in {self.store.location} "
                      f"(found steps {self.store.steps() or 'none'}), nor a local step {step} of this run usable on "
                      f"every process ({choice.reason})")
    self._branch_local(step)
    self._branch_durable(step, [s for s in self.store.steps() if s > step])
    return Resolved(self.local.path(step), policy.LOCAL, f"checkpoint.resume={step}: {choice.reason}", 0.0)

  def _branch_local(self, step: int) -> None:
    """resume=N while this run's local tier holds newer steps: exit 2 unless checkpoint.branch (then moved
    aside, an event), as in the durable tier."""
    newer = policy.branch_steps(step, [s for s in self.local.own_steps() if s > step], self.ck.branch,
                                self.store.location, local_key=f"checkpoint.local_dir={self.ck.local_dir}")
    self._move_branched(step, newer, self.local, policy.LOCAL, "newer local steps")

  def _move_branched(self, step: int, newer: list[int], tier: Any, name: str, what: str) -> None:
    """The steps after a resumed step that checkpoint.branch let stand, moved aside in `tier` and recorded."""
    if not newer:
      return
    moved = [tier.move_aside(s, "branched") for s in newer]
    log.warning("checkpoint.branch: resuming step %d; %s %s moved aside to %s", step, what, newer,
                [str(m) for m in moved])
    self._branched(step, newer, moved, name)

  def choose_local(self, durable: int | None, before: int | None = None) -> policy.Choice:
    """The tier and step to restore, the same on every process (the local steps and the corrupt ones are
    agreed), by policy.local_decision: this process's corrupt local steps moved aside (an event each) once a good
    step is chosen, or exit 2 with nothing moved."""
    scan = self.local.scan(self.mesh_shape, self.process_count, self.ck.verify)
    for step, reason in scan.skipped.items():
      log.warning("local checkpoint %s not used: %s", self.local.path(step), reason)
    lists = self.agreement.gather({"usable": scan.usable, "corrupt": sorted(scan.corrupt), "intact": scan.intact})
    decision = policy.local_decision(lists, scan.corrupt, durable, before, bool(self.ck.verify),
                                     bool(self.ck.start_over_if_corrupt))
    corrupt = {step: e for step, e in scan.corrupt.items() if before is None or step < before}
    if decision.refuse:
      for step, error in sorted(corrupt.items(), reverse=True):
        log.error("local %s", error)
      anywhere = {s for p in lists for s in p["corrupt"] if before is None or s < before}
      first = corrupt[max(corrupt)] if corrupt else None
      raise UserError(f"checkpoint.local_dir={self.ck.local_dir}: no local step verifies (steps "
                      f"{sorted(anywhere, reverse=True)}"
                      f"{'; newest here: ' + str(first) if first is not None else ''}) and the durable tier "
                      f"{self.store.location} holds no good step. Nothing was moved or trained. Restore the files, or "
                      "set checkpoint.start_over_if_corrupt=True to move them aside and train from step 0.")
    for step in decision.move_aside:
      error, moved = corrupt[step], self.local.move_aside(step)
      log.error("local %s; moved aside to %s%s", error, moved,
                " (checkpoint.start_over_if_corrupt)" if decision.start_over else "")
      self._corrupt(step, error, moved, policy.LOCAL)
    return decision.choice

  # ---- a rollback ---------------------------------------------------------------------------

  def durable_before(self, step: int) -> Path | None:
    """A rollback's durable restore point: the newest durable step from before `step` that verifies, or None when
    there is none at all. Corrupt ones above a good one are moved aside (an event each); when steps exist but none
    verifies, CorruptCheckpoint (exit 2): the run must not go on from step 0. The local tier may then hold a newer
    one (`choose_local(durable, before=step)`)."""
    good, corrupt = self.newest_good([s for s in self.store.steps() if s < step])
    if good is None and corrupt:
      raise corrupt[0][1]
    for bad, error in corrupt:
      moved = self.store.move_aside(bad)
      log.error("rollback: %s; moved aside to %s, trying an older checkpoint", error, moved)
      self._corrupt(bad, error, moved)
    return good

  # ---- events -------------------------------------------------------------------------------

  def _corrupt(self, step: int, error: manifest.CorruptCheckpoint, moved: Path, tier: str | None = None) -> None:
    """`tier` None: the event names none (a durable step at resume, or at a rollback)."""
    fields = {"tier": tier} if tier == policy.LOCAL else {}
    self.events.emit(ev.CHECKPOINT_CORRUPT, step, file=error.first_bad_file, reason=error.reason,
                     moved_to=str(moved), **fields)

  def _branched(self, step: int, newer: list[int], moved: list[Path], tier: str) -> None:
    self.events.emit(ev.CHECKPOINT_BRANCH, step, newer_steps=newer, moved_to=[str(m) for m in moved], tier=tier)
