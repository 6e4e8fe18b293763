"""Does the reward drive GRPO? The held-out mean reward before and after GRPO from an SFT
checkpoint, trained on the reward and on the reward negated (`post.negate_reward`, the control), over
several seeds; and the round's time split (rollout / scoring / training) with rollout and training
tokens/s, from the same runs.

  python tools/grpo_learning.py --init_from=runs/sft [--seeds=0,1,2] [--out=runs/grpo_learning] [--config.key=value ...]
  python tools/grpo_learning.py --init_from=runs/sft --base=configs/rl.py --config.post.algorithm=rloo   (any algorithm)

Each run is configs/grpo.py (or --base) with checkpoint.init_from, seed, negate_reward and the overrides, logging
every round; it scores post.eval_prompts held-out prompts at round 0, every eval.every_steps and at the
end, greedily (`rl/eval_reward`) and sampled at post.temperature with a fixed seed
(`rl/eval_reward_sampled`). A run already finished under --out with the same config is reused. Prints a
table per reward and run, the mean change per arm, and the machine; the figures go into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
from pathlib import Path

import jax
import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from maxtrain import config as config_lib
from maxtrain.loop import trainer

SPLIT = ("rl/rollout_s", "rl/score_s", "rl/train_s")
REWARDS = {"rl/eval_reward": "greedy", "rl/eval_reward_sampled": "sampled"}  # held-out mean rewards


def scalars(out_dir: Path, tag: str) -> dict[int, float]:
  events = EventAccumulator(str(out_dir / "tensorboard"), size_guidance={"scalars": 0})
  events.Reload()
  return {e.step: e.value for e in events.Scalars(tag)} if tag in events.Tags()["scalars"] else {}


def run(argv: list[str], seed: int, negate: bool, root: Path, base: str = "configs/grpo.py") -> dict:
  out = root / f"seed{seed}_{'negated' if negate else 'reward'}"
  cfg = config_lib.load([f"--config={base}", "--config.log_every=1", *argv, f"--config.seed={seed}",
                         f"--config.post.negate_reward={negate}", f"--config.output_dir={out}"])
  done = out / "summary.json"
  same = lambda c: {k: v for k, v in c.items() if k != "output_dir"}  # noqa: E731  (a moved --out is reused)
  if not (done.exists() and same(json.loads((out / "config.json").read_text())) == same(json.loads(json.dumps(cfg.to_dict())))):
    shutil.rmtree(out, ignore_errors=True)  # an unfinished run's events would mix with the new ones
    trainer.run(cfg)
  curves = {tag: scalars(out, tag) for tag in REWARDS}
  # Rounds after the first (which compiles the sampler and the step).
  split = {tag: float(np.mean([v for k, v in scalars(out, tag).items() if k > 1] or [np.nan])) for tag in SPLIT}
  p = cfg.post
  rows = p.prompts_per_step * p.group_size
  split["rollout_tokens_per_s"] = rows * p.max_new_tokens / split["rl/rollout_s"]  # tokens sampled (EOS included)
  split["train_tokens_per_s"] = rows * cfg.data.seq_len * p.ppo_epochs / split["rl/train_s"]  # row tokens trained
  result = {"seed": seed, "negate": negate, "rounds": cfg.steps, "curves": curves, **split}
  for tag, name in REWARDS.items():
    c = curves[tag]
    print(f"seed {seed} {'negated' if negate else 'reward '}: held-out {name} reward {c[0]:.3f} -> {c[max(c)]:.3f} "
          f"({c[max(c)] - c[0]:+.3f}) after {cfg.steps} rounds", flush=True)
  return result


def report(results: list[dict], cfg_argv: list[str]) -> None:
  for tag, name in REWARDS.items():
    curves = [r["curves"][tag] for r in results]
    evals = sorted({k for c in curves for k in c})  # the rounds evaluated (eval.every_steps, the end)
    print(f"\nheld-out {name} mean reward\n| seed | trained on | " + " | ".join(f"round {k}" for k in evals) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in evals) + " |")
    for r, c in zip(results, curves):
      print(f"| {r['seed']} | {'-reward' if r['negate'] else 'reward'} | "
            + " | ".join(f"{c[k]:.3f}" if k in c else "" for k in evals) + " |")
    for k in evals[1:]:
      for negate in (False, True):
        arm = [c[k] - c[0] for r, c in zip(results, curves) if r["negate"] == negate and k in c]
        if arm:
          print(f"{name}: mean change at round {k}, {'negated reward' if negate else 'reward'}: {np.mean(arm):+.4f} "
                f"(min {np.min(arm):+.3f}, max {np.max(arm):+.3f}, {len(arm)} seeds)")
  mean = {k: float(np.mean([r[k] for r in results])) for k in (*SPLIT, "rollout_tokens_per_s", "train_tokens_per_s")}
  total = sum(mean[k] for k in SPLIT)
  print(f"per round after the first (mean of all runs): rollout {mean['rl/rollout_s']:.2f}s ({mean['rl/rollout_s'] / total:.0%}), "
        f"scoring {mean['rl/score_s']:.3f}s ({mean['rl/score_s'] / total:.1%}), training {mean['rl/train_s']:.2f}s "
        f"({mean['rl/train_s'] / total:.0%}); rollout {mean['rollout_tokens_per_s']:.0f} sampled tokens/s, "
        f"training {mean['train_tokens_per_s']:.0f} row tokens/s")
  print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {jax.device_count()} x {jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}, load average {os.getloadavg()[0]:.1f}; overrides {' '.join(cfg_argv)}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--init_from", required=True, help="the SFT run (its output dir or a checkpoint step dir)")
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--out", default="runs/grpo_learning")
  parser.add_argument("--arms", default="reward,negated", help="reward, negated or both (e.g. one per process)")
  parser.add_argument("--base", default="configs/grpo.py",
                      help="the config file (configs/rl.py with --config.post.algorithm=X: X at its recipe)")
  args, rest = parser.parse_known_args()
  logging.basicConfig(level=logging.WARNING)
  argv = [f"--config.checkpoint.init_from={args.init_from}", *rest]
  arms = [arm == "negated" for arm in args.arms.split(",")]
  results = [run(argv, int(seed), negate, Path(args.out), args.base) for seed in args.seeds.split(",") for negate in arms]
  report(results, rest)


if __name__ == "__main__":
  main()
