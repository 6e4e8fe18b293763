"""Packed, document-aware windows over a token store; fixed eval batches; global arrays. The train
batches are MixtureLoader's (`data/loader.py`), served by Grain.

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

import os
from typing import Any, Callable

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


def pack_pieces(tokens: np.ndarray, offsets: np.ndarray,
                pieces: list[tuple[int, int]], seq_len: int) -> dict[str, np.ndarray]:
  """One example of `seq_len` from store ranges (first token, length): each
  piece is packed like a window of its length and kept a document apart from
  the others (its own segment ids); a short total is padded, loss-masked."""
  if len(pieces) == 1 and pieces[0][1] == seq_len:
    return pack_window(tokens, offsets, pieces[0][0], seq_len)
  parts, next_segment = [], 1
  for start, length in pieces:
    part = pack_window(tokens, offsets, start, length)
    part["segment_ids"] = part["segment_ids"] - part["segment_ids"][0] + next_segment
    next_segment = int(part["segment_ids"][-1]) + 1
    parts.append(part)
  pad = seq_len - sum(length for _, length in pieces)
  if pad:
    parts.append({"inputs": np.zeros(pad, np.int32), "targets": np.zeros(pad, np.int32),
                  "segment_ids": np.full(pad, next_segment, np.int32),
                  "positions": np.arange(pad, dtype=np.int32),
                  "loss_mask": np.zeros(pad, np.float32)})
  return {k: np.concatenate([p[k] for p in parts]) for k in KEYS}


def check_piece_ids(store: TokenStore, pieces: list[tuple[int, int]],
                    vocab_size: int | None) -> None:
  """Raises UserError naming the document if a piece's tokens (its inputs and
  every target, which `first_bad_token`'s fast path does not see where one
  piece ends and the next begins) hold an id out of range."""
  limit = id_limit(store, vocab_size)
  for start, length in pieces:
    window = np.asarray(store.tokens[start:start + length + 1]).astype(np.int64)
    if window.max() >= limit or window.min() < 0:
      at = int(np.argmax((window >= limit) | (window < 0)))
      raise _bad_id_error(store, vocab_size, int(window[at]), start + at)


def piece_position(pieces: list[tuple[int, int]], column: int) -> int | None:
  """The store position of `column` of a row packed by `pack_pieces` (column
  seq_len: the last target); None in the padding."""
  for start, length in pieces:
    if column < length or (column == length and (start, length) == pieces[-1]):
      return start + column
    column -= length
  return None


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
                    vocab_size: int | None,
                    position: Callable[[int, int], int | None]) -> None:
  """Raises UserError if any id in `batch` is out of range.

  `position(row, column)` gives the store position of a token of a row's
  window (columns count `inputs` then the last target); it is called only
  when the check fails, to name the document.
  """
  bad = first_bad_token(batch, id_limit(store, vocab_size))
  if bad is None:
    return
  row, col, value = bad
  position = position(row, col)
  if position is None or not (position < store.num_tokens and
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


def eval_batches(prefix: str, seq_len: int, global_batch_size: int,
                 num_batches: int, process_index: int | None = None,
                 process_count: int | None = None, *,
                 vocab_size: int | None = None) -> list[dict[str, np.ndarray]]:
  """Fixed evaluation batches: windows 0, 1, 2, ... (cycled if too few).

  Process p gets rows [p * B/P, (p + 1) * B/P) of every global batch.
  `vocab_size` is checked as in the train loader (`data/loader.py`).
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
    check_batch_ids(batch, source.store, vocab_size,
                    lambda r, c, first=first: (first + r) % n * seq_len + c)
    batches.append(batch)
  return batches


def to_global(batch: dict[str, np.ndarray],
              sharding: jax.sharding.NamedSharding) -> dict[str, jax.Array]:
  """Assembles each process's rows into global arrays laid out by `sharding`."""
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for k, v in batch.items()}
