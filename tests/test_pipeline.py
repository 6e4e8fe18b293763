"""Packed windows, the one-store train loader (data/loader.py, served by Grain), eval batches and global arrays."""

import pickle

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxtrain.data import pipeline
from maxtrain.data.loader import MixtureLoader, contiguous_rows
from maxtrain.data.mixture import Source, Stage
from maxtrain.data.store import StoreWriter
from maxtrain.errors import UserError


def _store(path, doc_lengths, vocab_size=65536):
  """Docs whose tokens are their global positions, so windows are legible."""
  with StoreWriter(path, vocab_size, "test") as w:
    start = 0
    for n in doc_lengths:
      w.add(np.arange(start, start + n) % vocab_size)
      start += n
  return str(path)


def test_window_values_across_a_document_boundary(tmp_path):
  # Docs A = [0..5), B = [5..8), C = [8..14); seq_len 4 → 3 windows.
  src = pipeline.PackedSource(_store(tmp_path / "s", [5, 3, 6]), 4)
  assert len(src) == 3
  ex = src[1]  # Tokens 4..8: A's last token, all of B, C's first.
  np.testing.assert_array_equal(ex["inputs"], [4, 5, 6, 7])
  np.testing.assert_array_equal(ex["targets"], [5, 6, 7, 8])
  np.testing.assert_array_equal(ex["segment_ids"], [1, 2, 2, 2])
  np.testing.assert_array_equal(ex["positions"], [4, 0, 1, 2])  # A began earlier.
  np.testing.assert_array_equal(ex["loss_mask"], [0, 1, 1, 0])
  assert {k: v.dtype for k, v in ex.items()} == {
      "inputs": np.int32, "targets": np.int32, "segment_ids": np.int32,
      "positions": np.int32, "loss_mask": np.float32}
  ex = src[0]  # Entirely inside A; the target of the last input is in B.
  np.testing.assert_array_equal(ex["segment_ids"], [1, 1, 1, 1])
  np.testing.assert_array_equal(ex["positions"], [0, 1, 2, 3])
  np.testing.assert_array_equal(ex["loss_mask"], [1, 1, 1, 1])
  ex = src[2]  # Tokens 8..12, all in C.
  np.testing.assert_array_equal(ex["positions"], [0, 1, 2, 3])
  np.testing.assert_array_equal(ex["loss_mask"], [1, 1, 1, 1])
  with pytest.raises(IndexError):
    src[3]


def test_window_spanning_many_short_docs(tmp_path):
  src = pipeline.PackedSource(_store(tmp_path / "s", [2, 1, 2, 4]), 8)
  ex = src[0]  # Tokens 0..8 → docs 0,0 | 1 | 2,2 | 3,3,3 (+ target 8).
  np.testing.assert_array_equal(ex["segment_ids"], [1, 1, 2, 3, 3, 4, 4, 4])
  np.testing.assert_array_equal(ex["positions"], [0, 1, 0, 0, 1, 0, 1, 2])
  np.testing.assert_array_equal(ex["loss_mask"], [1, 0, 0, 1, 0, 1, 1, 1])


def test_source_pickles_without_the_memmap(tmp_path):
  src = pipeline.PackedSource(_store(tmp_path / "s", [50]), 4)
  blob = pickle.dumps(src)
  assert len(blob) < 500
  clone = pickle.loads(blob)
  assert len(clone) == len(src)
  np.testing.assert_array_equal(clone[5]["inputs"], src[5]["inputs"])


def _window_ids(batch, seq_len):
  return list(batch["inputs"][:, 0] // seq_len)  # Tokens = positions.


def _take(loader, n):
  return [next(loader) for _ in range(n)]


def _loader(prefix, seq_len, batch, seed, process_index=0, process_count=1, **kw):
  """The trainer's loader over one store (as with data.path)."""
  return MixtureLoader([Source("s", prefix, 1.0)], [Stage(0, 0, batch, seq_len, (1.0,))], seed,
                       contiguous_rows(process_index, process_count), **kw)


def test_loader_is_deterministic_in_the_seed(tmp_path):
  prefix = _store(tmp_path / "s", [30, 90, 200, 1])  # 321 tokens → 40 windows.
  a = _take(_loader(prefix, 8, 4, seed=3), 12)
  b = _take(_loader(prefix, 8, 4, seed=3, read_ahead=0), 12)
  c = _take(_loader(prefix, 8, 4, seed=4), 12)
  for x, y in zip(a, b):
    assert x.keys() == set(pipeline.KEYS)
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  assert [_window_ids(x, 8) for x in a] != [_window_ids(x, 8) for x in c]
  # One epoch of 10 batches visits each window once; the next reshuffles.
  epoch1 = sum((_window_ids(x, 8) for x in a[:10]), [])
  assert sorted(epoch1) == list(range(40))
  assert a[0]["inputs"].shape == (4, 8)


def test_process_shards_are_disjoint_over_an_epoch(tmp_path):
  prefix = _store(tmp_path / "s", [321])
  seen = []
  for p in range(2):
    loader = _loader(prefix, 8, 4, 0, p, 2)
    batches = _take(loader, 10)  # 10 batches × 2 rows × 2 processes = 40.
    assert batches[0]["inputs"].shape == (2, 8)
    seen.append(sum((_window_ids(b, 8) for b in batches), []))
  assert not set(seen[0]) & set(seen[1])
  assert sorted(seen[0] + seen[1]) == list(range(40))


def test_get_state_set_state_resumes_the_next_batch(tmp_path):
  prefix = _store(tmp_path / "s", [321])
  make = lambda **kw: _loader(prefix, 8, 4, kw.get("seed", 1), 0,
                               kw.get("count", 1))
  loader = make()
  _take(loader, 13)  # Past the first epoch boundary.
  state = loader.get_state()
  assert state["step"] == 13 and state["sequence"] == 52
  expected = _take(loader, 3)
  resumed = make()
  resumed.set_state(state)
  for x, y in zip(expected, _take(resumed, 3)):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  with pytest.raises(UserError, match="seed 1, this run's config.seed=2"):
    make(seed=2).set_state(state)
  halves = [make(count=2) for _ in range(2)]  # another process count
  halves[1]._rows = contiguous_rows(1, 2)
  for h in halves:
    h.set_state(state)
  for x in expected:
    merged = np.concatenate([next(h)["inputs"] for h in halves])
    np.testing.assert_array_equal(merged, x["inputs"])


def test_loader_errors(tmp_path):
  prefix = _store(tmp_path / "s", [33])  # 4 windows of 8.
  with pytest.raises(UserError, match="not a positive multiple"):
    next(_loader(prefix, 8, 3, 0, 0, 2))
  with pytest.raises(UserError, match="missing"):
    _loader(str(tmp_path / "nope"), 8, 4, 0)
  with pytest.raises(UserError, match="not one window of seq_len 64"):
    _loader(prefix, 64, 4, 0)
  # A batch larger than the store's 4 windows reads the next epoch, as any batch does.
  assert next(_loader(prefix, 8, 8, 0))["inputs"].shape == (8, 8)


def test_eval_batches(tmp_path):
  prefix = _store(tmp_path / "s", [10, 31])  # 5 windows of 8.
  full = pipeline.eval_batches(prefix, 8, 4, 3, process_index=0,
                               process_count=1)
  assert len(full) == 3 and full[0]["inputs"].shape == (4, 8)
  ids = sum((_window_ids(b, 8) for b in full), [])
  assert ids == [i % 5 for i in range(12)]  # Unshuffled, cycled.
  assert full[0]["loss_mask"][1].tolist() == [1, 0, 1, 1, 1, 1, 1, 1]
  again = pipeline.eval_batches(prefix, 8, 4, 3, 0, 1)
  for x, y in zip(full, again):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  halves = [pipeline.eval_batches(prefix, 8, 4, 3, p, 2) for p in range(2)]
  for b in range(3):
    merged = np.concatenate([halves[0][b]["inputs"], halves[1][b]["inputs"]])
    np.testing.assert_array_equal(merged, full[b]["inputs"])
  tiny = _store(tmp_path / "t", [8])
  with pytest.raises(UserError, match="not enough for one window"):
    pipeline.eval_batches(tiny, 8, 4, 1, 0, 1)


def test_to_global_builds_sharded_arrays(tmp_path):
  devices = jax.devices()
  assert 8 % len(devices) == 0
  mesh = Mesh(np.array(devices), ("data",))
  sharding = NamedSharding(mesh, P("data"))
  prefix = _store(tmp_path / "s", [321])
  batch = next(_loader(prefix, 8, 8, 0))
  arrays = pipeline.to_global(batch, sharding)
  assert set(arrays) == set(pipeline.KEYS)
  for k, v in arrays.items():
    assert isinstance(v, jax.Array)
    assert v.shape == (8, 8) and v.sharding == sharding
    assert v.dtype == batch[k].dtype
    np.testing.assert_array_equal(np.asarray(v), batch[k])
  assert len(arrays["inputs"].addressable_shards) == len(devices)
