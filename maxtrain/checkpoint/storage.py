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
import gc
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import ml_collections
import orbax.checkpoint as ocp

import maxtrain
from maxtrain import config as config_lib
from maxtrain.errors import UserError, require_writable_dir
from maxtrain.checkpoint import manifest
from maxtrain.config.sections import checkpoint_tiers as validate_tiers  # noqa: F401 (schedule.py's; beside the keys)
from maxtrain.sharding.layout import param_name, with_shardings

log = logging.getLogger("maxtrain")
ITEMS = "state meta data".split()  # a step's Orbax items


@dataclasses.dataclass
class Restored:
  step: int
  state: Any
  data_state: dict
  meta: dict
  path: str


@dataclasses.dataclass
class SaveTiming:
  step: int
  blocking_s: float  # time the training loop was stopped
  device_to_host_s: float | None = None  # the part of it Orbax's save call took (a synchronous save also waits for the rest)
  save_s: float | None = None  # start of the save to the checkpoint being complete on disk
  manifest_s: float | None = None  # writing the manifest (checksumming every file), part of save_s
  num_bytes: int | None = None  # the step's size on disk


def _param_shapes(state) -> dict[str, list[int]]:
  return {param_name(path): list(leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)}


def _opt_state_paths(state) -> list[str]:
  """The optimizer state's structure, leaf by leaf: another optimizer (or optimizer layout) differs here."""
  return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(state.opt_state)]


def check_writable(directory: Path) -> None:
  """Fails before any compute when the checkpoint directory cannot be written."""
  require_writable_dir(directory, f"checkpoint.dir={directory}")


def make_private(directory: Path) -> None:
  """Files under `directory` readable by their owner only: the meta item holds the (redacted) config.
  Orbax creates them with the process umask; they are closed once the save is complete."""
  for path in directory.rglob("*"):
    if path.is_file():
      path.chmod(0o600)


def _optimizer_mismatch(path: Path, meta: dict) -> UserError:
  saved = config_lib.saved_config(meta, f"checkpoint {path}")["optimizer"]
  return UserError(f"checkpoint {path} holds the state of another optimizer (saved with optimizer.name="
                   f"{saved['name']}, state_dtype={saved['state_dtype']}): its optimizer state does "
                   "not fit this run's. Resume with the optimizer config it was saved with "
                   f"(--config.optimizer.name={saved['name']}), or start a new run in another output_dir.")


class Checkpointer:
  """Owns the Orbax CheckpointManager of one run.

  `location` is a local path, or an s3:// URL: then checkpoints are staged in `staging` and
  mirrored to object storage in the background (`maxtrain.remote`).
  """

  def __init__(self, ckpt_cfg: ml_collections.ConfigDict, location: str, staging: Path | None = None,
               on_progress: Callable[[], None] | None = None, lock: bool = False):
    """`lock`: hold the checkpoint directory for the life of this object (the trainer's process 0 does; an
    s3:// one also by a lease object there), so that two runs never save into one directory."""
    self.cfg = ckpt_cfg
    self._locks: list[Any] = []
    self.remote = None
    if location.startswith("s3://"):
      from maxtrain.checkpoint.remote import S3Mirror

      self.remote = S3Mirror(location, ckpt_cfg.s3_connect_timeout_s, ckpt_cfg.s3_read_timeout_s,
                             ckpt_cfg.s3_max_attempts, on_progress)
      directory = staging if staging is not None else Path("checkpoints")
    elif "://" in location:
      raise UserError(f"checkpoint.dir={location}: only local paths and s3:// URLs are supported")
    else:
      directory = Path(location)
    self.location = location
    self.directory = directory.absolute()  # Orbax refuses relative paths (the default output_dir is one)
    directory = self.directory
    check_writable(directory)
    if lock:  # before Orbax looks at the directory: a second run leaves the first one's saves alone
      self._take_locks()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=ckpt_cfg.max_to_keep if ckpt_cfg.max_to_keep > 0 else None,
        keep_period=ckpt_cfg.keep_every if ckpt_cfg.keep_every > 0 else None,
        enable_async_checkpointing=ckpt_cfg.async_save,
        create=True,
    )
    self._manager = ocp.CheckpointManager(directory, options=options)
    self._pending: SaveTiming | None = None
    self._done: list[SaveTiming] = []
    self._pending_t0 = 0.0
    self.last_error: Exception | None = None
    self.failed_step: int | None = None
    self._verified: set[Path] = set()
    # (abstract state, shardings) of the run: a step without a manifest is checked by restoring it onto them
    # (`verify`), and that restore is kept for `restore` (read once).
    self.target: tuple[Any, Any] | None = None
    self._prefetched: dict[Path, Restored] = {}

  def _take_locks(self) -> None:
    from maxtrain.runtime.lock import RunLock

    self._locks.append(RunLock(self.directory, "checkpoint.dir").acquire())
    if self.remote is not None:
      try:
        self._locks.append(self.remote.lease())
      except BaseException:
        self.release_locks()
        raise

  def release_locks(self) -> None:
    while self._locks:
      self._locks.pop().release()

  # ---- resume -------------------------------------------------------------------------------

  def steps(self) -> list[int]:
    """Complete checkpoints, local and (if mirrored) remote."""
    local = set(self._manager.all_steps())
    return sorted(local | set(self.remote.complete_steps() if self.remote else ()))

  def local_path(self, step: int) -> Path:
    """The local directory of a complete step, downloading it first if only the mirror has it."""
    path = self.directory / str(step)
    if step not in self._manager.all_steps():
      t0 = time.monotonic()
      self.remote.download(step, path)
      self._manager.reload()
      log.info("downloaded checkpoint step %d from %s in %.2fs", step, self.location, time.monotonic() - t0)
    return path

  def check_step_dirs(self) -> None:
    """Before the steps are listed: a symlinked step directory is refused (rotation would delete through
    it, its manifest would land in another run's directory); a numeric directory without the finished
    items (empty, or copied in part) is an incomplete step: moved aside with a warning, never restored."""
    for path in sorted(self.directory.iterdir()) if self.directory.is_dir() else ():
      if not path.name.isdigit():
        continue
      if path.is_symlink():
        raise UserError(f"checkpoint.dir={self.location}: step directory {path.name} is a symlink (to "
                        f"{os.readlink(path)}); rotation and manifests need real step directories: replace it "
                        f"with a copy (cp -r) or remove it")
      if path.is_dir() and not all((path / item).is_dir() for item in ITEMS):
        moved = manifest.move_aside(path, "incomplete") if jax.process_index() == 0 else path
        log.warning("checkpoint step directory %s is incomplete (no finished state/meta/data items): skipped, "
                    "moved aside to %s", path, moved)
    self._manager.reload()

  def resolve_resume(self, on_corrupt: Callable[[int, manifest.CorruptCheckpoint, Path], None] | None = None,
                     on_branch: Callable[[int, list[int], list[Path]], None] | None = None) -> Path | None:
    """The checkpoint to restore per `checkpoint.resume`, or None for a fresh start. Verified against
    its manifest (`checkpoint.verify`): with `auto`, corrupt steps newer than the newest good one are
    moved aside and reported through `on_corrupt(step, error, new_path)`; when none verifies it is a
    UserError unless `checkpoint.start_over_if_corrupt`. An explicit step while newer ones exist is a
    UserError unless `checkpoint.branch` (then they are moved aside: `on_branch(step, newer, moved)`)."""
    self.check_step_dirs()
    resume = str(self.cfg.resume)
    steps = self.steps()
    if resume == "auto":
      return self._resume_newest_good(steps, on_corrupt)
    if resume == "never":
      if steps:
        raise UserError(
            f"checkpoint.resume=never but {self.location} already holds checkpoints at steps {steps}; "
            "a fresh run must not overwrite them. Use another output_dir/checkpoint.dir, or resume=auto.")
      return None
    if resume.isdigit():
      if int(resume) not in steps:
        raise UserError(f"checkpoint.resume={resume}: no complete checkpoint at step {resume} in "
                        f"{self.location}; found steps {steps or 'none'}")
      path = self.local_path(int(resume))
      self.verify(path)  # a CorruptCheckpoint is a UserError: exit 2, naming the file
      self._branch(int(resume), [s for s in steps if s > int(resume)], on_branch)
      return path
    path = Path(resume).absolute()
    if not path.is_dir():
      raise UserError(f"checkpoint.resume={resume!r}: not 'auto', 'never', a step number, nor an existing "
                      "checkpoint directory")
    if not ocp.step.is_checkpoint_finalized(path) or not (path / "state").is_dir():
      raise UserError(f"checkpoint.resume={resume!r}: not a complete maxtrain checkpoint (it has no finished "
                      "'state' item; an interrupted save is never restored)")
    self.verify(path)
    return path

  def _resume_newest_good(self, steps: list[int], on_corrupt) -> Path | None:
    """The newest step that verifies; the corrupt ones above it moved aside. None verifying is exit 2 (nothing
    moved, so a rerun says the same) unless `start_over_if_corrupt`: then all are moved aside."""
    good, corrupt = self.newest_good(steps)
    if good is None and corrupt and not self.cfg.start_over_if_corrupt:
      raise UserError(f"checkpoint.dir={self.location}: no checkpoint verifies (steps {[s for s, _ in corrupt]}; "
                      f"newest: {corrupt[0][1]}). Nothing was moved or trained. Restore the files, resume a "
                      "step explicitly after checking it, or set checkpoint.start_over_if_corrupt=True to move "
                      "them aside and train from step 0.")
    for step, error in corrupt:
      moved = self.move_aside(step)
      log.error("%s; moved aside to %s%s", error, moved, "" if good else " (checkpoint.start_over_if_corrupt)")
      if on_corrupt is not None:
        on_corrupt(step, error, moved)
    return good

  def newest_good(self, steps: list[int]) -> tuple[Path | None, list[tuple[int, manifest.CorruptCheckpoint]]]:
    """(the newest of `steps` that verifies or None, [(step, error)] of the corrupt ones above it), newest
    first. Nothing is moved."""
    corrupt = []
    for step in reversed(steps):
      path = self.local_path(step)
      try:
        self.verify(path)
        return path, corrupt
      except manifest.CorruptCheckpoint as e:
        corrupt.append((step, e))
    return None, corrupt

  def _branch(self, step: int, newer: list[int], on_branch) -> None:
    if not newer:
      return
    if not self.cfg.branch:
      raise UserError(f"checkpoint.resume={step} but {self.location} holds newer steps {newer}: continuing from "
                      f"step {step} would train over them (and resume=auto would pick them up later). Use "
                      f"resume=auto to continue from step {newer[-1]}, or set checkpoint.branch=True to move the "
                      f"newer steps aside (renamed, not deleted) and continue from step {step}.")
    if self.remote is not None:
      raise UserError(f"checkpoint.branch=True with checkpoint.dir={self.location}: branching an s3:// "
                      "checkpoint directory is not supported; copy the step to a new checkpoint.dir instead")
    moved = [self.move_aside(s, "branched") for s in newer]
    log.warning("checkpoint.branch: resuming step %d; newer steps %s moved aside to %s", step, newer,
                [str(m) for m in moved])
    if on_branch is not None:
      on_branch(step, newer, moved)

  def move_aside(self, step: int, why: str = "corrupt") -> Path:
    """Renames a step directory out of Orbax's sight (process 0; nothing is deleted)."""
    path = self.directory / str(step)
    moved = manifest.move_aside(path, why) if jax.process_index() == 0 else path
    self._manager.reload()
    return moved

  def abandon_after(self, step: int) -> list[tuple[int, list[str]]]:
    """A restore to `step` (a rollback, a resume from an older tier) abandons the newer steps: they belong to
    a timeline this run no longer follows, and resume=auto must never take one (nor a save of the same step
    number on the new timeline be skipped as "already saved"). Process 0 moves each aside, locally and in
    object storage, to `<step>.abandoned-<time>` (nothing is deleted); [(step, [new places])]. The other
    processes must reload after it (`reload`)."""
    self._wait_pending()
    remote = set()
    if self.remote is not None:
      self.remote.cancel_after(step)  # an upload of a newer step in flight must not complete after the move
      remote = set(self.remote.complete_steps())
    moved = []
    for newer in [s for s in self.steps() if s > step]:
      places = []
      if (self.directory / str(newer)).is_dir():
        places.append(str(self.move_aside(newer, "abandoned")))
      if newer in remote and jax.process_index() == 0:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        name = Path(places[0]).name if places else f"{newer}.abandoned-{stamp}"
        places.append(self.remote.move_aside(newer, name))
      moved.append((newer, places))
    return moved

  def reload(self) -> None:
    self._manager.reload()

  def verify(self, path: Path) -> None:
    """Checks a step against its manifest once per process (`checkpoint.verify`): every read of a checkpoint
    (resume, rollback, the tools through interop/sources.py) goes through `manifest.check`."""
    if not self.cfg.verify or Path(path) in self._verified:
      return
    if not manifest.check(path).verified and self.target is not None:
      self._read_unverified(Path(path))
    self._verified.add(Path(path))

  def _read_unverified(self, path: Path) -> None:
    """A step without a manifest (saved before manifests, or its process died before writing one) has nothing
    to be checked against: it is restored now, onto this run's devices, and kept for `restore`. A step that does
    not restore is corrupt like one that fails its manifest: resume=auto moves it aside and tries an older one,
    an explicit resume of it is exit 2 naming it."""
    # Orbax's other reads of a failed restore end unawaited (each an "Exception ignored" traceback on stderr):
    # the error is reported once, below.
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
      self._prefetched[path] = self._restore_unchecked(path, *self.target)
    except UserError:
      raise
    except Exception as e:  # noqa: BLE001 - whatever the damage (a missing, truncated or changed file), it is corrupt
      chain, cause = [], e  # Orbax wraps TensorStore's error, which names the array that did not read
      while cause is not None and len(chain) < 8:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
      e = next((c for c in chain if re.search(r'Error reading "([^"]+)"', str(c))), e)
      text = str(e).strip()
      culprit = re.search(r'Error reading "([^"]+)"', text)
      name = f"state/{culprit.group(1)}" if culprit else "state"
      raise manifest.CorruptCheckpoint(path, name, "no manifest, and it does not restore: "
                                       f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}") from None
    finally:
      gc.collect()
      sys.unraisablehook = hook

  def forget_prefetched(self) -> None:
    """Another step is restored instead (the local tier's): its device memory is released."""
    self._prefetched.clear()

  @staticmethod
  def read_meta(path: Path) -> dict:
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    return checkpointer.restore(path, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def restore(self, path: Path, abstract_state: Any, shardings: Any) -> Restored:
    """Verifies (once), then restores onto the current mesh (resharding if it was saved on another)."""
    self.verify(path)
    prefetched = self._prefetched.pop(Path(path), None)
    return prefetched if prefetched is not None else self._restore_unchecked(path, abstract_state, shardings)

  def _restore_unchecked(self, path: Path, abstract_state: Any, shardings: Any) -> Restored:
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    meta = self.read_meta(path)
    self._check_compatible(path, meta, abstract_state)
    target = with_shardings(abstract_state, shardings)
    try:
      restored = checkpointer.restore(path, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
    except ValueError as e:  # a checkpoint from before opt_state_paths were saved, another optimizer
      if "tree structure" not in str(e).lower() and "do not match" not in str(e).lower():
        raise
      raise _optimizer_mismatch(path, meta) from None
    step = int(restored.state.step)
    return Restored(step=step, state=restored.state, data_state=restored.data, meta=meta, path=str(path))

  @staticmethod
  def _check_compatible(path: Path, meta: dict, abstract_state: Any) -> None:
    """UserError naming what differs. The parameters first: a model of another shape (MoE vs dense) also
    has another optimizer state, and the model is the cause."""
    saved_cfg = config_lib.saved_config(meta, f"checkpoint {path}")
    saved, current = meta.get("param_shapes", {}), _param_shapes(abstract_state)
    diffs = [f"{k}: checkpoint {saved.get(k)} vs model {current.get(k)}"
             for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
    if diffs:
      raise UserError(f"checkpoint {path} does not fit this model ({len(diffs)} parameters differ; "
                      f"{'; '.join(diffs[:4])}). Restore it with the model config it was saved with "
                      f"(its config.model: {json.dumps(saved_cfg['model'])}).")
    saved_opt = meta.get("opt_state_paths")
    if saved_opt is not None and saved_opt != _opt_state_paths(abstract_state):
      raise _optimizer_mismatch(path, meta)
    window = saved_cfg["guards"]["spike_window"]
    mine = int(abstract_state.guard.losses.shape[0])
    if int(window) != mine:  # the guard's loss window is part of the saved state
      raise UserError(f"guards.spike_window={mine} but checkpoint {path} was saved with guards.spike_window={window} "
                      f"(the spike guard's loss window is saved with the state): resume with "
                      f"--config.guards.spike_window={window}, or start a new run in another output_dir.")

  # ---- save ---------------------------------------------------------------------------------

  def should_save(self, step: int) -> bool:
    every = self.cfg.every_steps
    return every > 0 and step % every == 0

  def save(self, step: int, state: Any, data_state: dict, cfg: ml_collections.ConfigDict,
           mesh_shape: dict, extra_meta: dict | None = None) -> SaveTiming | None:
    """Starts a save; returns its timing, or None if it failed (logged, the run goes on)."""
    if step in self._manager.all_steps():
      return None  # already saved (e.g. the final step coincides with a periodic save)
    meta = {"config": config_lib.redacted(cfg), "mesh": mesh_shape, "version": maxtrain.__version__,
            "param_shapes": _param_shapes(state),
            "opt_state_paths": _opt_state_paths(state), "wall_time": time.time(), "step": step, **(extra_meta or {})}
    self._wait_pending()  # one save in flight at a time; also surfaces an error of the previous one
    t0 = time.monotonic()
    try:
      self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta)))
    except Exception as e:  # noqa: BLE001 - a failed save must not kill training; the last good one stays
      self._failed(step, e)
      return None
    timing = SaveTiming(step=step, blocking_s=time.monotonic() - t0, device_to_host_s=time.monotonic() - t0)
    self._pending, self._pending_t0 = timing, t0
    return timing

  def _failed(self, step: int, error: Exception) -> None:
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
    except Exception as e:  # noqa: BLE001 - see save()
      self._failed(done.step, e)
      return
    if jax.process_index() == 0:
      try:  # written last: a step without its manifest was never completely saved (or predates them)
        make_private(self.directory / str(done.step) / "meta")
        t0 = time.monotonic()
        manifest.write(self.directory / str(done.step))
        done.manifest_s = time.monotonic() - t0
        done.num_bytes = sum(p.stat().st_size for p in (self.directory / str(done.step)).rglob("*") if p.is_file())
      except Exception as e:  # noqa: BLE001 - see save()
        self._failed(done.step, e)
        return
    done.save_s = time.monotonic() - self._pending_t0
    if self.remote is not None:
      self.remote.upload(self.directory / str(done.step), done.step, keep=list(self._manager.all_steps()))
    self._done.append(done)

  def poll(self) -> list[SaveTiming]:
    """Timings of the saves completed since the last call (failures are logged and kept in
    `last_error` / `failed_step` instead)."""
    self._collect()
    done, self._done = self._done, []
    return done

  def _wait_pending(self) -> None:
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - see save()
      if self._pending is not None:
        self._failed(self._pending.step, e)
        self._pending = None
    self._collect()

  def wait(self) -> list[SaveTiming]:
    """Blocks until the save in flight (if any) is complete; returns like poll()."""
    self._wait_pending()
    return self.poll()

  def close(self) -> None:
    """Waits for the last save (and its upload) to be complete."""
    try:
      self._wait_pending()
      self._manager.close()
      if self.remote is not None:
        t0 = time.monotonic()
        self.remote.close()
        log.info("uploads to %s finished %.2fs after the end of training", self.location, time.monotonic() - t0)
    finally:
      self.release_locks()  # last: the directory is ours until the last save is complete
