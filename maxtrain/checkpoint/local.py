"""The local checkpoint tier: each process saves its own shards to node-local disk (`checkpoint.local_dir`).

Why not Orbax here: an Orbax checkpoint of a sharded state is one directory that every process writes
into and process 0 finalises, so it needs a filesystem all processes share. A node-local tier has none:
each process writes `<local_dir>/process_<i>/<step>/` holding only the arrays its devices hold
(`state.bin`, raw bytes, and `index.json` naming each shard's leaf and slice), the data-iterator state
and meta, then the manifest (maxtrain/checkpoint/manifest.py), and renames the directory into place last.
A step is complete on a process once that rename happened; whether every process has it is agreed at
resume (checkpoint/resume.py, by policy.choose). Restoring puts each saved shard back on the device that holds that slice
under the current sharding: bitwise, and only onto the same layout (another mesh or process count makes
the local tier unusable, and resume falls back to the durable tier).

Per save, the loop blocks only for the device-to-host copy; serialisation, the write (fsynced), the
manifest and the rotation run on one background thread, each phase timed (local_write.py).

The tier follows the durable tier's rules, although one folder may outlive many runs (one fixed folder per
node): each step's meta carries the identity of the run that saved it (output and checkpoint dirs, a hash of
the config that shapes its state), and a run uses, rotates and deletes only its own steps (another run's are
left alone, and a step number this run saves again is moved aside from under them); each process directory
has one writer (`.maxtrain.lock`, taken before the first write); a step without a manifest was never
complete (the manifest is written before the rename) and counts as corrupt.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

from maxtrain.checkpoint import manifest
from maxtrain.checkpoint.local_write import (DATA_FILE, INDEX_FILE, META_FILE, STATE_FILE, LocalSave, LocalWriter,
                                             _slices, clean_leftovers)
from maxtrain.checkpoint.tiers import Restored, saved_step
from maxtrain.errors import UserError, require_writable_dir
from maxtrain.runtime.lock import RunLock

log = logging.getLogger("maxtrain")
IDENTITY_DIRS = ("output_dir", "checkpoint_dir")  # which run a step belongs to; config_hash: under which config
OWN, FOREIGN, UNKNOWN = "own", "foreign", "unknown"


class LocalUnusable(Exception):
  """A local step that this run cannot restore (another layout, a missing shard): not corrupt, just not ours."""


@dataclasses.dataclass
class Scan:
  """This process's local steps, sorted out for a resume."""
  usable: list[int]  # this run's, verified (or not checked: verify=False), on this layout
  corrupt: dict[int, manifest.CorruptCheckpoint]  # this run's (or of no readable owner) and damaged: nothing moved yet
  skipped: dict[int, str]  # why not: another run's, another config, another layout
  intact: list[int]  # this run's steps that verified (usable or not here): not a case of all-corrupt


def read_meta(path: Path) -> dict:
  return json.loads((Path(path) / META_FILE).read_text())


class LocalSteps:
  """The steps in one process directory and whose they are: this run's (its `identity`'s output and checkpoint
  dirs) are the ones it may rotate (the newest `keep` stay; 0: all), abandon and branch from."""

  def __init__(self, root: Path, identity: dict[str, str], keep: int):
    self.root, self.identity, self.keep = root, identity, keep
    self._owners: dict[int, str] = {}  # step -> OWN / FOREIGN / UNKNOWN, read from its meta once

  def all(self) -> list[int]:
    """Steps renamed into place (complete; not yet verified; any run's)."""
    if not self.root.is_dir():
      return []
    return sorted(int(p.name) for p in self.root.iterdir() if p.name.isdigit() and (p.is_dir() or p.is_symlink()))

  def own(self) -> list[int]:
    return [s for s in self.all() if self.owner(s) == OWN]

  def owner(self, step: int) -> str:
    """OWN (this run's output and checkpoint dirs), FOREIGN (another run's, or saved before steps carried an
    identity), UNKNOWN (no readable meta: damaged)."""
    if step not in self._owners:
      try:
        identity = read_meta(self.root / str(step)).get("identity")
      except (OSError, ValueError, AttributeError):
        return UNKNOWN  # not cached: a step being written reads the same
      mine = isinstance(identity, dict) and all(identity.get(k) == self.identity[k] for k in IDENTITY_DIRS)
      self._owners[step] = OWN if mine else FOREIGN
    return self._owners[step]

  def describe_owner(self, step: int) -> str:
    try:
      identity = read_meta(self.root / str(step)).get("identity")
    except (OSError, ValueError, AttributeError):
      return "no readable meta"
    if not isinstance(identity, dict):
      return "saved before local steps carried their run's identity"
    return f"output_dir {identity.get('output_dir')}, checkpoint.dir {identity.get('checkpoint_dir')}"

  def make_room(self, step: int) -> None:
    """Before a save of `step` is renamed into place: this run's old step of that number is replaced; another
    run's is never deleted (it may come back for it), only moved aside."""
    final = self.root / str(step)
    if final.exists() or final.is_symlink():
      if self.owner(step) == OWN and not final.is_symlink():
        shutil.rmtree(final)  # a step saved again (after a restart): the new one replaces it
      else:
        moved = manifest.move_aside(final, "other-run")
        log.warning("local checkpoint %s is not this run's: moved aside to %s to save step %d", final, moved, step)

  def placed(self, step: int) -> None:
    """A save of `step` renamed into place: ours; then this run's newest `keep` steps stay (another run's are not
    ours to delete)."""
    self._owners[step] = OWN
    if self.keep > 0:
      for old in self.own()[:-self.keep]:
        self.remove(old)

  def remove(self, step: int) -> None:
    shutil.rmtree(self.root / str(step), ignore_errors=True)
    self._owners.pop(step, None)

  def forget(self, step: int) -> None:
    self._owners.pop(step, None)


class LocalTier:
  """This process's node-local checkpoints, `<local_dir>/process_<i>/<step>` (a tiers.Tier). `identity`: this run's
  output_dir, checkpoint_dir and config_hash, saved in every step's meta."""

  def __init__(self, local_dir: str, process_index: int, keep: int, identity: dict[str, str]):
    self.key = f"checkpoint.local_dir={local_dir}"
    self.root = Path(local_dir).absolute() / f"process_{process_index}"
    # Exit 2 naming the key (under a regular file, in /proc, read-only), before any compute.
    require_writable_dir(self.root, self.key, "choose a node-local directory this process can create and write, "
                         "e.g. --config.checkpoint.local_dir=/tmp/maxtrain-local")
    self._run_lock = RunLock(self.root, "checkpoint.local_dir").acquire()  # before the first write into it
    self.identity = dict(identity)
    self.owned = LocalSteps(self.root, self.identity, keep)
    try:
      clean_leftovers(self.root)
    except BaseException:
      self._run_lock.release()
      raise
    self._writer = LocalWriter(self.root, self.owned.make_room, self.owned.placed)

  def save(self, step: int, state: Any, data_state: dict, meta: dict) -> LocalSave:
    """Copies this process's shards to host memory (the loop blocks for this), then writes them on a
    background thread. One save in flight: a new one first waits for the previous one."""
    return self._writer.save(step, state, data_state, meta)

  def poll(self) -> list[LocalSave]:
    return self._writer.poll()

  def wait(self) -> list[LocalSave]:
    return self._writer.wait()

  def close(self) -> None:
    try:
      self._writer.close()
    finally:
      self._run_lock.release()

  def steps(self) -> list[int]:
    """Steps renamed into place in this process's directory (complete; not yet verified; any run's)."""
    return self.owned.all()

  def own_steps(self) -> list[int]:
    """This run's steps: the ones it may rotate, abandon, branch from."""
    return self.owned.own()

  def path(self, step: int) -> Path:
    return self.root / str(step)

  def drop_after(self, step: int) -> list[int]:
    """Deletes this process's local steps newer than `step`, which a resume or a rollback to `step` abandoned:
    a later resume must not take a step of the abandoned run. Returns them."""
    self.wait()
    stale = [s for s in self.own_steps() if s > step]
    for s in stale:
      self.owned.remove(s)
    return stale

  def verify(self, path: Path) -> None:
    """Every local step is saved with a manifest (written before the rename): one without it was removed since,
    and an unverified step is never restored nor promoted."""
    result = manifest.verify(path)
    if not result.verified:
      raise manifest.CorruptCheckpoint(path, manifest.MANIFEST_NAME, "missing (every local step is saved with "
                                       "one; an unverified step is never restored nor promoted)")
    log.info("local checkpoint %s verified: %d files, %.1f MB in %.2fs", path, result.num_files,
             result.num_bytes / 1e6, result.seconds)

  def scan(self, mesh_shape: dict, process_count: int, verify: bool) -> Scan:
    """This process's steps sorted into usable, corrupt and skipped (nothing is moved: the caller decides,
    the same on every process). Another run's steps are not even verified: they are not ours to judge. A
    symlinked step directory is refused, as in the durable tier: rotation would delete through it."""
    for step in self.steps():
      if self.path(step).is_symlink():
        raise UserError(f"{self.key}: local step directory {self.path(step)} is a symlink (to "
                        f"{os.readlink(self.path(step))}); rotation and manifests need real step directories: "
                        "replace it with a copy (cp -r) or remove it")
    usable, corrupt, skipped, intact = [], {}, {}, []
    for step in self.steps():
      path, owner = self.path(step), self.owned.owner(step)
      if owner == FOREIGN:
        skipped[step] = f"another run's ({self.owned.describe_owner(step)}): left alone"
        continue
      try:
        if verify:
          self.verify(path)
        meta = self.read_meta(path)
        if owner == UNKNOWN or not isinstance(meta, dict):
          raise ValueError("not a JSON object")
      except manifest.CorruptCheckpoint as e:
        corrupt[step] = e
        continue
      except (OSError, ValueError) as e:
        corrupt[step] = manifest.CorruptCheckpoint(path, META_FILE, f"unreadable ({e})")
        continue
      intact.append(step)
      saved_hash = meta.get("identity", {}).get("config_hash")
      if saved_hash != self.identity["config_hash"]:
        skipped[step] = (f"saved under another config (hash {saved_hash}, this run's {self.identity['config_hash']}): "
                         "the local tier resumes only the run that saved it, unchanged; the durable tier restores "
                         "across config changes")
      elif meta.get("mesh") != mesh_shape or meta.get("process_count") != process_count:
        skipped[step] = (f"saved on mesh {meta.get('mesh')} x {meta.get('process_count')} processes, this run is "
                         f"{mesh_shape} x {process_count}")
      else:
        usable.append(step)
    return Scan(usable, corrupt, skipped, intact)

  def move_aside(self, step: int, why: str = "corrupt") -> Path:
    moved = manifest.move_aside(self.path(step), why)
    self.owned.forget(step)
    return moved

  @staticmethod
  def read_meta(path: Path) -> dict:
    return read_meta(path)

  @staticmethod
  def restore(path: Path, abstract_state: Any, shardings: Any) -> Restored:
    """The step on this run's devices (read_shards); its `step` is the one it was saved under (tiers.saved_step)."""
    state, data_state = read_shards(path, abstract_state, shardings)
    meta = read_meta(path)
    return Restored(step=saved_step(meta, path, state), state=state, data_state=data_state, meta=meta, path=str(path))


def read_shards(path: Path, abstract_state: Any, shardings: Any) -> tuple[Any, dict]:
  """(state on this run's devices, data-iterator state). LocalUnusable when a slice this process's
  devices hold under `shardings` was not saved here."""
  path = Path(path)
  culprit = INDEX_FILE
  try:  # the manifest was checked (checkpoint.verify); without it, damage is still exit 2, never a traceback
    index = json.loads((path / INDEX_FILE).read_text())["shards"]
    saved: dict[tuple[str, str], dict] = {(e["leaf"], str(e["slice"])): e for e in index}
    culprit = STATE_FILE
    size = (path / STATE_FILE).stat().st_size
    short = [e for e in index if e["offset"] + e["nbytes"] > size]
    if short:
      raise manifest.CorruptCheckpoint(path, STATE_FILE, f"{size} bytes, but its index needs "
                                       f"{max(e['offset'] + e['nbytes'] for e in index)} (truncated)")
    blob = np.memmap(path / STATE_FILE, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    culprit = DATA_FILE
    data_state = json.loads((path / DATA_FILE).read_text())
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise manifest.CorruptCheckpoint(path, culprit, f"unreadable ({type(e).__name__}: {e})") from None
  flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
  leaves = []
  for (key_path, leaf), sharding in zip(flat, jax.tree_util.tree_leaves(shardings)):
    name, arrays = jax.tree_util.keystr(key_path), []
    for device, where in sharding.addressable_devices_indices_map(leaf.shape).items():
      entry = saved.get((name, str(_slices(where, leaf.shape))))
      if entry is None:
        raise LocalUnusable(f"{path}: no saved shard of {name} at {_slices(where, leaf.shape)}")
      try:
        data = blob[entry["offset"]: entry["offset"] + entry["nbytes"]].view(jax.numpy.dtype(entry["dtype"]))
        data = np.array(data.reshape(entry["shape"]))  # a copy: never alias the file
      except (ValueError, TypeError, KeyError) as e:  # an index that does not fit its data
        raise manifest.CorruptCheckpoint(path, INDEX_FILE, f"entry of {name} unusable ({e})") from None
      # In the sharding's memory (host for an offloaded optimizer state).
      arrays.append(jax.device_put(data, jax.sharding.SingleDeviceSharding(device, memory_kind=sharding.memory_kind)))
    leaves.append(jax.make_array_from_single_device_arrays(leaf.shape, sharding, arrays))
  state = jax.tree_util.tree_unflatten(treedef, leaves)
  return state, data_state
