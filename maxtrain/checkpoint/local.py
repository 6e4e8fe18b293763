"""The local checkpoint tier: each process saves its own shards to node-local disk (`checkpoint.local_dir`).

Why not Orbax here: an Orbax checkpoint of a sharded state is one directory that every process writes
into and process 0 finalises, so it needs a filesystem all processes share. A node-local tier has none:
each process writes `<local_dir>/process_<i>/<step>/` holding only the arrays its devices hold
(`state.bin`, raw bytes, and `index.json` naming each shard's leaf and slice), the data-iterator state
and meta, then the manifest (maxtrain/checkpoint/manifest.py), and renames the directory into place last.
A step is complete on a process once that rename happened; whether every process has it is agreed at
resume (checkpoint/tiers.py). Restoring puts each saved shard back on the device that holds that slice
under the current sharding: bitwise, and only onto the same layout (another mesh or process count makes
the local tier unusable, and resume falls back to the durable tier).

Per save, the loop blocks only for the device-to-host copy; serialisation, the write (fsynced), the
manifest and the rotation run on one background thread, each phase timed (`LocalSave.phases`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from maxtrain.checkpoint import manifest

log = logging.getLogger("maxtrain")
STATE_FILE, INDEX_FILE, META_FILE, DATA_FILE = "state.bin", "index.json", "meta.json", "data.json"
_TMP = ".tmp-"


class LocalUnusable(Exception):
  """A local step that this run cannot restore (another layout, a missing shard): not corrupt, just not ours."""


@dataclasses.dataclass
class LocalSave:
  step: int
  blocking_s: float  # the loop stopped: device-to-host copy of this process's shards
  num_bytes: int = 0
  phases: dict[str, float] = dataclasses.field(default_factory=dict)  # serialise_s, write_s, manifest_s
  save_s: float | None = None  # start of the save to the step being renamed into place
  error: Exception | None = None


def _slices(index: tuple, shape: tuple[int, ...]) -> list[list[int]]:
  """A shard's index (a tuple of slices) as [[start, stop], ...]: comparable across processes and runs."""
  return [list(s.indices(n)[:2]) for s, n in zip(index, shape)]


def _host_shards(state: Any) -> list[tuple[str, list[list[int]], np.ndarray]]:
  """(leaf path, slice, host copy) of every distinct shard this process holds. A copy: the next step
  donates the device buffers the save would otherwise still read."""
  out = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    name, seen = jax.tree_util.keystr(path), set()
    for shard in leaf.addressable_shards:
      where = _slices(shard.index, leaf.shape)
      if str(where) in seen:
        continue  # a replica of a slice already taken
      seen.add(str(where))
      out.append((name, where, np.array(shard.data, copy=True)))
  return out


class LocalTier:
  """This process's node-local checkpoints: `<local_dir>/process_<i>/<step>`, the newest `keep` kept."""

  def __init__(self, local_dir: str, process_index: int, keep: int):
    self.root = Path(local_dir).absolute() / f"process_{process_index}"
    self.root.mkdir(parents=True, exist_ok=True)
    self.keep = max(1, keep)
    # One long-lived writer: a thread started per save costs the loop its start-up handshake (tens of ms
    # measured on a loaded 2-core machine, where the new thread waits for the GIL and a core).
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-local")
    self._future: concurrent.futures.Future | None = None
    self._pending: LocalSave | None = None
    self._done: list[LocalSave] = []
    self._lock = threading.Lock()

  # ---- save -------------------------------------------------------------------------------

  def save(self, step: int, state: Any, data_state: dict, meta: dict) -> LocalSave:
    """Copies this process's shards to host memory (the loop blocks for this), then writes them on a
    background thread. One save in flight: a new one first waits for the previous one."""
    if self._future is not None:  # its record stays for the next poll
      self._future.result()
      self._future = None
    t0 = time.monotonic()
    shards = _host_shards(state)
    save = LocalSave(step=step, blocking_s=time.monotonic() - t0, num_bytes=sum(a.nbytes for _, _, a in shards))
    self._pending = save
    self._future = self._pool.submit(self._write, save, shards, data_state, meta, t0)
    return save

  def _write(self, save: LocalSave, shards: list, data_state: dict, meta: dict, t0: float) -> None:
    final = self.root / str(save.step)
    tmp = self.root / f"{_TMP}{save.step}"
    try:
      shutil.rmtree(tmp, ignore_errors=True)
      tmp.mkdir()
      t = time.monotonic()
      index, offset = [], 0
      for name, where, array in shards:
        index.append({"leaf": name, "slice": where, "dtype": array.dtype.name, "shape": list(array.shape),
                      "offset": offset, "nbytes": array.nbytes})
        offset += array.nbytes
      payload = json.dumps({"shards": index}).encode()
      save.phases["serialise_s"] = time.monotonic() - t
      t = time.monotonic()
      with open(tmp / STATE_FILE, "wb") as f:
        for _, _, array in shards:
          f.write(memoryview(np.ascontiguousarray(array)).cast("B"))
        f.flush()
        os.fsync(f.fileno())
      for name, body in ((INDEX_FILE, payload), (META_FILE, json.dumps(meta, default=str).encode()),
                         (DATA_FILE, json.dumps(data_state).encode())):
        (tmp / name).write_bytes(body)
      save.phases["write_s"] = time.monotonic() - t
      t = time.monotonic()
      manifest.write(tmp)
      if final.exists():
        shutil.rmtree(final)  # a step saved again (after a restart): the new one replaces it
      os.rename(tmp, final)  # the step exists only once it is complete
      save.phases["manifest_s"] = time.monotonic() - t
      self._rotate()
      save.save_s = time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - a failed local save must not stop training; the durable tier stays
      save.error = e
      shutil.rmtree(tmp, ignore_errors=True)
    with self._lock:
      self._done.append(save)

  def _rotate(self) -> None:
    for step in self.steps()[:-self.keep]:
      shutil.rmtree(self.root / str(step), ignore_errors=True)

  def wait(self) -> list[LocalSave]:
    if self._future is not None:
      self._future.result()
      self._future = None
    return self.poll()

  def close(self) -> None:
    self.wait()
    self._pool.shutdown()

  def poll(self) -> list[LocalSave]:
    with self._lock:
      done, self._done = self._done, []
    if self._pending is not None and self._pending in done:
      self._pending = None
    return done

  # ---- resume -----------------------------------------------------------------------------

  def drop_after(self, step: int) -> list[int]:
    """Deletes this process's local steps newer than `step`, which a resume or a rollback to `step` abandoned:
    a later resume must not take a step of the abandoned run. Returns them."""
    self.wait()
    stale = [s for s in self.steps() if s > step]
    for s in stale:
      shutil.rmtree(self.path(s), ignore_errors=True)
    return stale

  def steps(self) -> list[int]:
    """Steps renamed into place (complete on this process; not yet verified)."""
    if not self.root.is_dir():
      return []
    return sorted(int(p.name) for p in self.root.iterdir() if p.name.isdigit() and p.is_dir())

  def path(self, step: int) -> Path:
    return self.root / str(step)

  def usable_steps(self, mesh_shape: dict, process_count: int, verify: bool) -> tuple[list[int], dict[int, str]]:
    """(steps this process could restore, {step: why not} for the others): verified against the manifest
    and saved on this layout. A corrupt step is moved aside (this tier is the process's own)."""
    good, why = [], {}
    for step in self.steps():
      path = self.path(step)
      try:
        if verify:
          manifest.check(path)
        meta = self.read_meta(path)
      except manifest.CorruptCheckpoint as e:
        why[step] = f"corrupt ({e.first_bad_file}: {e.reason}); moved aside to {manifest.move_aside(path)}"
        continue
      except (OSError, ValueError) as e:
        why[step] = f"unreadable ({e})"
        continue
      if meta.get("mesh") != mesh_shape or meta.get("process_count") != process_count:
        why[step] = (f"saved on mesh {meta.get('mesh')} x {meta.get('process_count')} processes, this run is "
                     f"{mesh_shape} x {process_count}")
        continue
      good.append(step)
    return good, why

  @staticmethod
  def read_meta(path: Path) -> dict:
    return json.loads((Path(path) / META_FILE).read_text())

  @staticmethod
  def restore(path: Path, abstract_state: Any, shardings: Any) -> tuple[Any, dict]:
    """(state on this run's devices, data-iterator state). LocalUnusable when a slice this process's
    devices hold under `shardings` was not saved here."""
    path = Path(path)
    index = json.loads((path / INDEX_FILE).read_text())["shards"]
    blob = np.memmap(path / STATE_FILE, dtype=np.uint8, mode="r")
    saved: dict[tuple[str, str], dict] = {(e["leaf"], str(e["slice"])): e for e in index}
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    leaves = []
    for (key_path, leaf), sharding in zip(flat, jax.tree_util.tree_leaves(shardings)):
      name, arrays = jax.tree_util.keystr(key_path), []
      for device, where in sharding.addressable_devices_indices_map(leaf.shape).items():
        entry = saved.get((name, str(_slices(where, leaf.shape))))
        if entry is None:
          raise LocalUnusable(f"{path}: no saved shard of {name} at {_slices(where, leaf.shape)}")
        data = blob[entry["offset"]: entry["offset"] + entry["nbytes"]].view(jax.numpy.dtype(entry["dtype"]))
        # a copy: never alias the file; in the sharding's memory (host for an offloaded optimizer state)
        where_to = jax.sharding.SingleDeviceSharding(device, memory_kind=sharding.memory_kind)
        arrays.append(jax.device_put(np.array(data.reshape(entry["shape"])), where_to))
      leaves.append(jax.make_array_from_single_device_arrays(leaf.shape, sharding, arrays))
    state = jax.tree_util.tree_unflatten(treedef, leaves)
    return state, json.loads((path / DATA_FILE).read_text())
