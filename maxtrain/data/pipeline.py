"""Grain input pipeline: packed, document-aware windows over a token store.

The store is one concatenated token stream (documents end with EOS). Example
`i` is the window `tokens[i*L : i*L + L + 1]`, so any example is found in
O(log num_docs) with no pre-scan, and no token is padding. Each example is

  inputs, targets  window[:-1], window[1:]                      int32 [L]
  segment_ids      1 + index of the input's document in the window  int32 [L]
                   (attention must not cross segments)
  positions        the input's position within its own document   int32 [L]
  loss_mask        1 where the target belongs to the input's doc  float32 [L]

Every batch's ids are checked on the host before it leaves for the device
(`check_batch_ids`: one max over the batch): the .bin can change after it was
indexed, and an id past the embedding table is a NaN run, not an error, on
the device.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Callable

import grain
import jax
import numpy as np

from maxtrain.data.store import TokenStore
from maxtrain.errors import UserError

KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
DTYPES = {"inputs": np.int32, "targets": np.int32, "segment_ids": np.int32, "positions": np.int32,
          "loss_mask": np.float32}  # of every [batch, seq_len] array pack_window makes


def pack_window(tokens: np.ndarray, offsets: np.ndarray, start: int,
                seq_len: int) -> dict[str, np.ndarray]:
  """Builds one example from `tokens[start : start + seq_len + 1]`."""
  end = start + seq_len + 1
  window = np.asarray(tokens[start:end], dtype=np.int32)
  # Only the offsets of documents overlapping the window are read.
  first = int(np.searchsorted(offsets, start, side="right")) - 1
  last = int(np.searchsorted(offsets, end - 1, side="right")) - 1
  bounds = np.asarray(offsets[first:last + 2], dtype=np.int64)
  pos = np.arange(start, end, dtype=np.int64)
  doc = np.searchsorted(bounds, pos, side="right") - 1  # 0 = first doc.
  doc_in, doc_tgt = doc[:-1], doc[1:]
  return {
      "inputs": window[:-1],
      "targets": window[1:],
      "segment_ids": (doc_in + 1).astype(np.int32),
      "positions": (pos[:-1] - bounds[doc_in]).astype(np.int32),
      "loss_mask": (doc_in == doc_tgt).astype(np.float32),
  }


def id_limit(store: TokenStore, vocab_size: int | None) -> int:
  """The exclusive bound on ids: the store's tokenizer and the model's.

  An id the store's own tokenizer cannot produce is corruption even when the
  model's (padded) embedding table would accept it.
  """
  return store.vocab_size if vocab_size is None else min(vocab_size,
                                                         store.vocab_size)


def first_bad_token(batch: dict[str, np.ndarray],
                    limit: int) -> tuple[int, int, int] | None:
  """(row, column in the row's window, id) of the first id >= `limit`, or None.

  The fast path is one max over `inputs` plus the last column of `targets`
  (together: every token of every window). Ids are compared as uint32, so a
  uint32 id that wrapped negative in the int32 batch is caught by the same max.
  """
  inputs_BL = batch["inputs"].view(np.uint32)
  last_B = batch["targets"][:, -1].view(np.uint32)
  if inputs_BL.max() < limit and last_B.max() < limit:
    return None
  window_BW = np.concatenate([inputs_BL, last_B[:, None]], axis=1)
  bad_BW = window_BW >= limit
  row = int(np.argmax(bad_BW.any(axis=1)))
  col = int(np.argmax(bad_BW[row]))
  return row, col, int(window_BW[row, col])


def _bad_id_error(store: TokenStore, vocab_size: int | None, value: int,
                  position: int | None) -> UserError:
  bound = (f"model.vocab_size={vocab_size}"
           if vocab_size is not None and vocab_size <= store.vocab_size else
           f"the store's vocab_size={store.vocab_size} "
           f"({store.tokenizer_identity})")
  if position is None:
    where = "a document it could not locate"
  else:
    doc = store.doc_at(position)
    where = (f"document {doc} (token {position - int(store.offsets[doc])} of "
             "the document)")
  return UserError(
      f"token store {store.prefix!r}: {where} holds token id {value}, >= "
      f"{bound}; the .bin changed after indexing or is corrupt. Check it with "
      f"`python tools/index_data.py --verify {store.prefix}` and rebuild it "
      "with tools/index_data.py")


def check_batch_ids(batch: dict[str, np.ndarray], store: TokenStore,
                    seq_len: int, vocab_size: int | None,
                    windows: Callable[[int], int]) -> None:
  """Raises UserError if any id in `batch` is out of range.

  `windows(row)` gives the window index of a row; it is called only when the
  check fails, to name the document.
  """
  bad = first_bad_token(batch, id_limit(store, vocab_size))
  if bad is None:
    return
  row, col, value = bad
  position = int(windows(row)) * seq_len + col
  if not (position < store.num_tokens and
          int(store.tokens[position]) == value):
    position = None  # The row did not come from where we thought.
  raise _bad_id_error(store, vocab_size, value, position)


class PackedSource:
  """Random-access Grain source of packed windows over one token store.

  Pickles as (prefix, seq_len, length) and reopens the memmaps lazily, so it
  crosses spawn-based worker processes cheaply.
  """

  def __init__(self, prefix: str, seq_len: int):
    if seq_len < 1:
      raise UserError(f"seq_len={seq_len}; it must be a positive integer")
    self.prefix = os.fspath(prefix)
    self.seq_len = int(seq_len)
    self._store: TokenStore | None = TokenStore.open(self.prefix)
    self._len = max(0, (self._store.num_tokens - 1) // self.seq_len)

  @property
  def store(self) -> TokenStore:
    if self._store is None:  # A racing double open is harmless.
      self._store = TokenStore.open(self.prefix)
    return self._store

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = int(index)
    if not 0 <= index < self._len:
      raise IndexError(f"window {index} out of range [0, {self._len})")
    store = self.store
    return pack_window(store.tokens, store.offsets, index * self.seq_len,
                       self.seq_len)

  def __getstate__(self) -> dict[str, Any]:
    return {"prefix": self.prefix, "seq_len": self.seq_len, "len": self._len}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.prefix, self.seq_len = state["prefix"], state["seq_len"]
    self._len, self._store = state["len"], None

  def __repr__(self) -> str:
    return f"PackedSource({self.prefix!r}, seq_len={self.seq_len})"


def _check_processes(global_batch_size: int, process_index: int,
                     process_count: int) -> int:
  """Validates the process layout; returns the per-process batch size."""
  if process_count < 1 or not 0 <= process_index < process_count:
    raise UserError(
        f"process_index={process_index}, process_count={process_count}: "
        "need 0 <= process_index < process_count")
  if global_batch_size < 1 or global_batch_size % process_count:
    raise UserError(
        f"global batch size {global_batch_size} is not a positive multiple "
        f"of the process count {process_count}; choose a batch size "
        "divisible by it")
  return global_batch_size // process_count


def _shuffle_seed(seed: int) -> int:
  # Grain shuffles epoch e with seed + e; hashing the user seed keeps runs
  # with seeds s and s + 1 from sharing epoch orders.
  if not 0 <= seed < 2**63:
    raise UserError(f"data seed {seed} must be a non-negative integer")
  digest = hashlib.blake2b(str(seed).encode(), digest_size=4).digest()
  return int.from_bytes(digest, "little")


def make_train_dataset(prefix: str, seq_len: int, global_batch_size: int,
                       seed: int, process_index: int, process_count: int, *,
                       num_threads: int = 2,
                       prefetch: int = 4) -> grain.IterDataset:
  """Endless, shuffled, per-process-sharded batches of packed windows.

  Every epoch is a fresh deterministic permutation of all windows; process p
  takes positions p, p + P, ... of the global order, so processes are
  disjoint. `iter()` of the result supports `get_state()` / `set_state()`.
  """
  return _train_dataset(PackedSource(prefix, seq_len), global_batch_size,
                        seed, process_index, process_count,
                        num_threads=num_threads, prefetch=prefetch)


def _window_order(num_windows: int, seed: int, process_index: int,
                  process_count: int) -> grain.MapDataset:
  """Item i is the window index of this process's i-th example."""
  ds = grain.MapDataset.range(num_windows).shuffle(seed=_shuffle_seed(seed))
  return ds.repeat()[process_index::process_count]


def _train_dataset(source: PackedSource, global_batch_size: int, seed: int,
                   process_index: int, process_count: int, *,
                   num_threads: int = 2, prefetch: int = 4) -> grain.IterDataset:
  prefix, seq_len = source.prefix, source.seq_len
  local_batch = _check_processes(global_batch_size, process_index,
                                 process_count)
  if len(source) < global_batch_size:
    raise UserError(
        f"token store {prefix!r} has {source.store.num_tokens} tokens, i.e. "
        f"{len(source)} windows of seq_len {seq_len}, fewer than one global "
        f"batch of {global_batch_size}; use more data or a smaller batch or "
        "seq_len")
  # Keep in step with `_window_order`, which replays this order by index.
  ds = grain.MapDataset.source(source).shuffle(seed=_shuffle_seed(seed))
  ds = ds.repeat()  # Index e * n + i is item i of epoch e, reshuffled.
  ds = ds[process_index::process_count]
  ds = ds.batch(local_batch, drop_remainder=True)
  options = grain.ReadOptions(num_threads=num_threads,
                              prefetch_buffer_size=prefetch)
  return ds.to_iter_dataset(options)


class TrainLoader:
  """Iterator over this process's training batches, with resumable state.

  `vocab_size` is the model's: the store is refused (UserError) if its
  maximum id is not below it, and so is any batch holding an id >= it (or >=
  the store's own vocab_size, which is all that is checked when None).
  """

  def __init__(self, prefix: str, seq_len: int, global_batch_size: int,
               seed: int, process_index: int | None = None,
               process_count: int | None = None, *,
               vocab_size: int | None = None):
    self.process_index = (jax.process_index() if process_index is None
                          else process_index)
    self.process_count = (jax.process_count() if process_count is None
                          else process_count)
    self.prefix, self.seq_len, self.seed = prefix, seq_len, seed
    self.global_batch_size = global_batch_size
    self.local_batch = _check_processes(global_batch_size, self.process_index,
                                        self.process_count)
    source = PackedSource(prefix, seq_len)
    self.store = source.store
    if vocab_size is not None:
      self.store.check_vocab(vocab_size)
    self.model_vocab_size = vocab_size
    self.dataset = _train_dataset(source, global_batch_size, seed,
                                  self.process_index, self.process_count)
    self.num_examples = len(source)
    self.vocab_size = self.store.vocab_size
    self.tokenizer_identity = self.store.tokenizer_identity
    self._iter = iter(self.dataset)
    self._order: grain.MapDataset | None = None  # Built if a check fails.

  def __iter__(self) -> TrainLoader:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = next(self._iter)
    check_batch_ids(batch, self.store, self.seq_len, self.model_vocab_size,
                    self._window_of_row)
    return batch

  def _window_of_row(self, row: int) -> int:
    """The window index of `row` of the batch just returned by the iterator."""
    if self._order is None:
      self._order = _window_order(self.num_examples, self.seed,
                                  self.process_index, self.process_count)
    batch_index = int(self._iter.get_state()["next_index"]) - 1
    return self._order[batch_index * self.local_batch + row]

  def _identity(self) -> dict[str, int]:
    return {"seq_len": self.seq_len, "global_batch_size": self.global_batch_size,
            "seed": self.seed, "process_count": self.process_count,
            "num_examples": self.num_examples}

  def get_state(self) -> dict[str, int]:
    """JSON-able state; the same on every process after the same steps."""
    return {"next_index": int(self._iter.get_state()["next_index"]),
            **self._identity()}

  def set_state(self, state: dict[str, Any]) -> None:
    """Resumes so that the next batch is the one after the saved state's."""
    expected = self._identity()
    changed = {k: (state.get(k), v) for k, v in expected.items()
               if k in state and int(state[k]) != v}
    if changed:
      details = ", ".join(f"{k} {old} -> {new}"
                          for k, (old, new) in changed.items())
      raise UserError(
          f"data loader state from the checkpoint does not match this run "
          f"({details}); the batch order cannot be resumed exactly. Restore "
          "the original data settings or start a fresh run")
    self._iter.set_state({"next_index": int(state["next_index"])})


def eval_batches(prefix: str, seq_len: int, global_batch_size: int,
                 num_batches: int, process_index: int | None = None,
                 process_count: int | None = None, *,
                 vocab_size: int | None = None) -> list[dict[str, np.ndarray]]:
  """Fixed evaluation batches: windows 0, 1, 2, ... (cycled if too few).

  Process p gets rows [p * B/P, (p + 1) * B/P) of every global batch.
  `vocab_size` is checked as in `TrainLoader`.
  """
  process_index = jax.process_index() if process_index is None else process_index
  process_count = jax.process_count() if process_count is None else process_count
  local_batch = _check_processes(global_batch_size, process_index,
                                 process_count)
  source = PackedSource(prefix, seq_len)
  n = len(source)
  if n == 0:
    raise UserError(
        f"validation store {prefix!r} has {source.store.num_tokens} tokens, "
        f"not enough for one window of seq_len {seq_len} (needs "
        f"{seq_len + 1}); use more validation data (--val-fraction) or a "
        "smaller seq_len")
  if vocab_size is not None:
    source.store.check_vocab(vocab_size)
  batches = []
  for b in range(num_batches):
    first = b * global_batch_size + process_index * local_batch
    rows = [source[(first + r) % n] for r in range(local_batch)]
    batch = {k: np.stack([row[k] for row in rows]) for k in KEYS}
    check_batch_ids(batch, source.store, seq_len, vocab_size,
                    lambda r, first=first: (first + r) % n)
    batches.append(batch)
  return batches


def to_global(batch: dict[str, np.ndarray],
              sharding: jax.sharding.NamedSharding) -> dict[str, jax.Array]:
  """Assembles each process's rows into global arrays laid out by `sharding`."""
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for k, v in batch.items()}
