"""Asynchronous RL on 8 fake CPU devices, 4 trainer + 4 rollout (`post.rollout_devices=4`), from an SFT
checkpoint on the arithmetic task: updates per wall second, the trainer's busy fraction and the held-out
reward after the same number of updates, for each arm, the arms alternating run by run (seed i of every
arm, then seed i + 1, ...).

  python tools/async_rl_bench.py --init_from=runs/sft/checkpoints/200 [--arms=s0,s1] [--seeds=0,1] [--rounds=20]
  python tools/async_rl_bench.py --init_from=runs/sft/checkpoints/200 --arms=bf16_s4,bf16_s4_tis --seeds=0,1,2

Arms: s0 (max_staleness 0: rollouts on their own mesh, no overlap), s1 (max_staleness 1: the producer
samples round k + 1 while the trainer trains round k), colocated (today's synchronous run on all 8
devices), bf16_s4 / bf16_s4_tis (a bf16 rollout mesh 4 versions behind, without / with tis). Each run is
configs/grpo.py with checkpoint.init_from, the seed and the arm's keys (plus --config.key=value overrides),
scoring post.eval_prompts held-out prompts greedily at round 0 and at the end (`rl/eval_reward`). Rounds
1-2 (compiles) are left out of the speed figures. Prints a table and the machine; the figures go into
BENCHMARKS.md and docs/post_training.md. A finished run under --out with the same config is reused.
"""

from __future__ import annotations

import os

from maxtrain.runtime.platform import fake_cpu_devices

fake_cpu_devices(8)  # before jax starts its backend
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from maxtrain import config as config_lib  # noqa: E402
from maxtrain.loop import trainer  # noqa: E402

ARMS = {
    "colocated": [],
    "s0": ["--config.post.rollout_devices=4", "--config.post.max_staleness=0"],
    "s1": ["--config.post.rollout_devices=4", "--config.post.max_staleness=1"],
    "bf16_s4": ["--config.post.rollout_devices=4", "--config.post.max_staleness=4", "--config.post.rollout_dtype=bfloat16"],
    "bf16_s4_tis": ["--config.post.rollout_devices=4", "--config.post.max_staleness=4",
                    "--config.post.rollout_dtype=bfloat16", "--config.post.correction=tis"],
}


def scalars(out_dir: Path, tag: str) -> dict[int, float]:
  events = EventAccumulator(str(out_dir / "tensorboard"), size_guidance={"scalars": 0})
  events.Reload()
  return {e.step: e.value for e in events.Scalars(tag)} if tag in events.Tags()["scalars"] else {}


def run(arm: str, seed: int, argv: list[str], root: Path, rounds: int) -> dict:
  out = root / f"{arm}_seed{seed}"
  cfg = config_lib.load(["--config=configs/grpo.py", "--config.log_every=1", f"--config.steps={rounds}",
                         f"--config.eval.every_steps={rounds}", f"--config.checkpoint.every_steps={rounds}",
                         *ARMS[arm], *argv, f"--config.seed={seed}", f"--config.output_dir={out}"])
  same = lambda c: {k: v for k, v in c.items() if k != "output_dir"}  # noqa: E731
  if not ((out / "summary.json").exists()
          and same(json.loads((out / "config.json").read_text())) == same(json.loads(json.dumps(cfg.to_dict())))):
    shutil.rmtree(out, ignore_errors=True)
    trainer.run(cfg)
  updates = cfg.post.ppo_epochs * cfg.post.minibatches
  per_s = scalars(out, "rl/updates_per_s")
  busy = scalars(out, "rl/trainer_busy")
  later = [k for k in sorted(per_s) if k > 2]
  if later:  # the async stepper's own figures: the round's wall time between publishes
    round_s = [updates / per_s[k] for k in later]
    busy_mean = float(np.mean([busy[k] for k in later]))
  else:  # the synchronous stepper: a round is its rollout + scoring + training
    parts = [scalars(out, t) for t in ("rl/rollout_s", "rl/score_s", "rl/train_s")]
    later = [k for k in sorted(parts[2]) if k > 2]
    round_s = [sum(p[k] for p in parts) for k in later]
    busy_mean = float(np.mean([parts[2][k] / round_s[i] for i, k in enumerate(later)]))
  reward = scalars(out, "rl/eval_reward")
  kl = scalars(out, "rl/mismatch_kl")
  return {"arm": arm, "seed": seed, "updates_per_s": updates * len(round_s) / sum(round_s), "trainer_busy": busy_mean,
          "reward_start": reward.get(0, float("nan")), "reward_end": reward.get(rounds, float("nan")),
          "mismatch_kl": float(np.mean([v for k, v in kl.items() if k > 1])) if kl else float("nan"),
          "rollout_idle_s": float(np.mean([v for k, v in scalars(out, "rl/rollout_idle_s").items() if k > 2] or [np.nan]))}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--init_from", required=True)
  parser.add_argument("--arms", default="s0,s1")
  parser.add_argument("--seeds", default="0,1")
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--out", default="runs/async_rl_bench")
  args, rest = parser.parse_known_args()
  logging.basicConfig(level=logging.WARNING)
  argv = [f"--config.checkpoint.init_from={args.init_from}", *rest]
  results = [run(arm, int(seed), argv, Path(args.out), args.rounds)
             for seed in args.seeds.split(",") for arm in args.arms.split(",")]  # alternating: arm by arm per seed
  print(f"| arm | seed | updates/s | trainer busy | rollout idle s/round | mismatch KL | held-out greedy reward: round 0 "
        f"| round {args.rounds} |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- |")
  for r in results:
    print(f"| {r['arm']} | {r['seed']} | {r['updates_per_s']:.3f} | {r['trainer_busy']:.2f} | {r['rollout_idle_s']:.2f} "
          f"| {r['mismatch_kl']:.2e} | {r['reward_start']:.3f} | {r['reward_end']:.3f} |")
  for arm in args.arms.split(","):
    mine = [r for r in results if r["arm"] == arm]
    print(f"{arm}: updates/s mean {np.mean([r['updates_per_s'] for r in mine]):.3f}, reward change mean "
          f"{np.mean([r['reward_end'] - r['reward_start'] for r in mine]):+.3f}")
  print(f"machine: {platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}, {jax.device_count()} "
        f"x {jax.devices()[0].device_kind}, load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
  main()
