"""Memory-mapped token store: one flat token array plus document offsets.

A store with prefix `P` is three files:

  P.bin   the documents' token ids back to back, little-endian `uint16` when
          the vocabulary fits (vocab_size <= 65536), else `uint32`.
  P.idx   `uint64[num_docs + 1]` offsets into P.bin (in tokens): document i is
          `bin[idx[i]:idx[i + 1]]`; idx[0] == 0 and idx[-1] == num_tokens.
  P.json  the header, written last and atomically, so a store without it is
          an unfinished one:
            {"format": "maxtrain-token-store", "version": 1,
             "dtype": "uint16" | "uint32", "vocab_size": int,
             "tokenizer": tokenizer identity (e.g. "byte-v1", "hf:<sha256>"),
             "num_docs": int, "num_tokens": int,
             "checksum": "sha256:<hex of P.bin bytes then P.idx bytes>",
             "max_token_id": largest id in P.bin, null when it is empty,
             "source": free-form dict describing the input, or null}

`max_token_id` came after version 1 was first written; it is optional, so
older stores stay readable (their maximum is found by a scan when asked for,
see `TokenStore.max_token_id`) and older readers ignore it: no version bump.

Opening checks the header against the file sizes and every offset (one
vectorised pass over P.idx: 8 bytes per document, never the tokens);
`TokenStore.verify` and `TokenStore.scan_ids` read everything.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
from typing import Any

import numpy as np

from maxtrain.errors import UserError

FORMAT = "maxtrain-token-store"
VERSION = 1
_REBUILD = "rebuild it with `python tools/index_data.py`"
_IDX_FLUSH = 1 << 16  # Offsets buffered before each .idx write.
_CHUNK = 1 << 24  # Tokens per step when scanning a whole store.
_IDX_CHUNK = 1 << 22  # Offsets per step of the open-time check (32 MiB).
# Maximum ids of stores without `max_token_id`, by (.bin, inode, size, mtime).
_SCANNED_MAX: dict[tuple, int | None] = {}


def token_dtype(vocab_size: int) -> np.dtype:
  """The narrowest unsigned dtype holding ids in [0, vocab_size)."""
  return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


def _paths(prefix: str) -> tuple[str, str, str]:
  return prefix + ".bin", prefix + ".idx", prefix + ".json"


def _file_sha256(hasher: Any, path: str) -> None:
  with open(path, "rb") as f:
    while chunk := f.read(1 << 22):
      hasher.update(chunk)


class StoreWriter:
  """Streams documents to a new store; `close()` publishes it.

  Data goes to private temporary files that `close()` renames into place
  before writing the header, so a store being rewritten stays readable until
  then, an interrupted write leaves it untouched, and concurrent writers
  never clobber each other's half-written files.
  """

  def __init__(self, prefix: str | os.PathLike, vocab_size: int,
               tokenizer_identity: str, source: dict | None = None):
    self.prefix = os.fspath(prefix)
    self.vocab_size = int(vocab_size)
    self.tokenizer_identity = tokenizer_identity
    self.source = source
    self.dtype = token_dtype(self.vocab_size)
    self._bin_path, self._idx_path, self._json_path = _paths(self.prefix)
    self._tmp = f".tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
      os.makedirs(os.path.dirname(self.prefix) or ".", exist_ok=True)
      self._bin = open(self._bin_path + self._tmp, "wb")
    except OSError as e:
      raise _unwritable(self.prefix, e) from None
    try:
      self._idx = open(self._idx_path + self._tmp, "wb")
    except OSError as e:
      self._bin.close()
      with contextlib.suppress(OSError):
        os.remove(self._bin.name)
      raise _unwritable(self.prefix, e) from None
    self._hash = hashlib.sha256()
    self._pending = [0]  # Offsets not yet written to .idx.
    self.num_docs = 0
    self.num_tokens = 0
    self.max_token_id: int | None = None
    self._header: dict | None = None

  def add(self, tokens: np.ndarray) -> None:
    """Appends one document."""
    if self._header is not None:
      raise RuntimeError(f"store {self.prefix!r} is already closed")
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
      raise ValueError(f"a document must be 1-D, got shape {tokens.shape}")
    if tokens.size:
      low, high = int(tokens.min()), int(tokens.max())
      if low < 0 or high >= self.vocab_size:
        raise ValueError(
            f"token ids must be in [0, {self.vocab_size}), got [{low}, {high}]")
      if self.max_token_id is None or high > self.max_token_id:
        self.max_token_id = high
    data = tokens.astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
    self._bin.write(data)
    self._hash.update(data)
    self.num_docs += 1
    self.num_tokens += tokens.size
    self._pending.append(self.num_tokens)
    if len(self._pending) >= _IDX_FLUSH:
      self._flush_idx()

  def _flush_idx(self) -> None:
    self._idx.write(np.asarray(self._pending, dtype="<u8").tobytes())
    self._pending = []

  def close(self) -> dict:
    """Finishes the files, writes the header last; returns the header."""
    if self._header is not None:
      return self._header
    self._flush_idx()
    for f in (self._bin, self._idx):
      f.flush()
      os.fsync(f.fileno())
      f.close()
    # The .idx part of the checksum is hashed from disk: it is small next to
    # .bin, and this keeps the documented "bin then idx" order.
    _file_sha256(self._hash, self._idx_path + self._tmp)
    header = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": self.dtype.name,
        "vocab_size": self.vocab_size,
        "tokenizer": self.tokenizer_identity,
        "num_docs": self.num_docs,
        "num_tokens": self.num_tokens,
        "checksum": "sha256:" + self._hash.hexdigest(),
        "max_token_id": self.max_token_id,
        "source": self.source,
    }
    if os.path.exists(self._json_path):  # Unpublish the old store first.
      os.remove(self._json_path)
    os.replace(self._bin_path + self._tmp, self._bin_path)
    os.replace(self._idx_path + self._tmp, self._idx_path)
    with open(self._json_path + self._tmp, "w") as f:
      json.dump(header, f, indent=2)
      f.write("\n")
      f.flush()
      os.fsync(f.fileno())
    os.replace(self._json_path + self._tmp, self._json_path)
    self._header = header
    return header

  def abort(self) -> None:
    """Closes and deletes the unfinished files; publishes nothing."""
    if self._header is not None:
      return
    for f in (self._bin, self._idx):
      f.close()
      with contextlib.suppress(FileNotFoundError):
        os.remove(f.name)

  def __enter__(self) -> StoreWriter:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None:
      self.close()
    else:
      self.abort()


class TokenStore:
  """A read-only, memory-mapped store. Build with `TokenStore.open(prefix)`."""

  def __init__(self, prefix: str, header: dict, tokens: np.ndarray,
               offsets: np.ndarray):
    self.prefix = prefix
    self.header = header
    self.vocab_size: int = header["vocab_size"]
    self.tokenizer_identity: str = header["tokenizer"]
    self.num_docs: int = header["num_docs"]
    self.num_tokens: int = header["num_tokens"]
    self.tokens = tokens
    self.offsets = offsets
    self._max_token_id: int | None = header.get("max_token_id")
    self._max_known = "max_token_id" in header

  @classmethod
  def open(cls, prefix: str | os.PathLike) -> TokenStore:
    """Opens and checks a store: sizes, header, every offset (not the tokens)."""
    prefix = os.fspath(prefix)
    bin_path, idx_path, json_path = _paths(prefix)
    if not os.path.exists(json_path):
      what = ("its data files exist, so it was never finished"
              if os.path.exists(bin_path) else "no such store")
      raise UserError(
          f"token store header {json_path!r} is missing ({what}); {_REBUILD}")
    try:
      with open(json_path) as f:
        header = json.load(f)
    except (OSError, ValueError) as e:
      raise UserError(
          f"token store header {json_path!r} is unreadable ({e}); {_REBUILD}"
      ) from None
    header = _check_header(json_path, header)
    for path in (bin_path, idx_path):
      if not os.path.exists(path):
        raise UserError(
            f"token store file {path!r} is missing but its header "
            f"{json_path!r} exists; {_REBUILD}")
    dtype = np.dtype(header["dtype"]).newbyteorder("<")
    n_tok, n_doc = header["num_tokens"], header["num_docs"]
    _check_size(bin_path, n_tok * dtype.itemsize,
                f"{n_tok} tokens of {header['dtype']}")
    _check_size(idx_path, (n_doc + 1) * 8, f"{n_doc + 1} uint64 offsets")
    offsets = np.memmap(idx_path, dtype="<u8", mode="r", shape=(n_doc + 1,))
    if n_tok:
      tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_tok,))
    else:  # np.memmap refuses empty files.
      tokens = np.zeros((0,), dtype)
    _check_offsets(idx_path, json_path, offsets, n_tok)
    return cls(prefix, header, tokens, offsets)

  def doc(self, i: int) -> np.ndarray:
    """Returns document `i`'s tokens (a view into the memmap)."""
    if not -self.num_docs <= i < self.num_docs:
      raise IndexError(f"document {i} out of range [0, {self.num_docs})")
    i %= self.num_docs
    return self.tokens[int(self.offsets[i]):int(self.offsets[i + 1])]

  def doc_at(self, position: int) -> int:
    """The index of the document holding token `position` (O(log docs))."""
    return int(np.searchsorted(self.offsets, position, side="right")) - 1

  @property
  def max_token_id(self) -> int | None:
    """The largest token id (None for an empty store).

    From the header; a store written before the header recorded it is
    scanned here, once per process (python-stdlib corpus: 9 ms; 10x: 0.12 s).
    Scanning rather than refusing such a store: the scan reads the .bin once,
    the rebuild a refusal would demand re-reads and re-tokenizes all the text,
    and the loaders' per-batch check guards training either way.
    """
    if not self._max_known:
      bin_path = _paths(self.prefix)[0]
      st = os.stat(bin_path)
      key = (os.path.realpath(bin_path), st.st_ino, st.st_size, st.st_mtime_ns)
      if key not in _SCANNED_MAX:  # Once per process, not once per open.
        _SCANNED_MAX[key] = self._scan_max()
      self._max_token_id = _SCANNED_MAX[key]
      self._max_known = True
    return self._max_token_id

  @property
  def max_token_id_recorded(self) -> bool:
    """Whether the header carries `max_token_id` (False: an older store)."""
    return "max_token_id" in self.header

  def check_vocab(self, vocab_size: int) -> None:
    """Raises UserError unless every token id is < `vocab_size`.

    Costs O(1) for stores that record their maximum id, one vectorised pass
    over the tokens for older ones.
    """
    high = self.max_token_id
    if high is not None and high >= vocab_size:
      where = ("recorded in its header" if self.max_token_id_recorded
               else "found by scanning it")
      raise UserError(
          f"token store {self.prefix!r} holds token id {high} ({where}), "
          f">= model.vocab_size={vocab_size}: it was built with a tokenizer "
          f"of {self.vocab_size} ids ({self.tokenizer_identity}). Set "
          f"--config.model.vocab_size to at least {high + 1}, or point "
          f"config.data at a store built with this model's tokenizer")

  def first_bad_id(self, limit: int) -> tuple[int, int] | None:
    """(position, id) of the first token id >= `limit`, else None.

    One vectorised pass over the tokens, in bounded memory.
    """
    for start in range(0, self.num_tokens, _CHUNK):
      chunk = np.asarray(self.tokens[start:start + _CHUNK])
      if chunk.max() >= limit:  # The common case does only this.
        col = int(np.argmax(chunk >= limit))
        return start + col, int(chunk[col])
    return None

  def _scan_max(self) -> int | None:
    high = None
    for start in range(0, self.num_tokens, _CHUNK):
      m = int(np.asarray(self.tokens[start:start + _CHUNK]).max())
      high = m if high is None else max(high, m)
    return high

  def verify(self) -> None:
    """Reads everything: every id against the header, then the checksum.

    Raises UserError naming the first bad document, or the files when only
    the checksum disagrees. O(corpus size).
    """
    bin_path, idx_path, json_path = _paths(self.prefix)
    limit = self.vocab_size
    if self.max_token_id_recorded and self._max_token_id is not None:
      limit = min(limit, self._max_token_id + 1)
    bad = self.first_bad_id(limit)
    if bad is not None:
      position, value = bad
      doc = self.doc_at(position)
      raise UserError(
          f"token store {bin_path!r} is corrupt: document {doc} holds token id "
          f"{value} at token {position - int(self.offsets[doc])}, beyond the "
          f"header's {_id_bound(self.header)} in {json_path!r}; it changed "
          f"after indexing: {_REBUILD}")
    algo, _, expected = str(self.header.get("checksum", "")).partition(":")
    if algo != "sha256":
      raise UserError(
          f"token store header {json_path!r} has an unknown checksum "
          f"{self.header.get('checksum')!r}; {_REBUILD}")
    h = hashlib.sha256()
    _file_sha256(h, bin_path)
    _file_sha256(h, idx_path)
    if h.hexdigest() != expected:
      raise UserError(
          f"token store {bin_path!r}/{idx_path!r} is corrupt: checksum "
          f"{h.hexdigest()} does not match {expected} in {json_path!r}; "
          f"{_REBUILD}")

  def unigram_counts(self) -> np.ndarray:
    """Counts of each token id, shape [vocab_size]."""
    counts = np.zeros(self.vocab_size, np.int64)
    for start in range(0, self.num_tokens, _CHUNK):  # Bounds temp memory.
      chunk = np.asarray(self.tokens[start:start + _CHUNK])
      counts += np.bincount(chunk, minlength=self.vocab_size)[:self.vocab_size]
    return counts

  def unigram_entropy(self) -> float:
    """Entropy of the token unigram distribution, in nats per token.

    A model that beats this loss has learned more than token frequencies.
    """
    counts = self.unigram_counts()
    total = counts.sum()
    if total == 0:
      return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())

  def __len__(self) -> int:
    return self.num_docs

  def __repr__(self) -> str:
    return (f"TokenStore({self.prefix!r}, docs={self.num_docs}, "
            f"tokens={self.num_tokens}, tokenizer={self.tokenizer_identity!r})")


def _check_header(path: str, header: Any) -> dict:
  if not isinstance(header, dict) or header.get("format") != FORMAT:
    raise UserError(
        f"{path!r} is not a maxtrain token store header (format="
        f"{header.get('format') if isinstance(header, dict) else None!r}, "
        f"expected {FORMAT!r}); {_REBUILD}")
  if header.get("version") != VERSION:
    raise UserError(
        f"token store {path!r} has version {header.get('version')!r}, this "
        f"maxtrain reads version {VERSION}; {_REBUILD}")
  if header.get("dtype") not in ("uint16", "uint32"):
    raise UserError(
        f"token store {path!r} has dtype {header.get('dtype')!r}, expected "
        f"'uint16' or 'uint32'; {_REBUILD}")
  for key in ("vocab_size", "num_docs", "num_tokens"):
    value = header.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
      raise UserError(
          f"token store {path!r} has {key}={value!r}, expected a "
          f"non-negative integer; {_REBUILD}")
  if not isinstance(header.get("tokenizer"), str):
    raise UserError(
        f"token store {path!r} does not name its tokenizer; {_REBUILD}")
  if "max_token_id" in header:  # Absent in stores from before it existed.
    high = header["max_token_id"]
    if header["num_tokens"] == 0:
      ok = high is None
    else:
      ok = (isinstance(high, int) and not isinstance(high, bool) and
            0 <= high < header["vocab_size"])
    if not ok:
      expected = ("null for an empty store" if header["num_tokens"] == 0 else
                  f"an integer in [0, vocab_size={header['vocab_size']})")
      raise UserError(
          f"token store {path!r} has max_token_id={high!r}, expected "
          f"{expected}; {_REBUILD}")
  return header


def _id_bound(header: dict) -> str:
  if header.get("max_token_id") is not None:
    return f"max_token_id={header['max_token_id']}"
  return f"vocab_size={header['vocab_size']}"


def _check_offsets(idx_path: str, json_path: str, offsets: np.ndarray,
                   num_tokens: int) -> None:
  """Every offset non-decreasing, from 0 to num_tokens: one vectorised pass.

  Chunks overlap by one offset so each adjacent pair is compared once; the
  temporaries stay bounded however many documents there are.
  """
  first, last = int(offsets[0]), int(offsets[-1])
  if first != 0 or last != num_tokens:
    raise UserError(
        f"token store index {idx_path!r} is inconsistent: offsets run from "
        f"{first} to {last}, expected 0 to {num_tokens} (num_tokens in "
        f"{json_path!r}); {_REBUILD}")
  n = offsets.shape[0]
  for start in range(0, n - 1, _IDX_CHUNK):
    chunk = np.asarray(offsets[start:start + _IDX_CHUNK + 1])
    # Given first == 0 and last == num_tokens, non-decreasing means in range;
    # `> num_tokens` is tested too so the message can name the first culprit.
    descending = chunk[1:] < chunk[:-1]
    beyond = chunk > num_tokens
    if descending.any() or beyond.any():
      d = int(np.argmax(descending)) + 1 if descending.any() else n
      b = int(np.argmax(beyond)) if beyond.any() else n
      i = start + min(d, b)
      value = int(offsets[i])
      what = (f"beyond the {num_tokens} tokens of the .bin" if b <= d else
              f"before the previous offset {int(offsets[i - 1])}")
      raise UserError(
          f"token store index {idx_path!r} is corrupt: offset {i} (start of "
          f"document {i}) is {value}, {what}; offsets must be non-decreasing "
          f"from 0 to {num_tokens}; {_REBUILD}")


def _unwritable(prefix: str, e: OSError) -> UserError:
  where = e.filename or prefix
  return UserError(
      f"cannot write token store {prefix!r}: {where!r}: "
      f"{e.strerror or e}; write it somewhere writable (tools/index_data.py: "
      "--output)")


def _check_size(path: str, expected: int, what: str) -> None:
  found = os.path.getsize(path)
  if found != expected:
    raise UserError(
        f"token store file {path!r} is {found} bytes, expected {expected} "
        f"({what}, per its header); it is truncated or from another build; "
        f"{_REBUILD}")

