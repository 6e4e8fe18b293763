"""The run's checkpoint component: where (`checkpoint.dir`, default `<output_dir>/checkpoints`), when
(every `checkpoint.every_steps`, at the end, on preemption), restoring onto the run's state spec, and
the record of every save (events, TensorBoard, the log). The storage itself (Orbax, S3, verification) is `storage.py`."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

import jax
import ml_collections

from maxtrain.checkpoint import manifest
from maxtrain.checkpoint.storage import Checkpointer, Restored, SaveTiming
from maxtrain.models import quant
from maxtrain.monitor import events as ev

log = logging.getLogger("maxtrain")


class Checkpoints:
  """The run's checkpoint component: where (`checkpoint.dir`, default `<output_dir>/checkpoints`), when
  (every `checkpoint.every_steps`, at the end, on preemption), restoring onto the run's state spec,
  and the record of every save (events, TensorBoard, the log)."""

  def __init__(self, cfg: ml_collections.ConfigDict, output_dir: Path, events: Any, metrics: Any,
               on_save_started: Any = None, on_progress: Callable[[], None] | None = None,
               on_saved: Callable[[int, Path], None] | None = None):
    local = output_dir / "checkpoints"
    self.cfg = cfg
    self.store = Checkpointer(cfg.checkpoint, cfg.checkpoint.dir or str(local), local, on_progress,
                              lock=jax.process_index() == 0)
    self.events, self.metrics = events, metrics
    self.on_save_started = on_save_started or (lambda step: None)
    self.on_progress = on_progress or (lambda: None)
    self.on_saved = on_saved or (lambda step, path: None)  # a save is complete on disk
    self.tokenizer_identity: str | None = None  # of the run's stores (loop/data.py): in every checkpoint's meta
    self.rollbacks = 0  # the run's rollbacks so far (loop/rollback.py keeps the count): in every checkpoint's meta

  @property
  def location(self) -> str:
    return self.store.location

  def resolve_resume(self) -> Path | None:
    def corrupt(step: int, error: manifest.CorruptCheckpoint, moved: Path) -> None:
      self.events.emit(ev.CHECKPOINT_CORRUPT, step, file=error.first_bad_file, reason=error.reason,
                       moved_to=str(moved))

    def branch(step: int, newer: list[int], moved: list[Path]) -> None:
      self.events.emit(ev.CHECKPOINT_BRANCH, step, newer_steps=newer, moved_to=[str(m) for m in moved])

    return self.store.resolve_resume(on_corrupt=corrupt, on_branch=branch)

  def restore(self, path: Path, state_spec: Any) -> Restored:
    t0 = time.monotonic()
    restored = self.store.restore(path, state_spec.abstract, state_spec.shardings)
    self.events.emit(ev.RESTORE, restored.step, seconds=time.monotonic() - t0, path=str(path))
    log.info("restored step %d from %s in %.2fs (saved on mesh %s)", restored.step, path, time.monotonic() - t0,
             restored.meta.get("mesh"))
    note = quant.resume_note(restored.meta.get("config", {}).get("model", {}), self.cfg.model)
    if note:
      log.warning("%s", note)
    return restored

  def restore_before(self, step: int, state_spec: Any) -> Any | None:
    """The newest checkpoint's state from before `step` that verifies (waiting for a save in flight), or
    None when there is none at all. Corrupt ones above a good one are moved aside (an event each); when
    checkpoints exist but none verifies, CorruptCheckpoint (exit 2): the run must not go on from step 0."""
    self._log(self.store.wait())
    before = [s for s in self.store.steps() if s < step]
    good, corrupt = self.store.newest_good(before)
    if good is None and corrupt:
      raise corrupt[0][1]
    for bad, error in corrupt:
      moved = self.store.move_aside(bad)
      log.error("rollback: %s; moved aside to %s, trying an older checkpoint", error, moved)
      self.events.emit(ev.CHECKPOINT_CORRUPT, bad, file=error.first_bad_file, reason=error.reason, moved_to=str(moved))
    if good is None:
      return None
    return self.store.restore(good, state_spec.abstract, state_spec.shardings).state

  def after_step(self, step: int, state: Any, data_state: dict, mesh_shape: dict, *, final: bool) -> None:
    """Saves when the schedule says so (the final step synchronously); else collects finished saves."""
    if final or self.store.should_save(step):
      self.save(step, state, data_state, mesh_shape, sync=final)
    else:
      self._log(self.store.poll())

  def save(self, step: int, state: Any, data_state: dict, mesh_shape: dict, *, sync: bool) -> None:
    with self.metrics.outside(step):
      self.events.emit(ev.CHECKPOINT_SAVE_START, step)
      t0 = time.monotonic()
      extra = {"rollbacks": self.rollbacks, "tokenizer_identity": self.tokenizer_identity}
      timing = self.store.save(step, state, data_state, self.cfg, mesh_shape, extra)
      if timing is not None:
        self.on_save_started(step)
        done = self.store.wait() if sync else self.store.poll()
        if sync:
          timing.blocking_s = time.monotonic() - t0  # the loop waited for all of it
        self.events.emit(ev.CHECKPOINT_BLOCKED, step, blocking_s=time.monotonic() - t0)
        self._log(done)

  def check_final(self, step: int) -> None:
    """Exiting 0 would lose this run's work silently when its last save failed; a crash exit lets a
    supervisor restart from the newest complete checkpoint."""
    if self.store.failed_step == step:
      raise RuntimeError(f"the final checkpoint (step {step}) could not be written to {self.location}: "
                         f"{self.store.last_error}")

  def _log(self, timings: list[SaveTiming]) -> None:
    for timing in timings:
      self.events.emit(ev.CHECKPOINT_SAVE_END, timing.step, blocking_s=timing.blocking_s, save_s=timing.save_s)
      self.metrics.scalars(timing.step, {"checkpoint/blocking_s": timing.blocking_s,
                                         "checkpoint/save_s": timing.save_s})
      log.info("checkpoint step %d saved: loop blocked %.3fs, complete on disk after %.3fs",
               timing.step, timing.blocking_s, timing.save_s)
      self.on_saved(timing.step, self.store.local_path(timing.step))

  def close(self) -> None:
    self.on_progress()  # the wait for the last save and upload starts now, under the watchdog
    self.store.close()
