"""The steps around a resume that belong to no timeline this run follows: before the durable tier is listed,
step directories that are incomplete (moved aside) or symlinked (refused); after a restore to `step`, the newer
steps of both tiers (durable ones moved aside, in object storage too; this process's local ones deleted), so that
resume=auto never takes one and a save of the same step number on the new timeline is not skipped."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import jax

from maxtrain.checkpoint import manifest
from maxtrain.checkpoint.agreement import Agreement
from maxtrain.checkpoint.local import LocalTier
from maxtrain.checkpoint.storage import ITEMS, Checkpointer
from maxtrain.errors import UserError
from maxtrain.monitor import events as ev

log = logging.getLogger("maxtrain")


def check_step_dirs(store: Checkpointer) -> None:
  """Before the steps are listed: a symlinked step directory is refused (rotation would delete through
  it, its manifest would land in another run's directory); a numeric directory without the finished
  items (empty, or copied in part) is an incomplete step: moved aside with a warning, never restored."""
  for path in sorted(store.directory.iterdir()) if store.directory.is_dir() else ():
    if not path.name.isdigit():
      continue
    if path.is_symlink():
      raise UserError(f"checkpoint.dir={store.location}: step directory {path.name} is a symlink (to "
                      f"{os.readlink(path)}); rotation and manifests need real step directories: replace it "
                      f"with a copy (cp -r) or remove it")
    if path.is_dir() and not all((path / item).is_dir() for item in ITEMS):
      moved = manifest.move_aside(path, "incomplete") if jax.process_index() == 0 else path
      log.warning("checkpoint step directory %s is incomplete (no finished state/meta/data items): skipped, "
                  "moved aside to %s", path, moved)
  store.reload()


def abandon_durable(store: Checkpointer, step: int) -> list[tuple[int, list[str]]]:
  """The durable steps newer than `step`: process 0 moves each aside, locally and in object storage, to
  `<step>.abandoned-<time>` (nothing is deleted); [(step, [new places])]. The other processes must reload after it."""
  store.saves.wait_pending()
  remote = set()
  if store.remote is not None:
    store.remote.cancel_after(step)  # an upload of a newer step in flight must not complete after the move
    remote = set(store.remote.complete_steps())
  moved = []
  for newer in [s for s in store.steps() if s > step]:
    places = []
    if (store.directory / str(newer)).is_dir():
      places.append(str(store.move_aside(newer, "abandoned")))
    if newer in remote and jax.process_index() == 0:
      stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
      name = Path(places[0]).name if places else f"{newer}.abandoned-{stamp}"
      places.append(store.remote.move_aside(newer, name))
    moved.append((newer, places))
  return moved


def abandon_after(step: int, why: str, store: Checkpointer, local: LocalTier | None, agreement: Agreement,
                  events: Any) -> None:
  """Restored `step`: the newer steps of both tiers belong to the abandoned timeline. The durable ones are
  moved aside (never deleted: a user may want them back), the local ones (this process's short-term
  copies) deleted; the other processes wait until process 0 has moved them, then list the tier afresh."""
  dropped = local.drop_after(step) if local is not None else []
  if dropped:
    log.warning("local checkpoint steps %s are newer than the restored step %d (a run that was abandoned): deleted",
                dropped, step)
  moved = abandon_durable(store, step)
  if agreement.abandoned():
    store.reload()
  if (moved or dropped) and jax.process_index() == 0:
    events.emit(ev.CHECKPOINT_ABANDONED, step, durable_steps=[s for s, _ in moved],
                moved_to=[p for _, places in moved for p in places], local_steps=dropped, reason=why)
  if moved and jax.process_index() == 0:
    log.warning("durable checkpoint steps %s are newer than the restored step %d (%s): they belong to an abandoned "
                "timeline, moved aside (not deleted) to %s; resume=auto will not take them",
                [s for s, _ in moved], step, why, [p for _, places in moved for p in places])
