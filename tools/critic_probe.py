"""What can PPO's value head read? Rollouts of a frozen policy (configs/rl.py with post.algorithm=ppo,
from checkpoint.init_from), then, for the head's inputs (the final features h, the prefix features e of
`program/critic.py`, both): the held-out explained variance of a least-squares fit of the Monte Carlo
returns (fitted on the first rounds, scored on the last), and of the head trained online as PPO trains
it (GAE, the clipped value loss, 2 epochs x 2 minibatches a round, Adam) at a few learning rates.

  python tools/critic_probe.py --init_from=runs/sft/checkpoints/200 [--rounds=48] [--held_out=8]

The figures in docs/post_training.md ("PPO's critic") come from it.
"""

from __future__ import annotations

import argparse
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax

from maxtrain import config as config_lib
from maxtrain.loop.trainer import Trainer
from maxtrain.posttrain import rl_step, rollout as rollout_lib
from maxtrain.posttrain.algorithms import ppo
from maxtrain.program import critic, step as step_lib


def collect(init_from: str, rounds: int) -> tuple[dict[str, np.ndarray], object]:
  """Per round: features [B, T, D], loss mask, log-probs (policy, reference), rewards [B]."""
  cfg = config_lib.load(["--config=configs/rl.py", "--config.post.algorithm=ppo", "--config.post.eval_prompts=0",
                         f"--config.checkpoint.init_from={init_from}", "--config.output_dir=/tmp/critic_probe"])
  trainer = Trainer(cfg)
  stepper, program = trainer.stepper, trainer.program
  state = trainer._starting_state()
  stepper.start(state, 0)

  def features(params, batch):
    return step_lib.head_losses_and_features(program.state.graphdef, params, batch)[4].astype(jnp.float32)

  features = jax.jit(features)
  out = {k: [] for k in ("x", "mask", "logp", "ref", "rewards")}
  with jax.set_mesh(program.mesh):
    for q in range(rounds):
      r = rollout_lib.sample(stepper.data, stepper.generator, state.params, q, cfg.post, cfg.seed, cfg.data.seq_len)
      host = {k: r.rows[k] for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask")}
      zeros = np.zeros_like(host["loss_mask"])
      batch = rl_step.to_device({**host, **{k: zeros for k in rl_step.RL_KEYS + rl_step.CRITIC_KEYS}}, program)
      out["x"].append(np.asarray(features(state.params, batch)))
      out["mask"].append(host["loss_mask"])
      out["logp"].append(np.asarray(stepper.pieces.logprobs(state.params, batch)))
      out["ref"].append(np.asarray(stepper.pieces.logprobs(stepper.reference, batch)))
      out["rewards"].append(r.rewards)
  return {k: np.stack(v) for k, v in out.items()}, stepper


def inputs(d: dict, i: int, which: str, max_new_tokens: int) -> np.ndarray:
  e = np.asarray(critic.prefix_features(jnp.asarray(d["logp"][i]), jnp.asarray(d["mask"][i]), max_new_tokens))
  return {"h": d["x"][i], "e": e, "h+e": np.concatenate([d["x"][i], e], -1)}[which]


def least_squares(d: dict, which: str, train: range, test: range, ridge: float, max_new_tokens: int) -> float:
  def rows(idx):
    f = [inputs(d, i, which, max_new_tokens)[d["mask"][i] > 0] for i in idx]
    y = [np.broadcast_to(d["rewards"][i][:, None], d["mask"][i].shape)[d["mask"][i] > 0] for i in idx]
    return np.concatenate(f), np.concatenate(y)
  (a, y), (a_test, y_test) = rows(train), rows(test)
  mu, sd = a.mean(0), a.std(0) + 1e-6
  a, a_test = np.c_[(a - mu) / sd, np.ones(len(a))], np.c_[(a_test - mu) / sd, np.ones(len(a_test))]
  w = np.linalg.solve(a.T @ a + ridge * len(a) * np.eye(a.shape[1]), a.T @ y)
  return float(1 - np.var(y_test - a_test @ w) / np.var(y_test))


def online(d: dict, which: str, lr: float, hp, group_size: int) -> np.ndarray:
  """Explained variance per round of a linear head on `which`, trained as PPO's step trains the critic."""
  dim = inputs(d, 0, which, hp.max_new_tokens).shape[-1]
  head, tx = {"w": jnp.zeros(dim), "b": jnp.zeros(())}, optax.adam(lr)
  opt = tx.init(head)
  value = lambda h, f: jnp.einsum("btf,f->bt", f, h["w"]) + h["b"]  # noqa: E731

  @jax.jit
  def update(h, opt, f, old, ret, m):
    grads = jax.grad(lambda h: ppo.value_loss(value(h, f), old, ret, m, hp)[0])(h)
    updates, opt = tx.update(grads, opt, h)
    return optax.apply_updates(h, updates), opt

  explained = []
  for i in range(len(d["mask"])):
    f, m = jnp.asarray(inputs(d, i, which, hp.max_new_tokens)), d["mask"][i]
    old = np.asarray(value(head, f)) * m
    _, ret = ppo.advantages(d["rewards"][i].reshape(-1, group_size), d["logp"][i], d["ref"][i], m, hp, values_BT=old)
    on = m > 0
    explained.append(1 - np.var((old - ret)[on]) / max(np.var(ret[on]), 1e-8))
    half = len(m) // 2
    for _ in range(2):  # configs/rl.py's round: 2 epochs x 2 minibatches
      for rows in (slice(0, half), slice(half, None)):
        head, opt = update(head, opt, f[rows], old[rows], ret[rows], jnp.asarray(m[rows]))
  return np.asarray(explained)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--init_from", required=True)
  parser.add_argument("--rounds", type=int, default=48)
  parser.add_argument("--held_out", type=int, default=8)
  args = parser.parse_args()
  logging.basicConfig(level=logging.WARNING)
  d, stepper = collect(args.init_from, args.rounds)
  hp, n = stepper.hp, args.rounds
  print(f"{n} rounds, sampled reward mean {d['rewards'].mean():.3f}")
  for which in ("h", "e", "h+e"):
    fits = [least_squares(d, which, range(n - args.held_out), range(n - args.held_out, n), ridge, hp.max_new_tokens)
            for ridge in (1e-4, 1e-3, 1e-2, 1e-1)]
    print(f"least squares on {which}: held-out explained variance at ridge 1e-4..1e-1: "
          + ", ".join(f"{v:+.3f}" for v in fits))
    for lr in (1e-3, 1e-2):
      ev = online(d, which, lr, hp, stepper.cfg.post.group_size)
      print(f"  online head on {which}, Adam {lr:g}: explained variance rounds 1-5 {ev[:5].mean():+.3f}, "
            f"last {args.held_out} {ev[-args.held_out:].mean():+.3f}")


if __name__ == "__main__":
  main()
