"""Mixtures of token stores (data/mixture.py, data/loader.py): exact block proportions, stages, the
single-store order kept, process-count independence and resume by index arithmetic."""

from pathlib import Path

import numpy as np
import pytest

from maxtrain.data import pipeline
from maxtrain.data.loader import MixtureLoader, contiguous_rows, process_rows
from maxtrain.data.mixture import (Mixture, Source, Stage, block_counts, block_layout, parse_sources, parse_stages,
                                   shuffle_seed)
from maxtrain.errors import UserError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def docs_store(tmp_path_factory) -> str:
  """A second small store (train + val), from the tests and docs: a different source than `store`."""
  from maxtrain.data.indexing import index_files

  prefix = tmp_path_factory.mktemp("docs_store") / "docs"
  index_files([str(REPO / "tests"), str(REPO / "docs")], str(prefix), val_fraction=0.2, workers=1, progress=False)
  return str(prefix)


def test_parse_sources_and_stages():
  sources = parse_sources("/data/web:3, /data/code ,/x/math:0.5")
  assert [(s.name, s.prefix, s.weight) for s in sources] == [("web", "/data/web", 3.0), ("code", "/data/code", 1.0),
                                                             ("math", "/x/math", 0.5)]
  names = [s.name for s in sources]
  first = Stage(0, 0, 16, 256, (3.0, 1.0, 0.5))
  stages = parse_stages("100:web=1,code=1; 300:seq_len=512; 400:math=1,batch_size=8", names, first)
  assert stages[1] == Stage(100, 1600, 16, 256, (1.0, 1.0, 0.0))
  assert stages[2] == Stage(300, 4800, 16, 512, (1.0, 1.0, 0.0))  # no weights named: kept
  assert stages[3] == Stage(400, 6400, 8, 512, (0.0, 0.0, 1.0))
  for text, culprit in (("100:wiki=1", "unknown source 'wiki'"), ("100:web=1;50:code=1", "increasing steps"),
                        ("100:web=0", "every weight is 0"), ("100:web=-1", "must be key=number >= 0"),
                        ("100:seq_len=0.5", "positive integer"), ("x:web=1", "integer STEP")):
    with pytest.raises(UserError, match=culprit):
      parse_stages(text, names, first)
  for text, culprit in (("a/web:x", "not a number"), ("a/web,b/web", "two stores 'web'"), ("a/web:-1", ">= 0")):
    with pytest.raises(UserError, match=culprit):
      parse_sources(text)


@pytest.mark.parametrize("weights", [(3.0, 5.0, 11.0), (0.3, 0.7, 1 / 7), (1.0, 1e-3), (2.0, 0.0, 1.0)])
def test_every_block_holds_exactly_its_share(weights):
  counts = block_counts(weights)
  size = sum(counts)
  total = sum(weights)
  for c, w in zip(counts, weights):  # exact shares, or within one sequence (largest remainder)
    assert abs(c - w / total * size) < 1
  for block in range(3000):
    source, rank = block_layout(7, 0, block, counts)
    assert np.bincount(source, minlength=len(counts)).tolist() == list(counts)
    for j in range(len(counts)):
      assert rank[source == j].tolist() == list(range(counts[j]))
  if counts == (57, 95, 209):  # 3:5:11 is exact: the block is a multiple of 19
    assert size % 19 == 0


def test_blocks_differ_and_depend_on_the_seed():
  counts = block_counts((1.0, 1.0))
  a, b, c = (block_layout(s, 0, k, counts)[0] for s, k in ((0, 0), (0, 1), (1, 0)))
  assert not np.array_equal(a, b) and not np.array_equal(a, c)


def _walk(m: Mixture, first: int, last: int) -> dict[int, list[int]]:
  """Per source, the per-source indices of global sequences first..last-1."""
  seen: dict[int, list[int]] = {}
  for i in range(first, last):
    j, q, _ = m.locate(i)
    seen.setdefault(j, []).append(q)
  return seen


def test_each_source_is_read_in_order_and_new_weights_hold_from_the_boundary():
  names = ["a", "b", "c"]
  stages = parse_stages("40:a=1,b=0,c=3", names, Stage(0, 0, 64, 16, (3.0, 5.0, 11.0)))
  m = Mixture(names, [10_000, 20_000, 5_000], stages, seed=3)
  boundary = stages[1].seq
  assert boundary == 40 * 64
  seen = _walk(m, 0, boundary + 4 * 256)
  for j, qs in seen.items():  # every source: consecutive indices, no repeat, no skip
    assert qs == list(range(len(qs))), names[j]
  before = np.bincount([m.locate(i)[0] for i in range(boundary)], minlength=3)
  assert before.tolist() == m._taken(0, boundary).tolist()
  after = np.bincount([m.locate(i)[0] for i in range(boundary, boundary + 4 * 256)], minlength=3)
  assert after.tolist() == [256, 0, 768]  # 1:0:3 in whole blocks of 256 from the boundary on


def _old_loader(prefix: str, seq_len: int, batch: int, seed: int):
  """The single-store loader before mixtures (data/pipeline.py's TrainLoader, one process), frozen here as
  the reference order: Grain's shuffle of the windows with the hashed seed, a fresh permutation per epoch."""
  import grain

  source = pipeline.PackedSource(prefix, seq_len)
  ds = grain.MapDataset.source(source).shuffle(seed=shuffle_seed(seed)).repeat().batch(batch, drop_remainder=True)
  return len(source), iter(ds.to_iter_dataset())


@pytest.mark.parametrize("read_ahead", [4, 0])
def test_single_source_keeps_the_single_store_order(store, read_ahead):
  prefix = store + ".train"
  num_windows, old = _old_loader(prefix, 32, 8, 5)
  new = MixtureLoader([Source("code", prefix, 1.0)], [Stage(0, 0, 8, 32, (1.0,))], 5, contiguous_rows(0, 1),
                      read_ahead=read_ahead)
  steps = num_windows // 8 + 3  # across an epoch boundary
  for _ in range(steps):
    a, b = next(old), next(new)
    for k in pipeline.KEYS:
      np.testing.assert_array_equal(a[k], b[k])


def test_read_ahead_serves_the_same_batches_across_stages_and_resumes(store, docs_store):
  sources, stages = _two_sources(store, docs_store, "3:code=1,docs=1,seq_len=16;5:seq_len=32")
  want = [MixtureLoader(sources, stages, 4, contiguous_rows(0, 1), read_ahead=0).batch_of_step(s) for s in range(8)]
  ahead = MixtureLoader(sources, stages, 4, contiguous_rows(1, 2), read_ahead=3, read_threads=2)
  got = [next(ahead) for _ in range(4)]
  ahead.set_state({**ahead.get_state()})  # restarts Grain's iterator at the saved step
  got += [next(ahead) for _ in range(4)]
  ahead.close()
  for step, (a, b) in enumerate(zip(want, got)):
    for k in pipeline.KEYS:
      np.testing.assert_array_equal(a[k][4:], b[k], err_msg=f"step {step} {k}")
  assert [b["inputs"].shape[1] for b in got] == [32, 32, 32, 16, 16, 32, 32, 32]


def _two_sources(store, docs_store, stages_text="", batch=8, seq_len=32, **kw):
  sources = [s.split("train") for s in parse_sources(f"{store}:3,{docs_store}:1")]
  names = [s.name for s in sources]
  stages = parse_stages(stages_text, names, Stage(0, 0, batch, seq_len, tuple(s.weight for s in sources)))
  return sources, stages


@pytest.mark.parametrize("stages_text", ["", "3:code=1,docs=1,seq_len=16"])
def test_global_batches_do_not_depend_on_the_process_layout(store, docs_store, stages_text):
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  sources, stages = _two_sources(store, docs_store, stages_text)
  layouts = {"1x8": [process_rows(NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data")))],
             "1x4": [process_rows(NamedSharding(Mesh(np.array(jax.devices()[:4]), ("data",)), P("data")))],
             "2x4": [contiguous_rows(p, 2) for p in range(2)], "4x2": [contiguous_rows(p, 4) for p in range(4)]}
  batches = {}
  for name, rows in layouts.items():
    loaders = [MixtureLoader(sources, stages, 11, r) for r in rows]
    batches[name] = [{k: np.concatenate([next_b[k] for next_b in per_step]) for k in pipeline.KEYS}
                     for per_step in zip(*[[next(ld) for _ in range(6)] for ld in loaders])]
  for name, got in batches.items():
    for step, (a, b) in enumerate(zip(batches["1x8"], got)):
      for k in pipeline.KEYS:
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"{name} step {step} {k}")
  assert batches["1x8"][3]["inputs"].shape == (8, 16 if stages_text else 32)  # the stage's new seq_len


def test_resume_on_another_layout_continues_the_same_batches(store, docs_store):
  sources, stages = _two_sources(store, docs_store, "4:code=1,docs=2")
  straight = MixtureLoader(sources, stages, 2, contiguous_rows(0, 1))
  want = [next(straight) for _ in range(8)]
  first = MixtureLoader(sources, stages, 2, contiguous_rows(0, 1))
  for _ in range(3):
    next(first)
  state = first.get_state()
  halves = [MixtureLoader(sources, stages, 2, contiguous_rows(p, 2)) for p in range(2)]
  for ld in halves:
    ld.set_state(state)
  for step in range(3, 8):
    got = np.concatenate([next(ld)["inputs"] for ld in halves])
    np.testing.assert_array_equal(got, want[step]["inputs"], err_msg=f"step {step}")


def test_resume_with_a_new_batch_size_or_seq_len_continues_every_source(store, docs_store):
  sources, stages = _two_sources(store, docs_store)
  first = MixtureLoader(sources, stages, 0, contiguous_rows(0, 1))
  for _ in range(5):
    next(first)
  state = first.get_state()
  _, bigger = _two_sources(store, docs_store, batch=16)
  with pytest.raises(UserError, match="resume_new_batch_size"):
    MixtureLoader(sources, bigger, 0, contiguous_rows(0, 1)).set_state(state)
  resumed = MixtureLoader(sources, bigger, 0, contiguous_rows(0, 1), allow_new_batch_size=True)
  resumed.set_state(state)
  assert resumed.sequence() == 40 and resumed.mixture.stages[-1] == Stage(5, 40, 16, 32, (3.0, 1.0))
  m = resumed.mixture
  seen = _walk(m, 0, 40 + 16 * 40)
  for qs in seen.values():
    assert qs == list(range(len(qs)))


def _targets(m: Mixture, j: int, qs, t: int) -> np.ndarray:
  """The store positions of the targets that source j's sequences qs (read in stage t) train on."""
  return np.concatenate([np.arange(a + 1, a + n + 1) for q in qs for a, n in m.pieces(j, q, t)])


def _epoch_targets(n_windows: int, seq_len: int) -> np.ndarray:
  return np.arange(1, n_windows * seq_len + 1)  # window w holds targets w * seq_len + 1 .. (w + 1) * seq_len


def test_a_seq_len_stage_resumed_from_a_256_checkpoint_reads_every_token_of_the_epoch_once(store, docs_store):
  sources, stages = _two_sources(store, docs_store, batch=8, seq_len=256)
  first = MixtureLoader(sources, stages, 0, contiguous_rows(0, 1), read_ahead=0)
  for _ in range(6):
    next(first)
  state = first.get_state()  # step 6 at seq_len 256, each source in the middle of its first epoch
  _, longer = _two_sources(store, docs_store, "6:seq_len=512", batch=8, seq_len=256)
  resumed = MixtureLoader(sources, longer, 0, contiguous_rows(0, 1), read_ahead=0)
  resumed.set_state(state)
  m = resumed.mixture
  assert [(s.step, s.seq_len) for s in m.stages] == [(0, 256), (6, 512)]
  for j, name in enumerate(m.names):
    before = int(m.done[1][j])
    recut, _ = m._remainder(j, m.cursors[1][j], 512)
    assert before > 0 and recut > 0, name  # the change lands inside the epoch
    read = np.concatenate([_targets(m, j, range(before), 0), _targets(m, j, range(before, before + recut), 1)])
    n = m.num_windows(j, 256)
    np.testing.assert_array_equal(np.sort(read), _epoch_targets(n, 256), err_msg=name)  # each once: no repeat, no skip
    after = _targets(m, j, range(before + recut, before + recut + m.num_windows(j, 512)), 1)
    np.testing.assert_array_equal(np.sort(after), _epoch_targets(m.num_windows(j, 512), 512), err_msg=name)
  for j, qs in _walk(m, 0, 48 + 8 * 600).items():  # the mixture's order: each source's sequences in turn
    assert qs == list(range(len(qs)))
  for step in range(6, 9):  # the batches hold exactly those tokens, each piece a document of its own
    batch, first_seq = resumed.batch_of_step(step), m.sequence_of_step(step)
    for r in range(8):
      j, q, t = m.locate(first_seq + r)
      pieces, store_ = m.pieces(j, q, t), resumed.stores[j]
      want = np.concatenate([np.asarray(store_.tokens[a:a + n]) for a, n in pieces])
      np.testing.assert_array_equal(batch["inputs"][r][:len(want)], want)
      assert batch["loss_mask"][r][len(want):].sum() == 0
      starts = np.cumsum([0] + [n for _, n in pieces[:-1]])
      if len(pieces) > 1:  # no piece attends to another: the segment id changes at each piece's start
        assert all(batch["segment_ids"][r][a] != batch["segment_ids"][r][a - 1] for a in starts[1:])


def test_a_recut_epoch_pads_its_last_sequence():
  names = ["a"]
  stages = parse_stages("3:seq_len=24", names, Stage(0, 0, 4, 16, (1.0,)))
  m = Mixture(names, [16 * 10 + 1], stages, seed=0)  # 10 windows of 16; 12 read before the change
  c = m.cursors[1][0]
  assert (c.epoch, c.window_len, c.offset) == (1, 16, 2 * 16)
  assert m._remainder(0, c, 24) == (6, 128)  # 8 windows of 16 left: five sequences of 24 and one of 8
  last = m.pieces(0, 12 + 5, 1)
  assert sum(n for _, n in last) == 8
  read = _targets(m, 0, range(12, 18), 1)
  np.testing.assert_array_equal(np.sort(np.concatenate([read, _targets(m, 0, range(10, 12), 0)])),
                                _epoch_targets(10, 16))
  c = m.consumed(m.sequence_of_step(3) + 6)["a"]  # the re-cut epoch read to its end
  assert c["epochs"] == 2.0 and c["tokens"] == 12 * 16 + 128 and c["sequences"] == 18
  row = pipeline.pack_pieces(np.arange(161, dtype=np.uint16), np.array([0, 161]), last, 24)
  assert row["loss_mask"].tolist() == [1.0] * 8 + [0.0] * 16 and len(set(row["segment_ids"][8:])) == 1


def test_resume_refusals(store, docs_store):
  sources, stages = _two_sources(store, docs_store)
  first = MixtureLoader(sources, stages, 0, contiguous_rows(0, 1))
  next(first)
  state = first.get_state()
  with pytest.raises(UserError, match="seed 0"):
    MixtureLoader(sources, stages, 1, contiguous_rows(0, 1)).set_state(state)
  one = [sources[0]]
  with pytest.raises(UserError, match="sources code, docs"):
    MixtureLoader(one, [Stage(0, 0, 8, 32, (1.0,))], 0, contiguous_rows(0, 1)).set_state(state)
  state["sources"]["docs"]["num_tokens"] += 1
  with pytest.raises(UserError, match="windows changed"):
    MixtureLoader(sources, stages, 0, contiguous_rows(0, 1)).set_state(state)


def test_old_single_store_state_resumes(store):
  prefix = store + ".train"
  num_windows, old = _old_loader(prefix, 32, 8, 5)
  for _ in range(4):
    next(old)
  new = MixtureLoader([Source("code", prefix, 1.0)], [Stage(0, 0, 8, 32, (1.0,))], 5, contiguous_rows(0, 1))
  new.set_state({"next_index": 4, "seq_len": 32, "global_batch_size": 8, "seed": 5, "process_count": 1,
                 "num_examples": num_windows})  # what the single-store loader saved
  np.testing.assert_array_equal(next(new)["inputs"], next(old)["inputs"])


def test_accounting_counts_tokens_sequences_and_epochs(store, docs_store):
  sources, stages = _two_sources(store, docs_store)
  ld = MixtureLoader(sources, stages, 0, contiguous_rows(0, 1))
  for _ in range(64):  # 512 sequences: two whole blocks of 256 at 3:1
    next(ld)
  c = ld.consumed()
  assert c["code"]["sequences"] == 384 and c["docs"]["sequences"] == 128
  assert c["code"]["tokens"] == 384 * 32
  n_docs = ld.mixture.num_windows(1, 32)
  assert c["docs"]["epochs"] == pytest.approx(128 / n_docs)


def test_store_refusals(store, docs_store, tmp_path):
  from maxtrain.data.store import StoreWriter

  sources, stages = _two_sources(store, docs_store)
  with pytest.raises(UserError, match="model.vocab_size=200"):
    MixtureLoader(sources, stages, 0, contiguous_rows(0, 1), vocab_size=200)
  with StoreWriter(tmp_path / "other", 300, "other-tokenizer") as w:
    w.add(np.arange(100))
  with StoreWriter(tmp_path / "empty", 256, "byte-v1") as w:
    pass
  for prefix, culprit in ((tmp_path / "other", "source 'other'.*tokenizer other-tokenizer"),
                          (tmp_path / "empty", "source 'empty'.*is empty")):
    srcs = [sources[0], Source(Path(prefix).name, str(prefix), 1.0)]
    with pytest.raises(UserError, match=culprit):
      MixtureLoader(srcs, [Stage(0, 0, 8, 32, (1.0, 1.0))], 0, contiguous_rows(0, 1))


# End to end, through `python -m maxtrain.train` (real subprocesses, 8 or 4 fake devices).

from test_checkpoint import trainer as _trainer  # noqa: E402
from tiny import TINY_MODEL  # noqa: E402

TINY = TINY_MODEL + ["--config.eval.every_steps=0", "--config.log_every=4", "--config.checkpoint.every_steps=4"]


def _scalars(out: Path) -> dict[str, dict[int, float]]:
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  events = EventAccumulator(str(out / "tensorboard"))
  events.Reload()
  return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def _data_state(out: Path, step: int) -> dict:
  import json

  return json.loads((out / "checkpoints" / str(step) / "data" / "metadata").read_text())


def test_two_source_run_reports_each_source(store, docs_store, tmp_path):
  import json

  out = tmp_path / "run"
  # 3:1 mixes in blocks of 256 sequences: 32 steps of 8 are exactly one block.
  done = _trainer(TINY + [f"--config.data.sources={store}:3,{docs_store}", "--config.steps=32",
                          "--config.data.max_epochs=0.001", f"--config.output_dir={out}"])
  assert done.returncode == 0, done.stderr[-3000:]
  tb = _scalars(out)
  tokens = {name: tb[f"data/{name}/tokens"][32] for name in ("code", "docs")}
  assert tokens["code"] / sum(tokens.values()) == pytest.approx(0.75, abs=0.01)
  assert sum(tokens.values()) == 32 * 8 * 32
  for name in ("code", "docs"):
    assert tb[f"data/{name}/epochs"][32] > 0 and tb[f"data/{name}/sequences"][32] > 0
    assert np.isfinite(tb[f"eval/{name}/loss"][32]) and 0 < tb[f"eval/{name}/bits_per_byte"][32] < 16
  repeats = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()
             if '"data_repeat"' in line]
  assert {r["source"] for r in repeats} == {"code", "docs"}  # each warned once
  assert _data_state(out, 32)["sources"]["code"]["tokens"] == tokens["code"]
  # 1e-4 epochs: the stores are built from this repository's sources (~0.8M tokens each and growing), so 4 steps
  # of 1024 tokens pass it by a wide margin (at 1e-3 the code store's 3/4 share, 768 tokens, no longer did).
  stopped = _trainer(TINY + [f"--config.data.sources={store}:3,{docs_store}", "--config.steps=4",
                             "--config.data.max_epochs=0.0001", "--config.data.stop_at_max_epochs=true",
                             f"--config.output_dir={tmp_path / 'stop'}"])
  assert stopped.returncode == 3, stopped.stderr[-3000:]
  assert "data.max_epochs" in stopped.stderr


# The straight 8-step run and the first 4 steps of a stopped one, on 8 devices: shared by the two tests that resume
# the stopped run elsewhere (4 devices; 2 processes x 2 devices). The stage at 6 changes the weights and seq_len.
ELASTIC_MIX = TINY + ["--config.log_every=1", "--config.data.stages=6:code=1,docs=1,seq_len=16"]


@pytest.fixture(scope="module")
def elastic_runs(store, docs_store, tmp_path_factory):
  base = tmp_path_factory.mktemp("elastic")
  mix = ELASTIC_MIX + [f"--config.data.sources={store}:3,{docs_store}:1"]
  for name, steps in (("straight", 8), ("first", 4)):
    done = _trainer(mix + [f"--config.steps={steps}", f"--config.output_dir={base / name}"], devices=8)
    assert done.returncode == 0, done.stderr[-3000:]
  return mix, base / "straight", base / "first"


def _resume_copy(elastic_runs, out: Path) -> tuple[list[str], Path]:
  """A copy of the stopped run's directory, to resume on another layout; the straight run's directory."""
  import shutil

  mix, straight, first = elastic_runs
  shutil.copytree(first, out)
  return mix + ["--config.steps=8", f"--config.output_dir={out}"], straight


def _assert_same_run(straight: Path, out: Path) -> None:
  assert _data_state(out, 8) == _data_state(straight, 8)  # same step, sequence, stage table, per-source counts
  a, b = _scalars(straight), _scalars(out)
  steps = list(range(1, 9))
  assert sorted(a["train/loss"]) == steps and sorted(b["train/loss"]) == steps
  np.testing.assert_allclose([b["train/loss"][s] for s in steps], [a["train/loss"][s] for s in steps], rtol=1e-5)


def test_elastic_resume_on_fewer_devices_matches_the_straight_run(elastic_runs, tmp_path):
  args, straight = _resume_copy(elastic_runs, tmp_path / "elastic")
  resumed = _trainer(args, devices=4)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  _assert_same_run(straight, tmp_path / "elastic")


def test_a_seq_len_stage_resumes_a_256_run_through_the_entry_point(store, docs_store, tmp_path):
  mix = TINY + [f"--config.data.sources={store}:3,{docs_store}:1", "--config.data.seq_len=256",
                f"--config.output_dir={tmp_path / 'run'}"]
  first = _trainer(mix + ["--config.steps=4"])
  assert first.returncode == 0, first.stderr[-3000:]
  longer = _trainer(mix + ["--config.steps=6", "--config.data.stages=4:seq_len=512"])
  assert longer.returncode == 0, longer.stderr[-3000:]
  assert "a new stage starts at sequence 32" in longer.stderr
  state = _data_state(tmp_path / "run", 6)
  assert [(s["step"], s["seq_len"]) for s in state["stages"]] == [(0, 256), (4, 512)]
  _each_window_once(state)  # both sources continue where the 256 run stood: no target token read twice


def test_bad_mixture_configs_exit_2_naming_the_culprit(store, docs_store, capsys):
  from maxtrain.cli import train

  for args, culprit in (([f"--config.data.sources={store}:3,{docs_store}", "--config.data.stages=4:wiki=1"],
                         "unknown source 'wiki'"),
                        ([f"--config.data.sources={store}:0,{docs_store}:0"], "every weight is 0"),
                        ([f"--config.data.sources={store},{docs_store}", "--config.data.stages=4:seq_len=4096"],
                         "seq_len=4096"),
                        ([f"--config.data.sources={store},{docs_store}", "--config.model.vocab_size=128"],
                         "code.train.*vocab_size=128"),
                        ([f"--config.data.path={store}", "--config.data.stages=4:batch_size=12"],
                         r"stages at step 4 \(batch_size=12.*not divisible by the batch shards")):
    assert train.main(TINY + args) == 2
    captured = capsys.readouterr()
    assert __import__("re").search(culprit, captured.out + captured.err), (culprit, captured.err[-2000:])


@pytest.mark.slow
def test_resume_on_two_processes_matches_the_straight_run(elastic_runs, tmp_path):
  from test_multiprocess import free_port, start

  args, straight = _resume_copy(elastic_runs, tmp_path / "elastic")
  port = free_port()  # continue on 2 processes x 2 devices
  procs = [start(args + ["--config.runtime.num_processes=2", f"--config.runtime.process_id={i}",
                         f"--config.runtime.coordinator=127.0.0.1:{port}"], devices=2) for i in range(2)]
  for p in procs:
    output = p.communicate(timeout=600)[0]
    assert p.returncode == 0, output[-3000:]
  _assert_same_run(straight, tmp_path / "elastic")


def _each_window_once(state: dict) -> None:
  """The checkpoint's data state: every source's sequences up to the saved one were its next ones in turn, no
  target token read twice within the source's first epoch, and the saved counts are theirs."""
  names = list(state["sources"])
  stages = [Stage.from_json(s) for s in state["stages"]]
  m = Mixture(names, [state["sources"][n]["num_tokens"] for n in names], stages, state["seed"])
  seen = _walk(m, 0, state["sequence"])
  for j, name in enumerate(names):
    qs = seen.get(j, [])
    assert qs == list(range(len(qs))), name
    read = np.concatenate([_targets(m, j, [q], m.locate(i)[2]) for i in range(state["sequence"])
                           for q in [m.locate(i)[1]] if m.locate(i)[0] == j])
    assert len(np.unique(read)) == len(read) and state["sources"][name]["sequences"] == len(qs), name
    assert state["sources"][name]["tokens"] == len(read), name


def test_batch_ramp_and_resume_with_a_new_batch_size_read_each_window_once(store, docs_store, tmp_path, capsys):
  # The batch doubles at step 4 (8 -> 16): with microbatch_size=1 on 8 devices the step accumulates 1, then
  # 2 microbatches, so the ramp rebuilds the step from the stage's config.
  mix = TINY + [f"--config.data.sources={store}:3,{docs_store}:1", "--config.optimizer.microbatch_size=1",
                "--config.log_every=1", "--config.steps=8"]
  ramp = _trainer(mix + ["--config.data.stages=4:batch_size=16", f"--config.output_dir={tmp_path / 'ramp'}"])
  assert ramp.returncode == 0, ramp.stderr[-3000:]
  state = _data_state(tmp_path / "ramp", 8)
  assert state["sequence"] == 4 * 8 + 4 * 16
  _each_window_once(state)
  tb = _scalars(tmp_path / "ramp")
  seen = [4 * 8 * 32 * min(s, 4) / 4 + 16 * 32 * max(0, s - 4) for s in range(1, 9)]  # tokens seen by step s
  assert [tb["data/tokens"][s] for s in range(1, 9)] == seen
  assert "accumulates 2 microbatches" in ramp.stderr
  # The same run stopped at 4 and resumed at batch 16 (data.resume_new_batch_size): the same windows.
  out = tmp_path / "resumed"
  first = _trainer(mix + ["--config.steps=4", f"--config.output_dir={out}"])
  assert first.returncode == 0, first.stderr[-3000:]
  from maxtrain.cli import train  # in process: the refusal comes before compiling

  assert train.main(mix + ["--config.data.batch_size=16", f"--config.output_dir={out}"]) == 2
  assert "data.resume_new_batch_size=true" in capsys.readouterr().err
  resumed = _trainer(mix + ["--config.data.batch_size=16", "--config.data.resume_new_batch_size=true",
                            f"--config.output_dir={out}"])
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert _data_state(out, 8) == state
  b = _scalars(out)
  assert [b["data/tokens"][s] for s in range(5, 9)] == seen[4:]
  np.testing.assert_allclose([b["train/loss"][s] for s in range(1, 9)], [tb["train/loss"][s] for s in range(1, 9)],
                             rtol=1e-5)
