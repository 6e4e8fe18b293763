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
from maxtrain.program import guards, rl_loss, step as step_lib
from maxtrain.program.state import TrainState
from maxtrain.runtime import faults
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
                   on_policy: bool, spike_zscore: float = 6.0, spike_warmup: int = 20,
                   rules: sharding_rules.Rules | None = None,
                   **chunking) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
  """One optimizer step on a GRPO batch (with its fault input, `runtime/faults.py`). `on_policy` (one
  optimizer step per rollout): the old log-probs are this forward pass's own, gradient stopped, so the
  ratio is exactly 1. The guards are pretraining's (`program/guards.py`, the state's GuardState): a
  non-finite loss, gradient or update is skipped, and so is a spike of the gradient norm (the watched
  signal: the surrogate loss is ~0 by construction; docs/post_training.md)."""
  def objective(params, batch):
    logp_BT = token_logprobs(graphdef, params, batch, **chunking)
    old = jax.lax.stop_gradient(logp_BT) if on_policy else batch["old_logp"]
    return rl_loss.grpo_loss(logp_BT, old, batch["ref_logp"], batch["advantages"], batch["loss_mask"],
                             clip_eps=clip_eps, kl_coef=kl_coef)

  def grpo_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    rows, fault = faults.split(batch)
    with sharding_rules.activate(rules):
      (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(state.params, rows)
    loss, grads = faults.inject(fault, loss, grads)
    grad_norm = optax.tree.norm(grads)
    guard, skip, guard_metrics = guards.check(state.guard, loss, grad_norm, zscore=spike_zscore, warmup=spike_warmup,
                                              signal=grad_norm)
    with sharding_rules.activate(rules):
      updates, opt_state = optimizer.tx.update(grads, state.opt_state, state.params, skip=skip)
    candidate = optax.apply_updates(state.params, updates)
    update_finite = jnp.isfinite(optax.tree.norm(candidate))
    guard, skip, guard_metrics = guards.reject_update(state.guard, guard, skip, update_finite, guard_metrics)
    params = keep_if(skip, state.params, candidate)
    metrics.update(guard_metrics, loss=loss, grad_norm=grad_norm, skipped=skip.astype(jnp.float32),
                   **{name: lr(state.step) for name, lr in optimizer.learning_rates.items()})
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state, guard=guard), metrics

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
  guards_cfg = program.cfg.guards
  step = make_grpo_step(spec.graphdef, program.optimizer, clip_eps=clip_eps, kl_coef=kl_coef, on_policy=on_policy,
                        spike_zscore=guards_cfg.spike_zscore, spike_warmup=guards_cfg.spike_warmup, rules=layout.rules,
                        **chunking)
  train = jax.jit(step, in_shardings=(spec.shardings, {**batch_shardings, faults.INPUT: replicated}),
                  out_shardings=(spec.shardings, replicated), donate_argnums=0)
  return logprobs, train


def to_device(rows: dict[str, np.ndarray], program, fault: tuple[float, float] | None = None) -> dict[str, jax.Array]:
  """Host rows (KEYS + RL_KEYS) -> global arrays with the batch's row sharding; with `fault` (the step's
  batch: `faults.NONE` when nothing is injected), plus the step's fault input."""
  from maxtrain.program import batch as batch_lib

  shardings = {k: program.batch_shardings["inputs"] for k in rows}
  batch = batch_lib.to_device(rows, shardings)
  return batch if fault is None else faults.attach(batch, fault, NamedSharding(program.mesh, P()))
