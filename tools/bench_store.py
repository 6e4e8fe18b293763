"""Costs of the token-store integrity checks, on this machine.

Builds the embedded python-stdlib corpus (1x) in a temporary cache, a 10x store
of the same documents repeated, and a store of many one-token documents (a
large .idx), then prints: open time (every offset checked), check_vocab with
and without `max_token_id` in the header, a full --verify, and the per-batch
id check of the loaders for a few batch shapes.

Usage: python tools/bench_store.py [--many-docs 10000000] [--repeats 20]
"""

import argparse
import json
import os
import platform
import shutil
import tempfile

import numpy as np

import harness
from maxtrain.data import corpus, pipeline
from maxtrain.data import store as store_lib
from maxtrain.data.store import StoreWriter, TokenStore


def _median_s(fn, repeats: int) -> float:
  """Median wall seconds of `repeats` calls, no warm-up: the first open is part of what is measured."""
  return harness.repeated(fn, repeats, warmup=0).wall


def _repeat_store(src: TokenStore, prefix: str, times: int) -> None:
  with StoreWriter(prefix, src.vocab_size, src.tokenizer_identity,
                   {"repeat_of": src.prefix, "times": times}) as w:
    for _ in range(times):
      for i in range(src.num_docs):
        w.add(src.doc(i))


def _many_docs_store(prefix: str, num_docs: int) -> None:
  """num_docs one-token documents, written directly (StoreWriter per doc is slow)."""
  np.zeros(num_docs, "<u2").tofile(prefix + ".bin")
  np.arange(num_docs + 1, dtype="<u8").tofile(prefix + ".idx")
  header = {"format": store_lib.FORMAT, "version": store_lib.VERSION,
            "dtype": "uint16", "vocab_size": 259, "tokenizer": "byte-v1",
            "num_docs": num_docs, "num_tokens": num_docs,
            "checksum": "sha256:unused", "max_token_id": 0, "source": None}
  with open(prefix + ".json", "w") as f:
    json.dump(header, f)


def _without_max(prefix: str, dst: str) -> None:
  for ext in (".bin", ".idx"):
    os.symlink(os.path.abspath(prefix + ext), dst + ext)
  with open(prefix + ".json") as f:
    header = json.load(f)
  del header["max_token_id"]
  with open(dst + ".json", "w") as f:
    json.dump(header, f)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--many-docs", type=int, default=10_000_000)
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args()
  print(f"machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"{platform.processor() or platform.platform()}; Python "
        f"{platform.python_version()}, numpy {np.__version__}")
  tmp = tempfile.mkdtemp(prefix="bench-store-")
  try:
    os.environ["MAXTRAIN_CACHE"] = tmp
    built_s, _, (train, _) = harness.once(lambda: corpus.prepare_corpus("python-stdlib"))
    print(f"1x store (python-stdlib train split) built in {built_s:.1f} s")
    stores = {"1x": train}
    written_s, _, _ = harness.once(lambda: _repeat_store(TokenStore.open(train), os.path.join(tmp, "x10"), 10))
    stores["10x"] = os.path.join(tmp, "x10")
    print(f"10x store written in {written_s:.1f} s")
    if args.many_docs:
      stores[f"{args.many_docs:,} docs"] = os.path.join(tmp, "many")
      _many_docs_store(stores[f"{args.many_docs:,} docs"], args.many_docs)

    print("\nstore                docs     tokens   .idx MiB   open ms   "
          "offset check ms")
    for name, prefix in stores.items():
      s = TokenStore.open(prefix)
      open_s = _median_s(lambda p=prefix: TokenStore.open(p), args.repeats)
      check_s = _median_s(lambda s=s: store_lib._check_offsets(
          "idx", "json", s.offsets, s.num_tokens), args.repeats)
      print(f"{name:16s} {s.num_docs:>9,} {s.num_tokens:>12,} "
            f"{(s.num_docs + 1) * 8 / 2**20:9.2f} {open_s * 1e3:9.3f} "
            f"{check_s * 1e3:12.3f}")

    print("\ncheck_vocab: header max_token_id vs an older header (scan)")
    for name in ("1x", "10x"):
      s = TokenStore.open(stores[name])
      with_max = _median_s(lambda s=s: s.check_vocab(384), args.repeats)
      old = os.path.join(tmp, f"old-{name}")
      _without_max(stores[name], old)
      scan = _median_s(lambda o=old: TokenStore.open(o)._scan_max(),
                       max(3, args.repeats // 4))
      verify_s, _, _ = harness.once(TokenStore.open(stores[name]).verify)
      print(f"  {name:4s} recorded {with_max * 1e6:8.2f} us   scan "
            f"{scan * 1e3:8.1f} ms ({s.num_tokens * s.tokens.itemsize / scan / 1e9:.1f} "
            f"GB/s)   full --verify {verify_s:.2f} s")

    print("\nper-batch id check (first_bad_token, fast path), int32 batches")
    store = TokenStore.open(stores["1x"])
    rng = np.random.default_rng(0)
    for batch, seq in ((16, 256), (8, 1024), (64, 2048), (256, 4096)):
      ids = rng.integers(0, 258, size=(batch, seq + 1)).astype(np.int32)
      b = {"inputs": ids[:, :-1].copy(), "targets": ids[:, 1:].copy()}
      n = 2000 if batch * seq < 1e6 else 200

      def checks(b=b, n=n, seq=seq) -> None:  # returns nothing: the harness has nothing to wait for
        for _ in range(n):
          pipeline.check_batch_ids(b, store, 384, None)

      per = harness.repeated(checks, 5, warmup=0).min_wall / n
      print(f"  {batch:4d} x {seq:5d}  {per * 1e6:9.1f} us  "
            f"({per / (batch * seq) * 1e9:.2f} ns/token)")
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
  main()
