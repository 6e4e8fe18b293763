"""The RL update batch packed or not (`post.pack_updates`): padding share and the round's update seconds
(`rl/train_s`: log-prob passes and updates), configs/grpo.py on one CPU device, runs alternating
(unpacked, packed, unpacked, packed, ...).

  python tools/bench_packing.py [--seq_len=64] [--rounds=5] [--repeats=2] [--out=/tmp/bench_packing]

Rounds after the first (compiles) give the median `rl/train_s`; a packed run may compile once more when a
round packs into a new row count. Prints a table and the machine; the figures go into BENCHMARKS.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from maxtrain.cli import train  # noqa: E402


def scalars(out: Path, tag: str) -> dict[int, float]:
  acc = EventAccumulator(str(out / "tensorboard"))
  acc.Reload()
  return {e.step: e.value for e in acc.Scalars(tag)}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seq_len", type=int, default=64)
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--out", default="/tmp/bench_packing")
  args = ap.parse_args()
  rows = []
  for i in range(args.repeats):
    for packed in (False, True):
      out = Path(args.out) / f"{'packed' if packed else 'unpacked'}{i}"
      shutil.rmtree(out, ignore_errors=True)
      code = train.main(["--config=configs/grpo.py", f"--config.steps={args.rounds}", "--config.post.eval_prompts=0",
                         f"--config.data.seq_len={args.seq_len}", "--config.log_every=1", "--config.eval.every_steps=0",
                         f"--config.post.pack_updates={packed}", f"--config.output_dir={out}"])
      assert code == 0, code
      train_s = scalars(out, "rl/train_s")
      share = scalars(out, "rl/padding_share")
      later = [train_s[k] for k in sorted(train_s)[1:]]
      rows.append((packed, statistics.median(later), statistics.mean(share.values()), later))
  print(f"configs/grpo.py, data.seq_len {args.seq_len}, {args.rounds} rounds, 1 CPU device")
  print("| arm | padding share | rl/train_s median (rounds 2..) | rounds |")
  print("| --- | --- | --- | --- |")
  for packed, median, share, later in rows:
    print(f"| {'packed' if packed else 'unpacked'} | {share:.2f} | {median:.3f} | {', '.join(f'{s:.2f}' for s in later)} |")
  print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, jax {jax.__version__}")


if __name__ == "__main__":
  main()
