"""Checkpoints with Orbax: what is saved, when, and how a run resumes.

A checkpoint is one Orbax step directory with three items:
  state  the TrainState (params, optimizer state, step), saved sharded, restorable onto any mesh;
  data   the data-iterator state (JSON: the next window index and the loader's identity);
  meta   the resolved config, mesh shape, package version, parameter shapes and wall time;
and, written last once the save is complete, `maxtrain_manifest.json` (maxtrain/checkpoint/manifest.py): every
file's size and checksum. A checkpoint is verified against it before anything is restored; with
`resume=auto` a corrupt one is moved aside (renamed, never deleted) and the next older one is tried.

Saves are asynchronous: the loop blocks only while device arrays are copied to host memory; the
write happens on a background thread. Orbax writes into a temporary directory and renames it when
complete, so a save interrupted at any point (even SIGKILL) is never listed or restored.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

import maxtrain
from maxtrain.errors import UserError, require_writable_dir
from maxtrain.runtime.kv import KeyValue
from maxtrain.checkpoint import manifest
from maxtrain.checkpoint.remote import S3Mirror
from maxtrain.runtime.lock import RunLock
from maxtrain.checkpoint.durable_read import DurableReader, opt_state_paths, param_shapes, processes, read_meta
from maxtrain.checkpoint.tiers import Restored
from maxtrain.config import schema

log = logging.getLogger("maxtrain")
ITEMS = "state meta data".split()  # a step's Orbax items


@dataclasses.dataclass
class SaveTiming:
  step: int
  blocking_s: float  # time the training loop was stopped
  device_to_host_s: float | None = None  # the part of it Orbax's save call took (a synchronous save also waits for the rest)
  save_s: float | None = None  # start of the save to the checkpoint being complete on disk
  manifest_s: float | None = None  # writing the manifest (checksumming every file), part of save_s
  num_bytes: int | None = None  # the step's size on disk


def check_writable(directory: Path) -> None:
  """Fails before any compute when the checkpoint directory cannot be written."""
  require_writable_dir(directory, f"checkpoint.dir={directory}")


def make_private(directory: Path) -> None:
  """Files under `directory` readable by their owner only: the meta item holds the (redacted) config.
  Orbax creates them with the process umask; they are closed once the save is complete."""
  for path in directory.rglob("*"):
    if path.is_file():
      path.chmod(0o600)


class _Saves:
  """The durable tier's asynchronous saves: one in flight; once complete, its manifest (process 0), then its
  upload when mirrored. A failed save is logged and kept in `last_error` / `failed_step`: the run goes on, the
  previous checkpoints are intact."""

  def __init__(self, manager: ocp.CheckpointManager, directory: Path, remote: Any):
    self._manager, self.directory, self.remote = manager, directory, remote
    self._pending: SaveTiming | None = None
    self._done: list[SaveTiming] = []
    self._pending_t0 = 0.0
    self.last_error: Exception | None = None
    self.failed_step: int | None = None

  def start(self, step: int, args: Any) -> SaveTiming | None:
    self.wait_pending()  # one save in flight at a time; also surfaces an error of the previous one
    t0 = time.monotonic()
    try:
      self._manager.save(step, args=args)
    except Exception as e:  # noqa: BLE001 - a failed save must not kill training; the last good one stays
      self.failed(step, e)
      return None
    timing = SaveTiming(step=step, blocking_s=time.monotonic() - t0, device_to_host_s=time.monotonic() - t0)
    self._pending, self._pending_t0 = timing, t0
    return timing

  def failed(self, step: int, error: Exception) -> None:
    log.error("checkpoint save at step %d failed: %s: %s (training continues; the previous checkpoints "
              "are intact)", step, type(error).__name__, error)
    self.last_error, self.failed_step = error, step

  def _collect(self) -> None:
    """Moves the save in flight to `_done` once it is complete (or records its failure)."""
    if self._pending is None or self._manager.is_saving_in_progress():
      return
    done, self._pending = self._pending, None
    try:
      self._manager.check_for_errors()
    except Exception as e:  # noqa: BLE001 - see start()
      self.failed(done.step, e)
      return
    if jax.process_index() == 0:
      try:  # written last: a step without its manifest was never completely saved (or predates them)
        make_private(self.directory / str(done.step) / "meta")
        t0 = time.monotonic()
        manifest.write(self.directory / str(done.step))
        done.manifest_s = time.monotonic() - t0
        done.num_bytes = sum(p.stat().st_size for p in (self.directory / str(done.step)).rglob("*") if p.is_file())
      except Exception as e:  # noqa: BLE001 - see start()
        self.failed(done.step, e)
        return
    done.save_s = time.monotonic() - self._pending_t0
    if self.remote is not None:
      self.remote.upload(self.directory / str(done.step), done.step, keep=list(self._manager.all_steps()))
    self._done.append(done)

  def poll(self) -> list[SaveTiming]:
    self._collect()
    done, self._done = self._done, []
    return done

  def wait_pending(self) -> None:
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - see start()
      if self._pending is not None:
        self.failed(self._pending.step, e)
        self._pending = None
    self._collect()


class Checkpointer:
  """The durable tier (a tiers.Tier): owns the Orbax CheckpointManager of one run.

  `location` is a local path, or an s3:// URL: then checkpoints are staged in `staging` and
  mirrored to object storage in the background (`maxtrain.remote`).
  """

  def __init__(self, ckpt_cfg: schema.Checkpoint, location: str, staging: Path | None = None,
               on_progress: Callable[[], None] | None = None, lock: bool = False,
               target: tuple[Any, Any] | None = None):
    """`lock`: hold the checkpoint directory for the life of this object (the trainer's process 0 does; an
    s3:// one also by a lease object there), so that two runs never save into one directory. `target`: the
    run's (abstract state, shardings), onto which a step without a manifest is verified (DurableReader)."""
    self.cfg = ckpt_cfg
    self._locks: list[Any] = []
    self.remote = None
    if location.startswith("s3://"):
      self.remote = S3Mirror(location, ckpt_cfg.s3_connect_timeout_s, ckpt_cfg.s3_read_timeout_s,
                             ckpt_cfg.s3_max_attempts, on_progress)
      directory = staging if staging is not None else Path("checkpoints")
    elif "://" in location:
      raise UserError(f"checkpoint.dir={location}: only local paths and s3:// URLs are supported")
    else:
      directory = Path(location)
    self.location = location
    self.directory = directory.absolute()  # Orbax refuses relative paths (the default output_dir is one)
    check_writable(self.directory)
    if lock:  # before Orbax looks at the directory: a second run leaves the first one's saves alone
      self._locks = take_locks(self.directory, self.remote)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=ckpt_cfg.max_to_keep if ckpt_cfg.max_to_keep > 0 else None,
        keep_period=ckpt_cfg.keep_every if ckpt_cfg.keep_every > 0 else None,
        enable_async_checkpointing=ckpt_cfg.async_save,
        create=not KeyValue.group,  # with active_processes Orbax does not: check_writable made it
        # An RL trainer whose rollout side is processes of their own: only the trainer's save (runtime/kv.py)
        multiprocessing_options=processes(),
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)
    self.saves = _Saves(self._manager, self.directory, self.remote)
    self.reader = DurableReader(bool(ckpt_cfg.verify), target)

  def release_locks(self) -> None:
    while self._locks:
      self._locks.pop().release()

  def steps(self) -> list[int]:
    """Complete checkpoints, local and (if mirrored) remote."""
    local = set(self._manager.all_steps())
    return sorted(local | set(self.remote.complete_steps() if self.remote else ()))

  def path(self, step: int) -> Path:
    """The local directory of a complete step, downloading it first if only the mirror has it."""
    path = self.directory / str(step)
    if step not in self._manager.all_steps():
      t0 = time.monotonic()
      self.remote.download(step, path)
      self._manager.reload()
      log.info("downloaded checkpoint step %d from %s in %.2fs", step, self.location, time.monotonic() - t0)
    return path

  def move_aside(self, step: int, why: str = "corrupt") -> Path:
    """Renames a step directory out of Orbax's sight (process 0; nothing is deleted)."""
    path = self.directory / str(step)
    moved = manifest.move_aside(path, why) if jax.process_index() == 0 else path
    self._manager.reload()
    return moved

  def reload(self) -> None:
    """Lists the directory afresh (another process moved steps)."""
    self._manager.reload()

  def verify(self, path: Path) -> None:
    self.reader.verify(path)

  @staticmethod
  def read_meta(path: Path) -> dict:
    return read_meta(path)

  def restore(self, path: Path, abstract_state: Any, shardings: Any) -> Restored:
    """Verifies (once), then restores onto the current mesh (resharding if it was saved on another)."""
    return self.reader.restore(path, abstract_state, shardings)

  def save(self, step: int, state: Any, data_state: dict, meta: dict) -> SaveTiming | None:
    """Starts a save; returns its timing, or None if it was saved already or failed (logged, the run goes on).
    `meta`: the run's (identity.run_meta); the tier adds what it knows of the state."""
    if step in self._manager.all_steps():
      return None  # already saved (e.g. the final step coincides with a periodic save)
    meta = {**meta, "version": maxtrain.__version__, "param_shapes": param_shapes(state),
            "opt_state_paths": opt_state_paths(state), "wall_time": time.time(), "step": step}
    if KeyValue.group == 1 and jax.process_count() > 1:
      # One trainer process of a job whose rollout side is processes of their own: Orbax refuses arrays one
      # process holds whole in a multi-process job, so they are saved as the host arrays they are (same files).
      state = jax.device_get(state)
    return self.saves.start(step, ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta)))

  def poll(self) -> list[SaveTiming]:
    """Timings of the saves completed since the last call (failures are logged and kept in
    `saves.last_error` / `saves.failed_step` instead)."""
    return self.saves.poll()

  def wait(self) -> list[SaveTiming]:
    """Blocks until the save in flight (if any) is complete; returns like poll()."""
    self.saves.wait_pending()
    return self.poll()

  def close(self) -> None:
    """Waits for the last save (and its upload) to be complete."""
    try:
      self.saves.wait_pending()
      self._manager.close()
      if self.remote is not None:
        t0 = time.monotonic()
        self.remote.close()
        log.info("uploads to %s finished %.2fs after the end of training", self.location, time.monotonic() - t0)
    finally:
      self.release_locks()  # last: the directory is ours until the last save is complete


def take_locks(directory: Path, remote: Any) -> list[Any]:
  """The directory's lock (and an s3:// one's lease), so that two runs never save into one directory."""
  locks = [RunLock(directory, "checkpoint.dir").acquire()]
  if remote is not None:
    try:
      locks.append(remote.lease())
    except BaseException:
      locks.pop().release()
      raise
  return locks
