"""Token-store integrity: damaged offsets, out-of-range ids, --verify, --errors.

Stores here are real files; the CLI runs as a real subprocess. Every failing
CLI case asserts exit 2, one line on stderr, no traceback, and the culprit
named.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from maxtrain.data import pipeline
from maxtrain.data.loader import MixtureLoader, contiguous_rows
from maxtrain.data.mixture import Mixture, Source, Stage
from maxtrain.data import store as store_lib
from maxtrain.data.store import StoreWriter, TokenStore
from maxtrain.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def _write(prefix, docs, vocab_size=259):
  with StoreWriter(prefix, vocab_size, "test") as w:
    for d in docs:
      w.add(np.asarray(d))
  return str(prefix)


def _docs(num_docs=40, length=25, vocab_size=259, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 200, size=length) % vocab_size
          for _ in range(num_docs)]


def _poke_token(prefix, position, value):
  """Overwrites one token of a finished store, as a later edit of the file would."""
  header = json.loads(Path(prefix + ".json").read_text())
  tokens = np.memmap(prefix + ".bin", dtype=header["dtype"], mode="r+")
  tokens[position] = value
  tokens.flush()
  del tokens


def _cli(*args, cwd=REPO):
  return subprocess.run(
      [sys.executable, str(REPO / "tools" / "index_data.py"), *map(str, args)],
      capture_output=True, text=True, cwd=cwd, timeout=60)


def _assert_exit2(r, *named):
  assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
  assert "Traceback" not in r.stderr
  assert len(r.stderr.strip().splitlines()) == 1, r.stderr
  assert r.stderr.startswith("index_data: error: ")
  for text in named:
    assert text in r.stderr, (text, r.stderr)


# ---- Offsets, checked at open ----


def _set_offset(prefix, i, value):
  offsets = np.fromfile(prefix + ".idx", dtype="<u8")
  offsets[i] = value
  offsets.tofile(prefix + ".idx")


def test_non_monotonic_middle_offset_is_refused_at_open(tmp_path):
  prefix = _write(tmp_path / "s", [[1, 2, 3]] * 6)  # Offsets 0, 3, ..., 18.
  _set_offset(prefix, 3, 4)  # Document 3 "starts" inside document 1.
  with pytest.raises(UserError, match=r"s\.idx.*offset 3 \(start of document "
                     r"3\) is 4, before the previous offset 6.*index_data"):
    TokenStore.open(prefix)


def test_middle_offset_beyond_the_bin_is_refused_at_open(tmp_path):
  prefix = _write(tmp_path / "s", [[1, 2, 3]] * 6)
  _set_offset(prefix, 2, 10**12)
  with pytest.raises(UserError, match=r"s\.idx.*offset 2 \(start of document "
                     r"2\) is 1000000000000, beyond the 18 tokens"):
    TokenStore.open(prefix)


def test_offset_check_spans_chunks(tmp_path, monkeypatch):
  # Small chunks: a decrease across a chunk boundary is still seen.
  monkeypatch.setattr(store_lib, "_IDX_CHUNK", 4)
  prefix = _write(tmp_path / "s", [[1]] * 20)
  TokenStore.open(prefix)
  _set_offset(prefix, 8, 7)  # offsets[7] == 7 == offsets[8]: an empty doc, fine.
  TokenStore.open(prefix)
  _set_offset(prefix, 9, 6)  # offsets[9] < offsets[8], at a chunk edge.
  with pytest.raises(UserError, match=r"offset 9 \(start of document 9\) is 6"):
    TokenStore.open(prefix)


# ---- Token ids: the header's maximum and check_vocab ----


def test_header_records_max_id_and_check_vocab(tmp_path):
  prefix = _write(tmp_path / "s", [[1, 2], [258, 5]])
  store = TokenStore.open(prefix)
  assert store.header["max_token_id"] == 258 and store.max_token_id_recorded
  store.check_vocab(259)
  with pytest.raises(UserError) as e:
    store.check_vocab(256)
  msg = str(e.value)
  assert prefix in msg and "token id 258" in msg and "model.vocab_size=256" in msg
  assert "vocab_size to at least 259" in msg
  empty = TokenStore.open(_write(tmp_path / "e", []))
  assert empty.header["max_token_id"] is None
  empty.check_vocab(1)


def _strip_max(prefix):
  header = json.loads(Path(prefix + ".json").read_text())
  del header["max_token_id"]
  Path(prefix + ".json").write_text(json.dumps(header))


def test_old_header_without_max_id_still_opens(tmp_path, monkeypatch):
  prefix = _write(tmp_path / "old", [[1, 2], [300, 5]], vocab_size=512)
  _strip_max(prefix)
  store = TokenStore.open(prefix)
  assert not store.max_token_id_recorded
  np.testing.assert_array_equal(store.doc(1), [300, 5])
  scans = []
  monkeypatch.setattr(TokenStore, "_scan_max",
                      lambda self: scans.append(1) or 300)
  assert store.max_token_id == 300  # Found by a scan ...
  with pytest.raises(UserError, match=r"old'? holds token id 300 \(found by "
                     r"scanning it\), >= model.vocab_size=259"):
    TokenStore.open(prefix).check_vocab(259)
  assert len(scans) == 1  # ... once per process, not once per open.
  store.verify()


def test_header_max_id_must_be_consistent(tmp_path):
  prefix = _write(tmp_path / "s", [[1, 2]])
  header = json.loads(Path(prefix + ".json").read_text())
  for bad in (259, -1, "7", True):
    header["max_token_id"] = bad
    Path(prefix + ".json").write_text(json.dumps(header))
    with pytest.raises(UserError, match=r"s\.json.*max_token_id="):
      TokenStore.open(prefix)


# ---- Per-batch checks in the loaders ----


def test_first_bad_token_sees_every_window_token():
  batch = {"inputs": np.zeros((3, 4), np.int32),
           "targets": np.zeros((3, 4), np.int32)}
  assert pipeline.first_bad_token(batch, 5) is None
  batch["targets"][2, -1] = 5  # The window's last token: only in targets.
  assert pipeline.first_bad_token(batch, 5) == (2, 4, 5)
  batch["inputs"][1, 2] = -3  # A uint32 id that wrapped in int32.
  assert pipeline.first_bad_token(batch, 5) == (1, 2, 2**32 - 3)


def _loader(prefix, seq_len, batch, seed, p=0, count=1, **kw):
  return MixtureLoader([Source("s", prefix, 1.0)],
                       [Stage(0, 0, batch, seq_len, (1.0,))], seed,
                       contiguous_rows(p, count), **kw)


def test_window_order_replays_the_loader(tmp_path):
  # The mixture's window of each global sequence names the rows the loader
  # (read ahead by Grain) served: what a bad-id error reports.
  prefix = _write(tmp_path / "s", [np.arange(321) % 259])
  for p in range(2):
    loader = _loader(prefix, 8, 4, 5, p, 2)
    m = loader.mixture
    for b in range(25):  # Past two epoch boundaries (40 windows per epoch).
      batch = next(loader)
      for r in range(2):
        window = m.window(0, b * 4 + p * 2 + r, 8)
        np.testing.assert_array_equal(
            batch["inputs"][r], loader.stores[0].tokens[window * 8:][:8])


def test_a_bad_id_at_a_recut_piece_boundary_is_caught_and_located(tmp_path):
  # After a seq_len change mid-epoch a row joins pieces of several windows; the
  # last target of a piece that is not the row's last is checked too.
  prefix = _write(tmp_path / "s", [np.arange(161) % 200])
  loader = MixtureLoader([Source("s", prefix, 1.0)], [Stage(0, 0, 4, 16, (1.0,)), Stage(3, 12, 4, 32, (1.0,))],
                         0, contiguous_rows(0, 1), read_ahead=0)
  m = loader.mixture
  j, q, t = m.locate(12)
  pieces = m.pieces(j, q, t)
  assert len(pieces) == 2
  position = pieces[0][0] + pieces[0][1]  # the first piece's last target: in no row's inputs
  _poke_token(prefix, position, 300)
  doc = TokenStore.open(prefix).doc_at(position)
  with pytest.raises(UserError, match=f"document {doc} \\(token {position} of"):
    loader.batch_of_step(3)


def test_id_poked_after_indexing_is_caught_per_batch(tmp_path):
  docs = _docs(num_docs=40, length=25, vocab_size=65536)  # 1000 tokens.
  prefix = _write(tmp_path / "s", docs, vocab_size=65536)
  # Document 17, token 6; the header still says max 199 < 512, so only the
  # per-batch check can see it. (Poked before the loader starts: Grain reads
  # ahead, so a poke while it runs may land behind what it already read.)
  _poke_token(prefix, 17 * 25 + 6, 40000)
  # The train loader refuses a store whose tokenizer outgrows the model, so
  # it reads the same documents from a store of 512 ids; the error comes
  # from Grain's read-ahead thread, raised when its batch is asked for.
  small = _write(tmp_path / "small", docs, vocab_size=512)
  _poke_token(small, 17 * 25 + 6, 40000)
  loader = _loader(small, 8, 4, 0, vocab_size=512)
  with pytest.raises(UserError) as e:
    for _ in range(31):  # One epoch: 124 windows, 31 batches.
      next(loader)
  msg = str(e.value)
  assert f"token store {small!r}" in msg
  assert "document 17 (token 6 of the document) holds token id 40000" in msg
  assert ">= model.vocab_size=512" in msg and "--verify" in msg
  # Eval batches: the same check, the same document.
  with pytest.raises(UserError, match=r"document 17 \(token 6"):
    pipeline.eval_batches(prefix, 8, 4, 31, 0, 1, vocab_size=512)
  # Without vocab_size, the store's own vocabulary is the bound.
  pipeline.eval_batches(prefix, 8, 4, 31, 0, 1)
  _poke_token(prefix, 3, 65535)
  pipeline.eval_batches(prefix, 8, 4, 1, 0, 1)  # 65535 < 65536: legal.


def test_uint32_id_beyond_int32_is_caught(tmp_path):
  prefix = _write(tmp_path / "s", _docs(num_docs=4, length=10), 70000)
  _poke_token(prefix, 12, 2**32 - 16)  # Wraps negative as int32.
  with pytest.raises(UserError, match=r"document 1 \(token 2 of the document\) "
                     r"holds token id 4294967280, >= the store's vocab_size=70000"):
    pipeline.eval_batches(prefix, 8, 4, 1, 0, 1)


def test_loader_refuses_a_store_beyond_the_model_vocab(tmp_path):
  prefix = _write(tmp_path / "s", _docs(num_docs=4, length=20))
  with pytest.raises(UserError, match=r"tokenizer of 259 ids.*model.vocab_size=128"):
    _loader(prefix, 8, 4, 0, vocab_size=128)
  with pytest.raises(UserError, match=r"holds token id 199.*model.vocab_size=128"):
    pipeline.eval_batches(prefix, 8, 4, 1, 0, 1, vocab_size=128)


# ---- tools/index_data.py --verify ----


def test_verify_cli(tmp_path):
  prefix = _write(tmp_path / "s", _docs(num_docs=10, length=30))
  r = _cli("--verify", prefix)
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith("OK ") and len(r.stdout.strip().splitlines()) == 1
  assert "10 docs, 300 tokens, max id" in r.stdout

  _poke_token(prefix, 4 * 30 + 7, 250)  # < vocab 259, > the recorded max 199.
  _assert_exit2(_cli("--verify", prefix), "s.bin", "document 4 holds token id "
                "250 at token 7", "max_token_id=199")

  good = _write(tmp_path / "g", _docs(num_docs=10, length=30))
  _poke_token(good, 5, 3)  # Still in range: only the checksum can tell.
  _assert_exit2(_cli("--verify", good), "g.bin", "checksum")

  offs = _write(tmp_path / "o", _docs(num_docs=10, length=30))
  _set_offset(offs, 5, 1)
  _assert_exit2(_cli("--verify", offs), "o.idx", "document 5")

  _assert_exit2(_cli("--verify", tmp_path / "missing"), "missing.json")


def test_verify_cli_takes_the_output_prefix(tmp_path):
  src = tmp_path / "in"
  src.mkdir()
  for i in range(4):
    (src / f"{i}.txt").write_text(f"document {i} " * 10)
  assert _cli("--input", src, "--output", tmp_path / "c",
              "--val-fraction", "0.3").returncode == 0
  r = _cli("--verify", tmp_path / "c")
  assert r.returncode == 0, r.stderr
  assert "c.train:" in r.stdout and "c.val:" in r.stdout


# ---- Non-UTF-8, zero-byte and unwritable: tools/index_data.py ----


@pytest.fixture
def dirty_dir(tmp_path):
  root = tmp_path / "in"
  root.mkdir()
  (root / "good.txt").write_text("plain text\n")
  (root / "latin1.txt").write_bytes(b"caf\xe9 cr\xe8me\n")  # 2 bad bytes.
  (root / "zero.txt").write_bytes(b"")
  lines = [json.dumps({"text": f"record {i}"}).encode() for i in range(4)]
  lines[2] = b'{"text": "bad \xff byte"}'
  lines[3] = b'{"text": "lone \\ud800 surrogate"}'
  (root / "d.jsonl").write_bytes(b"\n".join(lines) + b"\n")
  return root


def test_errors_strict_names_file_and_byte(dirty_dir, tmp_path):
  r = _cli("--input", dirty_dir / "latin1.txt", "--output", tmp_path / "o",
           "--errors=strict")
  _assert_exit2(r, "latin1.txt", "not valid UTF-8 at byte 3", "--errors=replace")
  assert not (tmp_path / "o.train.json").exists()
  r = _cli("--input", dirty_dir / "d.jsonl", "--output", tmp_path / "o",
           "--errors=strict")
  first_bad = len(b"\n".join(l for l in (dirty_dir / "d.jsonl").read_bytes()
                             .split(b"\n")[:2])) + 1 + len(b'{"text": "bad ')
  _assert_exit2(r, "d.jsonl:3:", f"not valid UTF-8 at byte {first_bad}")
  (dirty_dir / "latin1.txt").unlink()
  lines = (dirty_dir / "d.jsonl").read_bytes().split(b"\n")
  (dirty_dir / "d.jsonl").write_bytes(b"\n".join(lines[:2] + lines[3:]))
  r = _cli("--input", dirty_dir, "--output", tmp_path / "o", "--errors=strict")
  _assert_exit2(r, "d.jsonl:3:", "lone surrogate")


def test_errors_replace_counts_per_file(dirty_dir, tmp_path):
  r = _cli("--input", dirty_dir, "--output", tmp_path / "o",
           "--val-fraction", "0")
  assert r.returncode == 0, r.stderr
  assert "invalid UTF-8 (--errors=replace): 2 files, 4 invalid sequences" in r.stdout
  assert "latin1.txt (2, first at byte 3)" in r.stdout
  assert "d.jsonl (2, first at byte" in r.stdout
  assert "zero-byte files: 1:" in r.stdout and "zero.txt" in r.stdout
  source = json.loads((tmp_path / "o.train.json").read_text())["source"]
  assert source["errors"] == "replace" and source["invalid_utf8_files"] == 2
  assert {Path(p).name: e["count"] for p, e in source["invalid_utf8"].items()
          } == {"latin1.txt": 2, "d.jsonl": 2}
  assert [Path(p).name for p in source["empty_files"]] == ["zero.txt"]
  store = TokenStore.open(tmp_path / "o.train")
  texts = [bytes(store.doc(i)[:-1].astype(np.uint8)).decode()
           for i in range(store.num_docs)]
  assert "caf\ufffd cr\ufffdme\n" in texts
  assert "bad \ufffd byte" in texts and "lone \ufffd surrogate" in texts
  assert len(texts) == 6


def test_errors_skip_leaves_documents_out(dirty_dir, tmp_path):
  r = _cli("--input", dirty_dir, "--output", tmp_path / "o",
           "--val-fraction", "0", "--errors=skip")
  assert r.returncode == 0, r.stderr
  assert "invalid UTF-8 (--errors=skip): 2 files, 3 documents skipped" in r.stdout
  assert "zero-byte files: 1:" in r.stdout
  store = TokenStore.open(tmp_path / "o.train")
  assert store.num_docs == 3  # good.txt, records 0 and 1.
  source = json.loads((tmp_path / "o.train.json").read_text())["source"]
  assert source["errors"] == "skip" and source["invalid_utf8_count"] == 3


def test_unwritable_output_exits_2(tmp_path):
  (tmp_path / "a.txt").write_text("text")
  blocker = tmp_path / "file"
  blocker.write_text("")
  r = _cli("--input", tmp_path / "a.txt", "--output", blocker / "sub" / "o")
  _assert_exit2(r, str(blocker), "--output")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "file"]


def test_usage_errors_are_one_line(tmp_path):
  _assert_exit2(_cli("--output", tmp_path / "o"), "--input")
  _assert_exit2(_cli("--input", "x", "--output", "o", "--errors=ignore"),
                "--errors", "strict")
  (tmp_path / "a.txt").write_text("text")
  _assert_exit2(_cli("--input", tmp_path / "a.txt", "--output", tmp_path / "o",
                     "--tokenizer", tmp_path / "nope.json"), "nope.json")


# ---- Through the real entry point ----


def _copy_store(src, dst):
  for split in ("train", "val"):
    for ext in ("bin", "idx", "json"):
      Path(f"{dst}.{split}.{ext}").write_bytes(
          Path(f"{src}.{split}.{ext}").read_bytes())
  return str(dst)


@pytest.mark.parametrize("split", ["val", "train"])
def test_trainer_exits_2_on_an_id_poked_after_indexing(store, tmp_path, capsys,
                                                       split):
  # val: found while the eval batches are built, before compiling; train: in
  # the first training batch. Either way exit 2 naming the store and document,
  # never a NaN run.
  from maxtrain.cli import train
  from tiny import TINY_MODEL

  prefix = _copy_store(store, tmp_path / "poked")
  target = TokenStore.open(f"{prefix}.{split}")
  seq_len = 32  # TINY_MODEL's.
  # A window the run reads first: eval reads windows 0, 1, ...; training
  # starts with the first window of the seed's order.
  window = 5 if split == "val" else Mixture(
      ["poked"], [target.num_tokens], [Stage(0, 0, 16, seq_len, (1.0,))],
      0).window(0, 0, seq_len)
  position = window * seq_len + 7
  doc = target.doc_at(position)
  _poke_token(target.prefix, position, 1000)
  code = train.main(TINY_MODEL + [f"--config.data.path={prefix}",
                                  f"--config.output_dir={tmp_path / 'out'}",
                                  "--config.seed=0", "--config.steps=2"])
  err = capsys.readouterr().err
  assert code == 2, err
  assert f"poked.{split}" in err and "holds token id 1000" in err
  assert (f"document {doc} (token {position - int(target.offsets[doc])} of "
          "the document)") in err
  assert "Traceback" not in err
