"""Weighted mixtures of token stores, in stages: which window of which store is global sequence i.

The answer is a pure function of (i, seed, the stage table), so the loader's state is a global
sequence index, not a per-process iterator position, and any process count can continue it.

- A stage runs from its first step with its own weights, seq_len and batch size. In sequence space
  it starts at sequence `seq` (the sequences of all earlier steps).
- Within a stage, sequences come in blocks; each block holds exactly `counts[j]` sequences of
  source j (the weights times the block size, largest-remainder rounded; the block is a multiple of
  the weights' common denominator when that is small, so the shares are then exact), in a seeded
  order that differs per block. Blocks restart at each stage, so new weights hold at once.
- Each source reads an endless sequence of epochs, each a seeded permutation of its windows at one
  seq_len (Grain's index shuffle, the order `data/pipeline.py` used before mixtures: one source gives
  that order). Where a source stands is a `Cursor`: its epoch, that epoch's window length, and how many
  of the epoch's tokens it has read.
- At a stage boundary each source carries on from its cursor. When the seq_len changes in the middle
  of an epoch, the epoch's unread windows (in their order) are re-cut into sequences of the new length,
  each piece its own document (segment ids; the last sequence padded, loss-masked); the next epoch is
  a permutation of windows at the new length. So no token is read twice in an epoch, and none skipped.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import math
import os
from fractions import Fraction
from typing import Any, Sequence

import grain
import numpy as np

from maxtrain.errors import UserError

EXACT_DENOMINATOR = 4096  # weights whose common denominator is at most this mix exactly
MIN_BLOCK = 256  # exact blocks are the smallest multiple of the denominator at least this long
_RESERVED = ("seq_len", "batch_size")  # stage keys that are not source names


@dataclasses.dataclass(frozen=True)
class Source:
  name: str
  prefix: str
  weight: float

  def split(self, part: str) -> Source:
    """This source's `train` or `val` store (PREFIX.train, PREFIX.val, as tools/index_data.py writes them)."""
    return dataclasses.replace(self, prefix=f"{self.prefix}.{part}")


def parse_sources(text: str) -> list[Source]:
  """`PREFIX[:WEIGHT],...` -> sources (weight 1 when left out; the name is the prefix's base name)."""
  sources = []
  for entry in (e.strip() for e in text.split(",")):
    if not entry:
      continue
    prefix, sep, weight = entry.rpartition(":")
    if not sep or "/" in weight:  # a ':' inside a path is not a weight
      prefix, weight = entry, "1"
    try:
      w = float(weight)
    except ValueError:
      raise UserError(f"config.data.sources entry {entry!r}: weight {weight!r} is not a number "
                      "(expected PREFIX[:WEIGHT])") from None
    name = os.path.basename(prefix.rstrip("/"))
    if not name or not math.isfinite(w) or w < 0:
      raise UserError(f"config.data.sources entry {entry!r}: need a store prefix and a finite weight >= 0")
    if name in _RESERVED:
      raise UserError(f"config.data.sources entry {entry!r}: the name {name!r} is reserved in data.stages; "
                      "rename the store")
    if any(s.name == name for s in sources):
      raise UserError(f"config.data.sources names two stores {name!r}; each source's base name must be unique")
    sources.append(Source(name, prefix, w))
  return sources


@dataclasses.dataclass(frozen=True)
class Stage:
  """From `step` (global sequence `seq`) on: `batch_size` sequences of `seq_len` per step, mixed by `weights`."""
  step: int
  seq: int
  batch_size: int
  seq_len: int
  weights: tuple[float, ...]

  def to_json(self) -> dict:
    return dataclasses.asdict(self) | {"weights": list(self.weights)}

  @classmethod
  def from_json(cls, d: dict) -> Stage:
    return cls(int(d["step"]), int(d["seq"]), int(d["batch_size"]), int(d["seq_len"]),
               tuple(float(w) for w in d["weights"]))


def parse_stages(text: str, names: Sequence[str], first: Stage) -> list[Stage]:
  """`STEP:key=value,...;STEP:...` -> the stage table, starting with `first` (step 0).

  Keys are source names (weights), `seq_len` and `batch_size`. A stage naming any weight sets all
  of them (unnamed sources get 0); one naming none keeps the previous weights. Sequence starts are
  filled in from the batch sizes. UserError names the stage at fault.
  """
  stages = [first]
  for entry in (e.strip() for e in text.split(";")):
    if not entry:
      continue
    where = f"config.data.stages entry {entry!r}"
    step_text, sep, body = entry.partition(":")
    try:
      step = int(step_text)
    except ValueError:
      raise UserError(f"{where}: expected STEP:key=value,... with an integer STEP") from None
    prev = stages[-1]
    if not sep or step <= prev.step:
      raise UserError(f"{where}: stages need increasing steps > {prev.step} (expected STEP:key=value,...)")
    fields = {"seq_len": prev.seq_len, "batch_size": prev.batch_size}
    weights: dict[str, float] = {}
    for item in (i.strip() for i in body.split(",") if i.strip()):
      key, eq, value = item.partition("=")
      key = key.strip()
      try:
        number = float(value)
      except ValueError:
        number = math.nan
      if not eq or not math.isfinite(number) or number < 0:
        raise UserError(f"{where}: {item!r} must be key=number >= 0")
      if key in _RESERVED:
        require_int = int(number)
        if require_int != number or require_int < 1:
          raise UserError(f"{where}: {key}={value} must be a positive integer")
        fields[key] = require_int
      elif key in names:
        weights[key] = number
      else:
        raise UserError(f"{where}: unknown source {key!r}; the sources are {', '.join(names)} "
                        "(base names of config.data.sources)")
    w = tuple(weights.get(n, 0.0) for n in names) if weights else prev.weights
    if not any(w):
      raise UserError(f"{where}: every weight is 0; give at least one source a weight > 0")
    seq = prev.seq + (step - prev.step) * prev.batch_size
    stages.append(Stage(step, seq, fields["batch_size"], fields["seq_len"], w))
  return stages


def from_config(d: Any) -> tuple[list[Source], list[Stage]]:
  """The config's sources (PREFIX without .train/.val; the embedded corpus has prefix "") and stage table.

  `data.sources` is a mixture; else `data.path` or `data.corpus` is the one source, named after it.
  """
  if d.sources:
    sources = parse_sources(d.sources)
    if not sources:
      raise UserError(f"config.data.sources={d.sources!r} names no store (expected PREFIX[:WEIGHT],...)")
    if not any(s.weight for s in sources):
      raise UserError(f"config.data.sources={d.sources!r}: every weight is 0; give one source a weight > 0")
  elif d.path:
    sources = [Source(os.path.basename(d.path.rstrip("/")) or "train", d.path, 1.0)]
  else:
    sources = [Source(d.corpus, "", 1.0)]
  first = Stage(0, 0, d.batch_size, d.seq_len, tuple(s.weight for s in sources))
  return sources, parse_stages(d.stages, [s.name for s in sources], first)


def block_counts(weights: Sequence[float]) -> tuple[int, ...]:
  """Sequences of each source per block: exact when the weights' common denominator is small."""
  total = math.fsum(weights)
  shares = [Fraction(w / total).limit_denominator(EXACT_DENOMINATOR) for w in weights]
  denominator = math.lcm(*(s.denominator for s in shares))
  if denominator <= EXACT_DENOMINATOR and all(abs(float(s) - w / total) < 1e-12 for s, w in zip(shares, weights)):
    block = denominator * max(1, -(-MIN_BLOCK // denominator))
    return tuple(int(s * block) for s in shares)
  block = EXACT_DENOMINATOR  # largest remainder: each block within one sequence of its share
  quotas = [w / total * block for w in weights]
  counts = [math.floor(q) for q in quotas]
  by_remainder = sorted(range(len(quotas)), key=lambda j: (counts[j] - quotas[j], j))
  for j in by_remainder[:block - sum(counts)]:
    counts[j] += 1
  return tuple(counts)


def _mix64(x: np.ndarray) -> np.ndarray:
  """splitmix64's finalizer on uint64 (wrapping arithmetic): a portable, seeded hash."""
  x = x ^ (x >> np.uint64(30))
  x = x * np.uint64(0xBF58476D1CE4E5B9)
  x = x ^ (x >> np.uint64(27))
  x = x * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


def _seed64(*parts: Any) -> int:
  digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little")


@functools.lru_cache(maxsize=64)
def block_layout(seed: int, stage_step: int, block: int, counts: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
  """(source, rank) of every position of one block: rank = how many of that source come before it."""
  size = sum(counts)
  base = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
  with np.errstate(over="ignore"):
    keys = _mix64(np.arange(size, dtype=np.uint64) + np.uint64(_seed64("block", seed, stage_step, block)))
  source = base[np.argsort(keys, kind="stable")]
  order = np.argsort(source, kind="stable")
  starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
  rank = np.empty(size, np.int64)
  rank[order] = np.arange(size) - starts[source[order]]
  source.flags.writeable = rank.flags.writeable = False
  return source, rank


def shuffle_seed(seed: int, name: str | None = None) -> int:
  """The Grain shuffle seed of a source's epochs. One source (name None) keeps the order of the
  single-store loader; hashing keeps runs with seeds s and s + 1 from sharing epoch orders."""
  if not 0 <= seed < 2**63:
    raise UserError(f"data seed {seed} must be a non-negative integer")
  text = str(seed) if name is None else f"{seed}/{name}"
  return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")


@dataclasses.dataclass(frozen=True)
class Cursor:
  """Where a source stands: `offset` tokens (targets) into epoch `epoch`, whose permutation is of windows of
  `window_len` tokens (the seq_len in force when the epoch began)."""
  epoch: int
  window_len: int
  offset: int


class Mixture:
  """The pure map from global sequence index to (source, window), over a resolved stage table.

  `num_tokens[j]` is source j's store length; only lengths are needed, never the tokens.
  """

  def __init__(self, names: Sequence[str], num_tokens: Sequence[int], stages: Sequence[Stage], seed: int):
    self.names, self.num_tokens, self.stages, self.seed = list(names), list(num_tokens), list(stages), seed
    self._seq_starts = [s.seq for s in self.stages]
    self._step_starts = [s.step for s in self.stages]
    self.counts = [block_counts(s.weights) for s in self.stages]
    for t, stage in enumerate(self.stages):
      for j, name in enumerate(self.names):
        if stage.weights[j] > 0 and self.num_windows(j, stage.seq_len) == 0:
          raise UserError(f"source {name!r} has {self.num_tokens[j]} tokens, not one window of seq_len "
                          f"{stage.seq_len} (needs {stage.seq_len + 1}); use more data or a smaller seq_len")
    start = Cursor(0, self.stages[0].seq_len, 0)
    self.cursors = [[start] * len(self.names)]  # per stage: each source's cursor at its start
    self.done = [np.zeros(len(self.names), np.int64)]  # per stage: sequences of each source before it
    for t in range(1, len(self.stages)):
      taken = self._taken(t - 1, self.stages[t].seq)
      self.done.append(self.done[t - 1] + taken)
      self.cursors.append([self._fresh(j, self._advance(j, t - 1, int(taken[j]))[0], self.stages[t].seq_len)
                           for j in range(len(self.names))])

  def num_windows(self, j: int, seq_len: int) -> int:
    return max(0, (self.num_tokens[j] - 1) // seq_len)

  def _fresh(self, j: int, c: Cursor, seq_len: int) -> Cursor:
    """An epoch not yet begun is cut at the new stage's seq_len."""
    return Cursor(c.epoch, seq_len, 0) if c.offset == 0 and self.num_windows(j, seq_len) else c

  def _aligned(self, c: Cursor, seq_len: int) -> bool:
    return c.window_len == seq_len and c.offset % seq_len == 0

  def _remainder(self, j: int, c: Cursor, seq_len: int) -> tuple[int, int]:
    """(sequences, tokens) of `seq_len` that re-cut the rest of the cursor's epoch; (0, 0) when aligned."""
    if self._aligned(c, seq_len):
      return 0, 0
    rest = self.num_windows(j, c.window_len) * c.window_len - c.offset
    return -(-rest // seq_len), rest

  def _advance(self, j: int, t: int, taken: int) -> tuple[Cursor, int]:
    """Source j's cursor after `taken` of its sequences in stage t, and the tokens they hold."""
    c, seq_len = self.cursors[t][j], self.stages[t].seq_len
    if taken == 0:
      return c, 0
    n = self.num_windows(j, seq_len)
    if self._aligned(c, seq_len):
      q = c.epoch * n + c.offset // seq_len + taken
      return Cursor(q // n, seq_len, q % n * seq_len), taken * seq_len
    sequences, rest = self._remainder(j, c, seq_len)
    if taken < sequences:
      return Cursor(c.epoch, c.window_len, c.offset + taken * seq_len), taken * seq_len
    q = (c.epoch + 1) * n + taken - sequences
    return Cursor(q // n, seq_len, q % n * seq_len), rest + (taken - sequences) * seq_len

  def stage_of_sequence(self, i: int) -> int:
    return bisect.bisect_right(self._seq_starts, i) - 1

  def stage_of_step(self, step: int) -> int:
    return bisect.bisect_right(self._step_starts, step) - 1

  def sequence_of_step(self, step: int) -> int:
    """The first global sequence of `step`'s batch."""
    stage = self.stages[self.stage_of_step(step)]
    return stage.seq + (step - stage.step) * stage.batch_size

  def _taken(self, t: int, i: int) -> np.ndarray:
    """Sequences of each source in stage t before global sequence i."""
    counts = self.counts[t]
    block_size = sum(counts)
    block, offset = divmod(i - self.stages[t].seq, block_size)
    taken = block * np.asarray(counts, np.int64)
    if offset:
      source, _ = block_layout(self.seed, self.stages[t].step, block, counts)
      taken = taken + np.bincount(source[:offset], minlength=len(counts))
    return taken

  def locate(self, i: int) -> tuple[int, int, int]:
    """(source j, q, stage t) of global sequence i: it is source j's q-th sequence of the run (counted over
    all stages), read in stage t."""
    t = self.stage_of_sequence(i)
    counts, stage = self.counts[t], self.stages[t]
    if len(counts) == 1:  # one source: every sequence is its own
      return 0, int(self.done[t][0]) + i - stage.seq, t
    block, offset = divmod(i - stage.seq, sum(counts))
    source, rank = block_layout(self.seed, stage.step, block, counts)
    j = int(source[offset])
    return j, int(self.done[t][j] + block * counts[j] + rank[offset]), t

  def pieces(self, j: int, q: int, t: int) -> list[tuple[int, int]]:
    """The (first token, length) ranges of source j's store that its q-th sequence (in stage t) reads, in
    order: one whole window, or, where a seq_len change re-cuts an epoch, pieces of its unread windows."""
    c, seq_len = self.cursors[t][j], self.stages[t].seq_len
    k = q - int(self.done[t][j])  # the source's k-th sequence of the stage
    sequences, rest = self._remainder(j, c, seq_len)
    if k >= sequences:
      n = self.num_windows(j, seq_len)
      first = c.epoch * n + c.offset // seq_len if not sequences else (c.epoch + 1) * n
      return [(self.window(j, first + k - sequences, seq_len) * seq_len, seq_len)]
    out, at, end = [], c.offset + k * seq_len, min(c.offset + (k + 1) * seq_len, c.offset + rest)
    n_old = self.num_windows(j, c.window_len)
    while at < end:
      w, inside = divmod(at, c.window_len)
      length = min(c.window_len - inside, end - at)
      out.append((self.window(j, c.epoch * n_old + w, c.window_len) * c.window_len + inside, length))
      at += length
    return out

  def window(self, j: int, q: int, seq_len: int) -> int:
    """The window (at `seq_len`) at index q of source j's endless permutation of its windows."""
    return int(self._order(j, seq_len)[q])

  @functools.lru_cache(maxsize=None)
  def _order(self, j: int, seq_len: int) -> grain.MapDataset:
    name = None if len(self.names) == 1 else self.names[j]
    return grain.MapDataset.range(self.num_windows(j, seq_len)).shuffle(
        seed=shuffle_seed(self.seed, name)).repeat()

  def consumed(self, i: int) -> dict[str, dict[str, float]]:
    """Per source, before global sequence i: sequences, tokens (targets read) and epochs (fractional)."""
    t = self.stage_of_sequence(i)
    out = {}
    taken = self._taken(t, i)
    for j, name in enumerate(self.names):
      tokens = sum(self._advance(j, u, int(self.done[u + 1][j] - self.done[u][j]))[1] for u in range(t))
      cursor, now = self._advance(j, t, int(taken[j]))
      n = self.num_windows(j, cursor.window_len)
      epochs = cursor.epoch + cursor.offset / (n * cursor.window_len) if n else 0.0
      out[name] = {"sequences": int(self.done[t][j] + taken[j]), "tokens": tokens + now, "epochs": epochs}
    return out
