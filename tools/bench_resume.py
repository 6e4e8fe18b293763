"""Data-iterator resume cost vs corpus size: `python tools/bench_resume.py [--scale 10]`.

Builds a store `scale` times the size of the default corpus (its documents repeated) in a
temporary directory, then times, for both stores: opening the loader, restoring an iterator state
deep into the run (set_state), and producing the first batch after it. Resume must not grow with
corpus size: the loader indexes windows directly and replays nothing.
"""

from __future__ import annotations

import argparse
import tempfile

from maxtrain.data import corpus, pipeline
from maxtrain.data.store import StoreWriter, TokenStore
from maxtrain.monitor import timing


def time_resume(prefix: str, seq_len: int, batch: int, step: int) -> tuple[float, float, float]:
  open_s, _, loader = timing.once(
      lambda: pipeline.TrainLoader(prefix, seq_len, batch, seed=0, process_index=0, process_count=1))
  state = {**loader.get_state(), "next_index": step * batch}
  set_s, _, _ = timing.once(lambda: loader.set_state(state))
  batch_s, _, _ = timing.once(lambda: next(loader))
  return open_s, set_s, batch_s


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--scale", type=int, default=10)
  parser.add_argument("--step", type=int, default=1_000_000, help="resume position, in steps")
  args = parser.parse_args()
  train_prefix, _ = corpus.prepare_corpus("python-stdlib")
  base = TokenStore.open(train_prefix)
  with tempfile.TemporaryDirectory() as tmp:
    big = f"{tmp}/big"

    def build() -> None:
      with StoreWriter(big, base.vocab_size, base.tokenizer_identity) as writer:
        for _ in range(args.scale):
          for i in range(base.num_docs):
            writer.add(base.doc(i))

    build_s, _, _ = timing.once(build)
    print(f"built {args.scale}x store: {TokenStore.open(big).num_tokens:,} tokens in {build_s:.1f}s")
    for name, prefix in (("1x", train_prefix), (f"{args.scale}x", big)):
      open_s, set_s, batch_s = min(time_resume(prefix, 256, 16, args.step) for _ in range(3))
      print(f"{name:>4} store ({TokenStore.open(prefix).num_tokens:>12,} tokens): open loader {open_s * 1e3:7.1f} ms, "
            f"set_state to step {args.step:,} {set_s * 1e3:6.2f} ms, first batch {batch_s * 1e3:6.1f} ms")


if __name__ == "__main__":
  main()
