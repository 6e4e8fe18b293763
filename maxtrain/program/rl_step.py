"""The jitted GRPO pieces over the training model: per-token log-probabilities of given tokens (the
training forward pass, `step.head_losses`: log p = -cross-entropy) and the optimizer step on the
GRPO objective (`rl_loss.grpo_loss`). Same state, optimizer, shardings and loss head as pretraining.

A GRPO batch is a pretraining batch (`data/pipeline.py` KEYS: the loss mask marks completion tokens)
plus RL_KEYS, float32 [B, T] like the loss mask: the rollout policy's log-probs, the reference's, and
each token's advantage.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from maxtrain.data.pipeline import KEYS
from maxtrain.optim import optimizer as optim
from maxtrain.optim.masking import keep_if
from maxtrain.program import rl_loss, step as step_lib
from maxtrain.program.state import TrainState
from maxtrain.sharding import rules as sharding_rules

RL_KEYS = ("old_logp", "ref_logp", "advantages")


def token_logprobs(graphdef: nnx.GraphDef, params: nnx.State, batch: dict, **chunking) -> jax.Array:
  """log p(target | prefix) of every position, fp32 [B, T]."""
  ce_BT, _, _, _ = step_lib.head_losses(graphdef, params, batch, **chunking)
  return -ce_BT


def make_logprobs(graphdef: nnx.GraphDef, rules: sharding_rules.Rules | None = None,
                  **chunking) -> Callable[[nnx.State, dict], jax.Array]:
  def logprobs(params, batch):
    with sharding_rules.activate(rules):
      return token_logprobs(graphdef, params, batch, **chunking)
  return logprobs


def make_grpo_step(graphdef: nnx.GraphDef, optimizer: optim.Optimizer, *, clip_eps: float, kl_coef: float,
                   on_policy: bool, rules: sharding_rules.Rules | None = None,
                   **chunking) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
  """One optimizer step on a GRPO batch. `on_policy` (one optimizer step per rollout): the old
  log-probs are this forward pass's own, gradient stopped, so the ratio is exactly 1. A non-finite
  loss or gradient skips the update (the optimizer's guarded state stays)."""
  def objective(params, batch):
    logp_BT = token_logprobs(graphdef, params, batch, **chunking)
    old = jax.lax.stop_gradient(logp_BT) if on_policy else batch["old_logp"]
    return rl_loss.grpo_loss(logp_BT, old, batch["ref_logp"], batch["advantages"], batch["loss_mask"],
                             clip_eps=clip_eps, kl_coef=kl_coef)

  def grpo_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    with sharding_rules.activate(rules):
      (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(state.params, batch)
    grad_norm = optax.tree.norm(grads)
    skip = ~(jnp.isfinite(loss) & jnp.isfinite(grad_norm))
    with sharding_rules.activate(rules):
      updates, opt_state = optimizer.tx.update(grads, state.opt_state, state.params, skip=skip)
    params = keep_if(skip, state.params, optax.apply_updates(state.params, updates))
    metrics.update(loss=loss, grad_norm=grad_norm, skipped=skip.astype(jnp.float32),
                   **{name: lr(state.step) for name, lr in optimizer.learning_rates.items()})
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return grpo_step


def jit_pieces(program, *, clip_eps: float, kl_coef: float, on_policy: bool) -> tuple[Callable, Callable]:
  """(jitted logprobs(params, batch), jitted grpo_step(state, batch)) of a built `program/build.py` Program."""
  from maxtrain.program.build import loss_chunk_tokens

  layout, spec = program.plan.layout, program.state
  chunking = dict(chunk_tokens=loss_chunk_tokens(program.cfg.model), batch_shards=layout.shards("act_batch"),
                  length_shards=layout.shards("act_length"))
  rows = program.batch_shardings["inputs"]
  batch_shardings = {**{k: v for k, v in program.batch_shardings.items() if k in KEYS},
                     **{k: rows for k in RL_KEYS}}
  replicated = NamedSharding(program.mesh, P())
  logprobs = jax.jit(make_logprobs(spec.graphdef, layout.rules, **chunking),
                     in_shardings=(spec.shardings.params, batch_shardings), out_shardings=rows)
  step = make_grpo_step(spec.graphdef, program.optimizer, clip_eps=clip_eps, kl_coef=kl_coef, on_policy=on_policy,
                        rules=layout.rules, **chunking)
  train = jax.jit(step, in_shardings=(spec.shardings, batch_shardings), out_shardings=(spec.shardings, replicated),
                  donate_argnums=0)
  return logprobs, train


def to_device(rows: dict[str, np.ndarray], program) -> dict[str, jax.Array]:
  """Host rows (KEYS + RL_KEYS) -> global arrays with the batch's row sharding."""
  from maxtrain.program import batch as batch_lib

  shardings = {k: program.batch_shardings["inputs"] for k in rows}
  return batch_lib.to_device(rows, shardings)
