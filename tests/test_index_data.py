"""tools/index_data.py and the cached built-in corpus."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from maxtrain.data import corpus, indexing
from maxtrain.data.store import TokenStore
from maxtrain.data.tokenizer import ByteTokenizer
from maxtrain.errors import UserError
from maxtrain.runtime.cache import cache_dir

REPO = Path(__file__).resolve().parents[1]
EOS = ByteTokenizer.eos_id


def _run_cli(*args):
  return subprocess.run(
      [sys.executable, str(REPO / "tools" / "index_data.py"), *map(str, args)],
      capture_output=True, text=True, cwd=REPO, timeout=60,
      # This tree's maxtrain, not an installed one (sys.path[0] is tools/).
      env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture
def text_dir(tmp_path):
  root = tmp_path / "in"
  (root / "sub").mkdir(parents=True)
  (root / "a.txt").write_text("hello wörld\n")
  (root / "sub" / "b.py").write_text("def f():\n  return 1\n")
  (root / "sub" / "empty.txt").write_text("")
  lines = [json.dumps({"text": f"record {i}", "id": i}) for i in range(30)]
  (root / "c.jsonl").write_text("\n".join(lines[:10]) + "\n\n" +
                                "\n".join(lines[10:]) + "\n")
  (root / "blob.bin").write_bytes(b"\x00\x01\x02binary")
  (root / ".hidden.txt").write_text("skipped")
  expected = {"hello wörld\n", "def f():\n  return 1\n"}
  expected |= {f"record {i}" for i in range(30)}
  return root, expected


def _docs(prefix):
  store = TokenStore.open(prefix)
  docs = [store.doc(i) for i in range(store.num_docs)]
  assert all(d[-1] == EOS and EOS not in d[:-1] for d in docs)
  return [ByteTokenizer().decode(d) for d in docs]


def _files(prefix):
  return {e: Path(prefix + e).read_bytes() for e in (".bin", ".idx", ".json")}


def test_cli_indexes_a_directory(text_dir, tmp_path, monkeypatch):
  root, expected = text_dir
  out = tmp_path / "out" / "corpus"
  r = _run_cli("--input", root, "--output", out, "--val-fraction", "0.2",
               "--workers", "1")
  assert r.returncode == 0, r.stderr
  assert "32 documents from 5 files (1 binary files skipped)" in r.stdout
  assert "MB/s" in r.stdout
  assert "zero-byte files: 1:" in r.stdout and "empty.txt" in r.stdout
  assert "invalid UTF-8" not in r.stdout
  train, val = _docs(f"{out}.train"), _docs(f"{out}.val")
  assert val and train
  assert sorted(train + val) == sorted(expected)  # No loss, no duplicates.
  header = json.loads(Path(f"{out}.train.json").read_text())
  assert header["tokenizer"] == "byte-v1" and header["num_docs"] == len(train)
  assert header["max_token_id"] == EOS  # Every document ends with EOS.
  assert header["source"]["empty_files"] == [str(root / "sub" / "empty.txt")]
  assert header["source"]["invalid_utf8_files"] == 0
  TokenStore.open(f"{out}.train").verify()

  # Same inputs and seed → byte-identical stores, even via a glob and with
  # tiny jobs (exercises .jsonl chunking).
  again = tmp_path / "again" / "corpus"
  monkeypatch.setattr(indexing, "_JOB_BYTES", 64)
  summary = indexing.index_files([str(root / "*")], str(again),
                                 val_fraction=0.2, workers=2, progress=False)
  assert summary["documents"] == 32 and summary["skipped_binary"] == 1
  for split in ("train", "val"):
    assert _files(f"{again}.{split}")[".bin"] == _files(f"{out}.{split}")[".bin"]
    assert _files(f"{again}.{split}")[".idx"] == _files(f"{out}.{split}")[".idx"]

  # Another seed, another split.
  other = indexing.index_files([str(root)], str(tmp_path / "o"),
                               val_fraction=0.2, seed=1, progress=False)
  assert sorted(_docs(other["val_prefix"])) != sorted(val)


def test_cli_builds_several_stores_in_one_call(tmp_path):
  for name, text in (("web", "a web page\n"), ("code", "def f():\n  pass\n")):
    (tmp_path / name).mkdir()
    for i in range(6):
      (tmp_path / name / f"{i}.txt").write_text(f"{text}{i}\n")
  r = _run_cli("--input", tmp_path / "web", "--output", tmp_path / "stores" / "web",
               "--input", tmp_path / "code", "--output", tmp_path / "stores" / "code",
               "--val-fraction", "0.3", "--workers", "1")
  assert r.returncode == 0, r.stderr
  assert r.stdout.count("indexed 6 documents from 6 files") == 2
  for name, word in (("web", "web page"), ("code", "def f")):
    docs = _docs(f"{tmp_path / 'stores' / name}.train") + _docs(f"{tmp_path / 'stores' / name}.val")
    assert len(docs) == 6 and all(word in d for d in docs)
  r = _run_cli("--input", tmp_path / "web", "--output", tmp_path / "a", "--output", tmp_path / "b")
  assert r.returncode == 2 and "2 --output prefixes need as many --input groups" in r.stderr


def _hf_tokenizer(path):
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(["hello world", "record 12 def f(): return"], trainer)
  tok.save(str(path))
  return str(path)


def test_worker_pool_matches_in_process(text_dir, tmp_path, monkeypatch):
  root, _ = text_dir
  tok = _hf_tokenizer(tmp_path / "tok.json")
  monkeypatch.setattr(indexing, "_JOB_BYTES", 64)  # Many jobs and .jsonl chunks.
  one = indexing.index_files([str(root)], str(tmp_path / "one"), tok, 0.2,
                             workers=1, progress=False)
  two = indexing.index_files([str(root)], str(tmp_path / "two"), tok, 0.2,
                             workers=2, progress=False)
  assert one["tokenizer"].startswith("hf:") and two["documents"] == 32
  for split in ("train", "val"):
    assert _files(str(tmp_path / f"one.{split}")) == _files(
        str(tmp_path / f"two.{split}"))


def test_unguarded_main_script_falls_back_instead_of_hanging(tmp_path):
  # Spawned workers re-run a main script that has no __main__ guard and die;
  # indexing must finish in-process rather than respawn them forever.
  script = tmp_path / "unguarded.py"
  script.write_text(
      "import sys\n"
      f"sys.path.insert(0, {str(REPO)!r})\n"
      "from maxtrain.data import indexing\n"
      "indexing._JOB_BYTES = 16\n"
      f"indexing.index_files([{str(tmp_path / 'in')!r}], "
      f"{str(tmp_path / 'o')!r}, {_hf_tokenizer(tmp_path / 't.json')!r}, "
      "workers=2, progress=False)\n"
      "print('done')\n")
  (tmp_path / "in").mkdir()
  for i in range(4):
    (tmp_path / "in" / f"{i}.txt").write_text(f"hello world {i}")
  r = subprocess.run([sys.executable, str(script)], capture_output=True,
                     text=True, timeout=60)
  assert r.returncode == 0, r.stderr
  assert "tokenizing in this process" in r.stderr
  assert r.stdout.count("done") == 1


def test_val_split_has_at_least_one_doc(tmp_path):
  src = tmp_path / "src"
  src.mkdir()
  (src / "a.txt").write_text("a")
  (src / "b.txt").write_text("b")
  s = indexing.index_files([str(src)], str(tmp_path / "o"),
                           val_fraction=1e-9, progress=False)
  assert (s["train_documents"], s["val_documents"]) == (1, 1)
  s = indexing.index_files([str(src / "a.txt")], str(tmp_path / "p"),
                           val_fraction=0.5, progress=False)
  assert (s["train_documents"], s["val_documents"]) in ((1, 0), (0, 1))
  s = indexing.index_files([str(src)], str(tmp_path / "q"),
                           val_fraction=0.0, progress=False)
  assert (s["train_documents"], s["val_documents"]) == (2, 0)


def test_split_is_a_deterministic_per_document_hash():
  scores = [indexing.val_score(0, f"f.jsonl:{i}") for i in range(2000)]
  assert scores == [indexing.val_score(0, f"f.jsonl:{i}") for i in range(2000)]
  assert 0.45 < np.mean(scores) < 0.55


def test_cli_jsonl_missing_key_names_file_and_line(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "ok"}\n\n{"body": "no text"}\n')
  r = _run_cli("--input", bad, "--output", tmp_path / "o")
  assert r.returncode == 2
  assert "bad.jsonl:3" in r.stderr and "'text'" in r.stderr
  assert not (tmp_path / "o.train.json").exists()
  r = _run_cli("--input", bad, "--output", tmp_path / "o", "--text-key", "body")
  assert r.returncode == 2 and "bad.jsonl:1" in r.stderr


def test_jsonl_line_numbers_survive_chunking(tmp_path, monkeypatch):
  monkeypatch.setattr(indexing, "_JOB_BYTES", 50)  # ~3 lines per task.
  lines = [json.dumps({"text": f"line {i}"}) for i in range(40)]
  lines[36] = "{broken"
  (tmp_path / "big.jsonl").write_text("\n".join(lines) + "\n")
  with pytest.raises(UserError, match=r"big\.jsonl:37: line is not valid JSON"):
    indexing.index_files([str(tmp_path / "big.jsonl")], str(tmp_path / "o"),
                         workers=1, progress=False)


def test_cli_empty_input_exits_2(tmp_path):
  (tmp_path / "empty").mkdir()
  r = _run_cli("--input", tmp_path / "empty", "--output", tmp_path / "o")
  assert r.returncode == 2
  assert r.stderr.startswith("index_data: error: empty corpus") and "empty" in r.stderr
  (tmp_path / "empty" / "e.txt").write_text("")
  with pytest.raises(UserError, match="empty corpus.*no non-empty documents"):
    indexing.index_files([str(tmp_path / "empty")], str(tmp_path / "o"),
                         progress=False)
  r = _run_cli("--input", tmp_path / "nope", "--output", tmp_path / "o")
  assert r.returncode == 2 and "nope" in r.stderr and "does not exist" in r.stderr


# ---- Built-in corpus ----


def _fake_stdlib(root: Path) -> Path:
  (root / "json").mkdir(parents=True)
  (root / "site-packages" / "pkg").mkdir(parents=True)
  (root / "os.py").write_text("import sys\n" * 20)
  (root / "json" / "__init__.py").write_text('"""JSON."""\n')
  (root / "json" / "decoder.py").write_text("def decode(s):\n  pass\n" * 5)
  (root / "README.txt").write_text("not python")
  (root / "site-packages" / "pkg" / "mod.py").write_text("THIRD_PARTY = 1\n")
  return root


def test_prepare_corpus_builds_reuses_and_rebuilds(tmp_path, monkeypatch):
  monkeypatch.setenv("MAXTRAIN_CACHE", str(tmp_path / "cache"))
  assert cache_dir() == tmp_path / "cache"
  root = _fake_stdlib(tmp_path / "stdlib")
  train, val = corpus.prepare_corpus("python-stdlib", val_fraction=0.3,
                                     _root=str(root))
  assert train.startswith(str(tmp_path / "cache" / "corpora" / "python-stdlib-"))
  docs = _docs(train) + _docs(val)
  assert len(docs) == 3 and _docs(val)
  assert not any("THIRD_PARTY" in d or "not python" in d for d in docs)
  header = Path(train + ".json")
  mtime = header.stat().st_mtime_ns
  source = json.loads(header.read_text())["source"]
  assert source["num_files"] == 3 and source["tokenizer"] == "byte-v1"

  # Unchanged sources: reused, not rebuilt.
  assert corpus.prepare_corpus("python-stdlib", val_fraction=0.3,
                               _root=str(root)) == (train, val)
  assert header.stat().st_mtime_ns == mtime

  # A changed file list changes the fingerprint: rebuilt in the same place.
  (root / "json" / "encoder.py").write_text("def encode(o):\n  pass\n")
  assert corpus.prepare_corpus("python-stdlib", val_fraction=0.3,
                               _root=str(root)) == (train, val)
  assert json.loads(header.read_text())["source"]["num_files"] == 4
  assert len(_docs(train) + _docs(val)) == 4
  leftovers = [p.name for p in (tmp_path / "cache" / "corpora").iterdir()
               if not p.name.endswith(".lock")]
  assert leftovers == [Path(train).parent.name]  # No half-built directories.


def test_prepare_corpus_unknown_name(tmp_path, monkeypatch):
  monkeypatch.setenv("MAXTRAIN_CACHE", str(tmp_path))
  with pytest.raises(UserError, match="python-stdlib"):
    corpus.prepare_corpus("wikipedia")
