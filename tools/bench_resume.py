"""Train-loader costs vs corpus size and number of sources: `python tools/bench_resume.py [--scale 10]`.

Builds a store `scale` times the default corpus (its documents repeated) in a temporary directory and
times, for 1 and 4 sources over each store (the sources are links to the same files): opening the
MixtureLoader, set_state to a step deep in the run, the first batch after it, and the steady host time
per batch (built on the calling thread; and the wait for it when Grain reads ahead while a step runs).
Open and resume must not grow with the number of documents: the loader indexes windows and replays nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import harness
from maxtrain.data import corpus
from maxtrain.data.loader import MixtureLoader, contiguous_rows
from maxtrain.data.mixture import Source, Stage
from maxtrain.data.store import StoreWriter, TokenStore

BATCH, SEQ_LEN = 16, 256  # the default config's


def _loader(prefixes: list[str], read_ahead: int = 0) -> MixtureLoader:
  weights = tuple(float(k + 1) for k in range(len(prefixes)))  # unequal weights: real block layouts
  sources = [Source(os.path.basename(p), p, w) for p, w in zip(prefixes, weights)]
  return MixtureLoader(sources, [Stage(0, 0, BATCH, SEQ_LEN, weights)], 0, contiguous_rows(0, 1),
                       read_ahead=read_ahead)


def time_loader(prefixes: list[str], step: int, batches: int, step_s: float) -> dict[str, float]:
  """Seconds: open, set_state to `step`, first batch, median steady batch, median wait with read-ahead."""
  open_s, _, loader = harness.once(lambda: _loader(prefixes))
  state = {**loader.get_state(), "step": step, "sequence": step * BATCH}
  set_s, _, _ = harness.once(lambda: loader.set_state(state))
  first_s, _, _ = harness.once(lambda: next(loader))
  steady = [harness.once(lambda: next(loader))[0] for _ in range(batches)]
  ahead = _loader(prefixes, read_ahead=4)
  ahead.set_state(state)
  next(ahead)  # starts Grain's threads
  waits = []
  for _ in range(batches):
    time.sleep(step_s)  # the device running a step: Grain's threads build the next batches meanwhile
    waits.append(harness.once(lambda: next(ahead))[0])
  ahead.close()
  return {"open": open_s, "set_state": set_s, "first": first_s, "batch": statistics.median(steady),
          "wait": statistics.median(waits)}


def _links(prefix: str, directory: str, n: int) -> list[str]:
  """`n` sources over one store: PREFIX's files linked under n names (each source's name is its base name)."""
  out = []
  for k in range(n):
    name = os.path.join(directory, f"src{k}")
    for ext in (".bin", ".idx", ".json"):
      os.symlink(os.path.abspath(prefix + ext), name + ext)
    out.append(name)
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--scale", type=int, default=10)
  parser.add_argument("--step", type=int, default=1_000_000, help="resume position, in steps")
  parser.add_argument("--batches", type=int, default=30, help="steady batches timed")
  parser.add_argument("--step-s", type=float, default=1.29, help="the default config's step on this machine "
                      "(BENCHMARKS.md), for the host share and the read-ahead simulation")
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

    build_s, _, _ = harness.once(build)
    print(f"built {args.scale}x store: {TokenStore.open(big).num_tokens:,} tokens in {build_s:.1f}s")
    for label, prefix in (("1x", train_prefix), (f"{args.scale}x", big)):
      store = TokenStore.open(prefix)
      for n in (1, 4):
        directory = tempfile.mkdtemp(dir=tmp)
        prefixes = [prefix] if n == 1 else _links(prefix, directory, n)
        t = min((time_loader(prefixes, args.step, args.batches, args.step_s) for _ in range(3)),
                key=lambda r: r["open"] + r["set_state"])
        print(f"{label:>4} store ({store.num_docs:>7,} docs, {store.num_tokens:>12,} tokens), {n} source(s): open "
              f"{t['open'] * 1e3:6.1f} ms, set_state to step {args.step:,} {t['set_state'] * 1e3:6.2f} ms, first "
              f"batch {t['first'] * 1e3:5.1f} ms, steady batch {t['batch'] * 1e3:5.1f} ms "
              f"({t['batch'] / args.step_s:.2%} of a {args.step_s:g} s step), wait with read-ahead "
              f"{t['wait'] * 1e3:5.2f} ms ({t['wait'] / args.step_s:.3%})")


if __name__ == "__main__":
  main()
