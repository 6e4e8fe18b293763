"""The record of every finished save, phase by phase, per tier (events, TensorBoard, the log), and the measured
save costs the preemption plan reads (policy.mean_save_s)."""

from __future__ import annotations

import logging
from typing import Any, Callable

from maxtrain.checkpoint import policy
from maxtrain.checkpoint.local_write import LocalSave
from maxtrain.checkpoint.storage import Checkpointer, SaveTiming
from maxtrain.monitor import events as ev

log = logging.getLogger("maxtrain")


class SaveRecord:
  """`on_saved(step, path)`: a durable save is complete on disk. `max_durable_lag`: uploads that may wait before a
  `checkpoint_behind` event; `local_tier`: whether the run has one (the warning says training goes on there)."""

  def __init__(self, store: Checkpointer, events: Any, metrics: Any, on_saved: Callable[[int, Any], None],
               max_durable_lag: int, local_tier: bool):
    self.store, self.events, self.metrics, self.on_saved = store, events, metrics, on_saved
    self.max_durable_lag, self.local_tier = max_durable_lag, local_tier
    self._save_s: dict[str, list[float]] = {policy.LOCAL: [], policy.DURABLE: []}  # measured, for a stop request
    self._upload_s: list[float] = []
    self._behind_reported = 0  # the lag last reported (a checkpoint_behind event each time it grows)

  def durable(self, timings: list[SaveTiming]) -> None:
    for timing in timings:
      phases = {"device_to_host_s": timing.device_to_host_s, "manifest_s": timing.manifest_s,
                "write_s": timing.save_s - timing.device_to_host_s - (timing.manifest_s or 0.0)}  # Orbax's serialise + write
      self._save_s[policy.DURABLE].append(timing.save_s)
      self.events.emit(ev.CHECKPOINT_SAVE_END, timing.step, blocking_s=timing.blocking_s, save_s=timing.save_s,
                       tier=policy.DURABLE, bytes=timing.num_bytes, **phases)
      self.metrics.scalars(timing.step, {"checkpoint/blocking_s": timing.blocking_s,
                                         "checkpoint/save_s": timing.save_s}
                           | {f"checkpoint/durable/{k}": v for k, v in phases.items() if v is not None})
      log.info("checkpoint step %d saved: loop blocked %.3fs, complete on disk after %.3fs",
               timing.step, timing.blocking_s, timing.save_s)
      self.on_saved(timing.step, self.store.path(timing.step))

  def local(self, saves: list[LocalSave]) -> None:
    for save in saves:
      if save.error is not None:
        log.error("local checkpoint of step %d failed: %s: %s (training continues)", save.step,
                  type(save.error).__name__, save.error)
        continue
      phases = {"device_to_host_s": save.blocking_s, **save.phases}
      self._save_s[policy.LOCAL].append(save.save_s)
      self.events.emit(ev.CHECKPOINT_SAVE_END, save.step, tier=policy.LOCAL, blocking_s=save.blocking_s,
                       save_s=save.save_s, bytes=save.num_bytes, **phases)
      self.metrics.scalars(save.step, {f"checkpoint/local/{k}": v for k, v in phases.items()}
                           | {"checkpoint/local/save_s": save.save_s})
      log.info("local checkpoint step %d saved (%.1f MB): loop blocked %.3fs, complete after %.3fs (%s)", save.step,
               save.num_bytes / 1e6, save.blocking_s, save.save_s,
               ", ".join(f"{k} {v:.3f}s" for k, v in save.phases.items()))

  def uploads(self, step: int) -> None:
    """Uploads finished (bytes/s), and whether the durable tier falls behind (a slow or stalled bucket)."""
    remote = self.store.remote
    if remote is None:
      return
    for saved_step, num_bytes, seconds in remote.uploaded():
      rate = num_bytes / max(seconds, 1e-9)
      self._upload_s.append(seconds)
      self.events.emit(ev.CHECKPOINT_UPLOAD, saved_step, tier=policy.DURABLE, bytes=num_bytes, seconds=seconds,
                       bytes_per_s=rate)
      self.metrics.scalars(saved_step, {"checkpoint/durable/upload_s": seconds,
                                        "checkpoint/durable/upload_bytes_per_s": rate})
    pending, limit = remote.pending(), self.max_durable_lag
    if pending > limit and pending > self._behind_reported:
      self.events.emit(ev.CHECKPOINT_BEHIND, step, tier=policy.DURABLE, pending=pending, max_durable_lag=limit)
      log.warning("the durable tier %s is falling behind: %d saves wait for upload (checkpoint.max_durable_lag=%d); "
                  "training goes on%s", self.store.location, pending, limit, " on the local tier" if self.local_tier else "")
    self._behind_reported = pending if pending > limit else 0

  def save_cost(self, tier: str) -> float | None:
    """Mean seconds from the start of a save of `tier` to its being complete (for s3://, uploaded too) in this
    attempt; None before one was measured."""
    mirrored = tier == policy.DURABLE and self.store.remote is not None
    return policy.mean_save_s(self._save_s[tier], self._upload_s if mirrored else None)
