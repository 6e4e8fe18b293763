"""Tokenizers and the memory-mapped token store."""

import json
import os

import numpy as np
import pytest

from maxtrain.data.store import StoreWriter, TokenStore
from maxtrain.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from maxtrain.errors import UserError


# ---- Tokenizers ----


def test_byte_tokenizer_round_trip():
  tok = ByteTokenizer()
  text = "héllo, wörld → 日本語 🙂\n\ttabs"
  ids = tok.encode(text)
  assert ids.dtype == np.int32
  assert ids.min() >= 0 and ids.max() < 256
  assert len(ids) == len(text.encode("utf-8"))
  assert tok.decode(ids) == text
  with_specials = np.concatenate([[tok.bos_id], ids, [tok.eos_id, tok.pad_id]])
  assert tok.decode(with_specials) == text
  assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257,
                                                                   258)
  assert tok.encode("").size == 0


def _make_hf_tokenizer(path, special_tokens=("</s>", "<pad>")):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=300, special_tokens=list(special_tokens),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(
      ["the quick brown fox", "jumps over the lazy dog", "def f(x): return x"],
      trainer)
  tok.save(str(path))
  return str(path)


def test_hf_tokenizer_round_trip_and_identity(tmp_path):
  path = _make_hf_tokenizer(tmp_path / "tokenizer.json")
  tok = load_tokenizer(path)
  assert isinstance(tok, HFTokenizer)
  text = "the quick fox jumps — ünïcode too"
  ids = tok.encode(text)
  assert ids.dtype == np.int32
  assert tok.decode(ids) == text
  assert tok.eos_id == tok._tok.token_to_id("</s>")
  assert tok.pad_id == tok._tok.token_to_id("<pad>")
  assert tok.bos_id == tok.eos_id  # No BOS token: falls back to EOS.
  assert tok.eos_id not in ids  # No specials added.
  assert tok.decode(np.append(ids, tok.eos_id)) == text
  assert tok.vocab_size == tok._tok.get_vocab_size(with_added_tokens=True)
  # Identity: stable across loads, a content hash, and accepts the directory.
  assert tok.identity.startswith("hf:") and len(tok.identity) == 3 + 64
  assert load_tokenizer(path).identity == tok.identity
  assert load_tokenizer(str(tmp_path)).identity == tok.identity
  other = _make_hf_tokenizer(tmp_path / "other.json", ("<|endoftext|>",))
  assert load_tokenizer(other).identity != tok.identity


def test_hf_tokenizer_without_eos_is_a_user_error(tmp_path):
  path = _make_hf_tokenizer(tmp_path / "tokenizer.json", ("<unk>",))
  with pytest.raises(UserError, match="end-of-text"):
    load_tokenizer(path)


def test_load_tokenizer_errors(tmp_path):
  with pytest.raises(UserError, match="missing.json"):
    load_tokenizer(str(tmp_path / "missing.json"))
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(UserError, match="bad.json"):
    load_tokenizer(str(bad))
  assert isinstance(load_tokenizer("byte"), ByteTokenizer)


# ---- Store ----


def _write(prefix, docs, vocab_size=259, identity="byte-v1"):
  with StoreWriter(prefix, vocab_size, identity, source={"test": 1}) as w:
    for d in docs:
      w.add(np.asarray(d))
  return str(prefix)


def _random_docs(rng, n=20, vocab_size=259):
  lengths = rng.integers(0, 50, size=n)
  return [rng.integers(0, vocab_size, size=k) for k in lengths]


@pytest.mark.parametrize("vocab_size,dtype", [(259, np.uint16),
                                              (65536, np.uint16),
                                              (70000, np.uint32)])
def test_store_round_trip(tmp_path, vocab_size, dtype):
  docs = _random_docs(np.random.default_rng(0), vocab_size=vocab_size)
  docs[3] = np.array([vocab_size - 1, 0])  # Largest id survives the dtype.
  prefix = _write(tmp_path / "s", docs, vocab_size)
  store = TokenStore.open(prefix)
  assert store.tokens.dtype == dtype
  assert store.header["dtype"] == np.dtype(dtype).name
  assert store.num_docs == len(docs) == len(store)
  assert store.num_tokens == sum(len(d) for d in docs)
  assert store.vocab_size == vocab_size
  assert store.tokenizer_identity == "byte-v1"
  assert store.header["source"] == {"test": 1}
  for i, d in enumerate(docs):
    np.testing.assert_array_equal(store.doc(i), d)
  assert os.path.getsize(prefix + ".bin") == store.num_tokens * np.dtype(
      dtype).itemsize
  store.verify()


def test_store_writer_rejects_out_of_vocab(tmp_path):
  with StoreWriter(tmp_path / "s", 259, "byte-v1") as w:
    with pytest.raises(ValueError):
      w.add(np.array([259]))


def test_open_is_lazy_on_a_huge_sparse_store(tmp_path):
  # A 512 MiB sparse .bin: opening must not read it.
  prefix = str(tmp_path / "huge")
  n = 2**28
  with open(prefix + ".bin", "wb") as f:
    f.truncate(n * 2)
  np.array([0, n], dtype="<u8").tofile(prefix + ".idx")
  header = {"format": "maxtrain-token-store", "version": 1, "dtype": "uint16",
            "vocab_size": 259, "tokenizer": "byte-v1", "num_docs": 1,
            "num_tokens": n, "checksum": "sha256:0", "source": None}
  with open(prefix + ".json", "w") as f:
    json.dump(header, f)
  store = TokenStore.open(prefix)
  assert isinstance(store.tokens, np.memmap)
  assert isinstance(store.offsets, np.memmap)
  assert store.num_tokens == n and int(store.tokens[n - 1]) == 0


def test_truncated_bin_is_a_user_error(tmp_path):
  prefix = _write(tmp_path / "s", [[1, 2, 3], [4, 5]])
  with open(prefix + ".bin", "r+b") as f:
    f.truncate(4)
  with pytest.raises(UserError, match=r"s\.bin.*4 bytes, expected 10.*index_data"):
    TokenStore.open(prefix)


def test_idx_header_mismatch_is_a_user_error(tmp_path):
  prefix = _write(tmp_path / "s", [[1, 2, 3], [4, 5]])
  # Same size, wrong content: the last offset no longer equals num_tokens.
  np.array([0, 3, 4], dtype="<u8").tofile(prefix + ".idx")
  with pytest.raises(UserError, match=r"s\.idx.*0 to 4, expected 0 to 5"):
    TokenStore.open(prefix)
  # Header claims another document count: the .idx size no longer fits.
  prefix = _write(tmp_path / "t", [[1, 2, 3], [4, 5]])
  with open(prefix + ".json") as f:
    header = json.load(f)
  header["num_docs"] = 3
  with open(prefix + ".json", "w") as f:
    json.dump(header, f)
  with pytest.raises(UserError, match=r"t\.idx.*24 bytes, expected 32"):
    TokenStore.open(prefix)


def test_missing_files_are_user_errors(tmp_path):
  with pytest.raises(UserError, match=r"nothing\.json.*missing"):
    TokenStore.open(str(tmp_path / "nothing"))
  prefix = _write(tmp_path / "s", [[1, 2]])
  os.remove(prefix + ".json")
  with pytest.raises(UserError, match="never finished"):
    TokenStore.open(prefix)
  prefix = _write(tmp_path / "t", [[1, 2]])
  os.remove(prefix + ".idx")
  with pytest.raises(UserError, match=r"t\.idx.*missing"):
    TokenStore.open(prefix)


def test_interrupted_writes_leave_no_store_or_keep_the_old_one(tmp_path):
  prefix = str(tmp_path / "new")
  with pytest.raises(RuntimeError), StoreWriter(prefix, 259, "byte-v1") as w:
    w.add(np.array([1]))
    raise RuntimeError("interrupted")
  assert os.listdir(tmp_path) == []
  with pytest.raises(UserError, match="missing"):
    TokenStore.open(prefix)

  old = _write(tmp_path / "old", [[1, 2]])
  w = StoreWriter(old, 259, "byte-v1")
  w.add(np.array([3, 4, 5]))
  np.testing.assert_array_equal(TokenStore.open(old).doc(0), [1, 2])
  w.abort()
  np.testing.assert_array_equal(TokenStore.open(old).doc(0), [1, 2])
  assert sorted(os.listdir(tmp_path)) == ["old.bin", "old.idx", "old.json"]
  with StoreWriter(old, 259, "byte-v1") as w:  # A finished rewrite replaces.
    w.add(np.array([3, 4, 5]))
  np.testing.assert_array_equal(TokenStore.open(old).doc(0), [3, 4, 5])
  assert sorted(os.listdir(tmp_path)) == ["old.bin", "old.idx", "old.json"]


def _flip(path, offset, mask):
  with open(path, "r+b") as f:
    f.seek(offset)
    b = f.read(1)
    f.seek(offset)
    f.write(bytes([b[0] ^ mask]))


def test_verify_catches_a_flipped_byte(tmp_path):
  docs = [np.array([10, 20, 30]), np.array([40, 258])]
  prefix = _write(tmp_path / "s", docs)
  TokenStore.open(prefix).verify()
  _flip(prefix + ".bin", 2, 0x01)  # Token 1: 20 -> 21, still a valid id.
  store = TokenStore.open(prefix)  # Sizes still match: open's checks pass.
  with pytest.raises(UserError, match="checksum"):
    store.verify()
  # A high byte: 40 -> 296, beyond the recorded max 258; named by document.
  _flip(prefix + ".bin", 7, 0x01)
  with pytest.raises(UserError, match=r"s\.bin.*document 1 holds token id 296 "
                     r"at token 0.*max_token_id=258"):
    TokenStore.open(prefix).verify()


def test_unigram_entropy_matches_numpy(tmp_path):
  rng = np.random.default_rng(2)
  docs = [rng.zipf(1.5, size=300) % 259 for _ in range(5)]
  store = TokenStore.open(_write(tmp_path / "s", docs))
  all_tokens = np.concatenate(docs)
  _, counts = np.unique(all_tokens, return_counts=True)
  p = counts / counts.sum()
  assert store.unigram_entropy() == pytest.approx(-(p * np.log(p)).sum())
  assert TokenStore.open(_write(tmp_path / "e", [])).unigram_entropy() == 0.0
