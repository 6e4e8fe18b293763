"""AdamW vs Muon at tuned learning rates: eval loss after the same number of steps, and how many
steps the better one needs to reach the other's final eval loss.

  python tools/compare_optimizers.py [--adamw-lrs=3e-3,6e-3] [--muon-lrs=0.01,0.02] [--config.key=value ...]

Trains the configured model (default: the default config) once per learning rate: AdamW first,
then Muon with its AdamW group (embeddings, head, norms) at the best AdamW learning rate. Prints
each run's eval-loss curve and a summary; the figures go into BENCHMARKS.md. A run already finished
under --out with the same config is reused, so the grid can be extended without recomputing.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shutil
from pathlib import Path

import jax
import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from maxtrain import config as config_lib
from maxtrain.loop import trainer


def eval_curve(out_dir: Path) -> tuple[np.ndarray, np.ndarray]:
  events = EventAccumulator(str(out_dir / "tensorboard"))
  events.Reload()
  scalars = events.Scalars("eval/loss")
  return np.array([e.step for e in scalars], float), np.array([e.value for e in scalars], float)


def steps_to_reach(steps: np.ndarray, losses: np.ndarray, target: float) -> float:
  """First step at which the curve reaches `target`, interpolating linearly between evals; inf if never."""
  below = np.nonzero(losses <= target)[0]
  if not below.size:
    return float("inf")
  i = below[0]
  if i == 0:
    return float(steps[0])
  s0, s1, l0, l1 = steps[i - 1], steps[i], losses[i - 1], losses[i]
  return float(s0 + (s1 - s0) * (l0 - target) / (l0 - l1))


def run(argv: list[str], name: str, lr: float, adam_lr: float, root: Path) -> dict:
  tag = f"{name}_lr{lr:g}"
  cfg = config_lib.load(argv + [f"--config.optimizer.name={name}", f"--config.optimizer.lr={lr}",
                                f"--config.optimizer.adam_lr={adam_lr}", f"--config.output_dir={root / tag}"])
  out = root / tag
  done = out / "summary.json"
  if done.exists() and json.loads((out / "config.json").read_text()) == json.loads(json.dumps(cfg.to_dict())):
    summary = json.loads(done.read_text())  # finished earlier with this exact config: reuse
  else:
    shutil.rmtree(out, ignore_errors=True)  # an unfinished run's events would mix with the new ones
    summary = trainer.run(cfg)
  steps, losses = eval_curve(out)
  print(f"{tag}: final eval loss {summary['final_eval_loss']:.4f}; curve "
        + " ".join(f"{int(s)}:{v:.3f}" for s, v in zip(steps, losses)), flush=True)
  return {"name": name, "lr": lr, "adam_lr": adam_lr, "final": summary["final_eval_loss"], "steps": steps,
          "losses": losses, "total_steps": cfg.steps}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--adamw-lrs", default="1.5e-3,3e-3,6e-3")
  parser.add_argument("--muon-lrs", default="0.01,0.02,0.04")
  parser.add_argument("--out", default="runs/compare_optimizers")
  args, rest = parser.parse_known_args()
  logging.basicConfig(level=logging.WARNING)
  argv = ["--config.eval.every_steps=20"] + rest
  root = Path(args.out)
  adamw = [run(argv, "adamw", float(lr), float(lr), root) for lr in args.adamw_lrs.split(",")]
  best_adamw = min(adamw, key=lambda r: r["final"])
  muon = [run(argv, "muon", float(lr), best_adamw["lr"], root) for lr in args.muon_lrs.split(",")]
  best_muon = min(muon, key=lambda r: r["final"])

  print(f"\nmachine: {platform.machine()} {jax.device_count()} x {jax.devices()[0].device_kind}, "
        f"python {platform.python_version()}, jax {jax.__version__}")
  print("| optimizer | lr | adam_lr | final eval loss |\n| --- | --- | --- | --- |")
  for r in adamw + muon:
    print(f"| {r['name']} | {r['lr']:g} | {r['adam_lr'] if r['name'] == 'muon' else '-'} | {r['final']:.4f} |")
  better, worse = sorted([best_adamw, best_muon], key=lambda r: r["final"])
  reach = steps_to_reach(better["steps"], better["losses"], worse["final"])
  total = worse["total_steps"]
  print(f"best adamw (lr {best_adamw['lr']:g}): {best_adamw['final']:.4f}; best muon (lr {best_muon['lr']:g}, "
        f"adam_lr {best_muon['adam_lr']:g}): {best_muon['final']:.4f}")
  print(f"{better['name']} reaches {worse['name']}'s final eval loss {worse['final']:.4f} at step {reach:.0f} of "
        f"{total}: steps-to-equal-loss ratio {better['name']}/{worse['name']} = {reach / total:.2f}")


if __name__ == "__main__":
  main()
