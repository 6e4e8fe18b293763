"""The jitted RL pieces over the training model: per-token log-probabilities of given tokens (the
training forward pass, `program/step.py` head_losses: log p = -cross-entropy) and the optimizer step on
the algorithm's objective (`posttrain/algorithms`), through the one guarded update (`program/update.py`).
Same state, optimizer, shardings and loss head as pretraining.

An RL batch is a pretraining batch (`data/pipeline.py` KEYS: the loss mask marks completion tokens)
plus RL_KEYS, float32 [B, T] like the loss mask: the rollout policy's log-probs, the reference's, and
each token's advantage.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from maxtrain.data.pipeline import KEYS
from maxtrain.optim import optimizer as optim
from maxtrain.posttrain import algorithms
from maxtrain.posttrain.algorithms import Algorithm, Hyper
from maxtrain.program import batch as batch_lib
from maxtrain.program.build import loss_chunk_tokens
from maxtrain.optim.masking import keep_if
from maxtrain.program import critic as critic_lib, drills, step as step_lib, update as update_lib
from maxtrain.program.state import TrainState

RL_KEYS = ("old_logp", "ref_logp", "advantages")
CRITIC_KEYS = ("old_values", "returns")  # an algorithm with a critic (PPO): the rollout's values and the targets


def token_logprobs(graphdef: nnx.GraphDef, params: nnx.State, batch: dict, **chunking) -> jax.Array:
  """log p(target | prefix) of every position, fp32 [B, T]."""
  ce_BT, _, _, _ = step_lib.head_losses(graphdef, params, batch, **chunking)
  return -ce_BT


def make_values(graphdef: nnx.GraphDef, max_new_tokens: int,
                **chunking) -> Callable[[nnx.State, dict, dict], jax.Array]:
  """values(params, critic head, batch) -> V per position, fp32 [B, T] (the critic at the rollout)."""
  def values(params, head, batch):
    ce_BT, _, _, _, x_BTD = step_lib.head_losses_and_features(graphdef, params, batch, **chunking)
    return critic_lib.values(head, x_BTD, -ce_BT, batch["loss_mask"], max_new_tokens)
  return values


def make_logprobs(graphdef: nnx.GraphDef, **chunking) -> Callable[[nnx.State, dict], jax.Array]:
  def logprobs(params, batch):
    return token_logprobs(graphdef, params, batch, **chunking)
  return logprobs


def make_rl_step(graphdef: nnx.GraphDef, optimizer: optim.Optimizer, algorithm: Algorithm, hp: Hyper, *,
                 on_policy: bool, spike_zscore: float = 6.0, spike_warmup: int = 20,
                 perturb: update_lib.Perturb | None = None,
                 **chunking) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
  """One optimizer step on an RL batch (`perturb`: a drill's, `program/drills.py`). `on_policy` (one
  optimizer step per rollout): the old log-probs are this forward pass's own, gradient stopped, so the
  ratio is exactly 1. The guards are pretraining's (`program/update.py`): a non-finite loss, gradient or
  update is skipped, and so is a spike of the gradient norm (the watched signal: the surrogate loss is
  ~0 by construction; docs/post_training.md)."""
  def objective(params, batch):
    logp_BT = token_logprobs(graphdef, params, batch, **chunking)
    old = jax.lax.stop_gradient(logp_BT) if on_policy else batch["old_logp"]
    return algorithm.loss(logp_BT, old, batch["ref_logp"], batch["advantages"], batch["loss_mask"], hp)

  def critic_objective(params, head, batch):
    """The policy's loss and the value loss; the value head reads the features with their gradient
    stopped, so each loss moves only its own tree."""
    ce_BT, _, _, _, x_BTD = step_lib.head_losses_and_features(graphdef, params, batch, **chunking)
    logp_BT = -ce_BT
    old = jax.lax.stop_gradient(logp_BT) if on_policy else batch["old_logp"]
    loss, metrics = algorithm.loss(logp_BT, old, batch["ref_logp"], batch["advantages"], batch["loss_mask"], hp)
    # The prefix features from this pass's log-probs, as `make_values` reads them at the rollout.
    v_BT = critic_lib.values(head, x_BTD, logp_BT, batch["loss_mask"], hp.max_new_tokens)
    v_loss, v_metrics = algorithm.value_loss(v_BT, batch["old_values"], batch["returns"], batch["loss_mask"], hp)
    return loss + v_loss, (loss, {**metrics, **v_metrics})

  def rl_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    rows = batch
    if algorithm.critic:
      head = state.opt_state.params
      (_, (loss, metrics)), (grads, head_grads) = jax.value_and_grad(critic_objective, argnums=(0, 1),
                                                                     has_aux=True)(state.params, head, rows)
    else:
      (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(state.params, rows)
    before = state
    state, loss, update_metrics = update_lib.guarded_update(state, loss, grads, optimizer,
                                                            spike_zscore=spike_zscore, spike_warmup=spike_warmup,
                                                            parallel=nnx.merge(graphdef, state.params).parallel,
                                                            spike_signal="grad_norm", perturb=perturb)
    skipped = update_metrics["nonfinite"] | update_metrics["spike"]
    if algorithm.critic:  # the critic's own Adam step, skipped with the policy's (a NaN round moves neither)
      critic = before.opt_state
      updates, opt = optimizer.tx.critic_tx.update(head_grads, critic.opt, critic.params)
      new_head = optax.apply_updates(critic.params, updates)
      finite = jnp.isfinite(optax.tree.norm(new_head))
      keep = (skipped > 0) | ~finite
      state = state.replace(opt_state=state.opt_state._replace(params=keep_if(keep, critic.params, new_head),
                                                               opt=keep_if(keep, critic.opt, opt)))
      metrics["critic_grad_norm"] = optax.tree.norm(head_grads)
    metrics.update(update_metrics, loss=loss, skipped=skipped.astype(np.float32))
    return state, metrics

  return rl_step


@dataclasses.dataclass(frozen=True)
class RlProgram:
  """The jitted RL pieces of a built `program/build.py` Program: logprobs(params, batch) and
  step(state, batch) (the state donated), and how to lower the step from abstract inputs."""
  program: Any
  logprobs: Callable
  step: Callable
  batch_shardings: dict
  values: Callable | None = None  # jitted values(params, critic head, batch) of an algorithm with a critic

  def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
    rows = self.program.abstract_batch()
    shape = rows["inputs"].shape
    out = {k: v for k, v in rows.items() if k in KEYS}
    out.update({k: jax.ShapeDtypeStruct(shape, np.float32, sharding=self.batch_shardings[k])
                for k in self.batch_shardings if k in RL_KEYS + CRITIC_KEYS})
    return drills.abstract_batch(self.batch_shardings, out)

  def lower(self) -> Any:
    """The RL step lowered from abstract inputs, as the trainer compiles it (no array allocated)."""
    with jax.set_mesh(self.program.mesh):
      return self.step.lower(self.program.abstract_state(), self.abstract_batch())


def build(program: Any, algorithm: Algorithm, hp: Hyper, *, on_policy: bool) -> RlProgram:
  """The RL pieces of `program` for `algorithm` at `hp`."""
  layout, spec = program.plan.layout, program.state
  chunking = dict(chunk_tokens=loss_chunk_tokens(program.cfg.model), batch_shards=layout.shards("act_batch"),
                  length_shards=layout.shards("act_length"))
  rows = program.batch_shardings["inputs"]
  rl_keys = RL_KEYS + (CRITIC_KEYS if algorithm.critic else ())
  batch_shardings = {**{k: v for k, v in program.batch_shardings.items() if k in KEYS},
                     **{k: rows for k in rl_keys}}
  logprobs = jax.jit(make_logprobs(spec.graphdef, **chunking),
                     in_shardings=(spec.shardings.params, batch_shardings), out_shardings=rows)
  values = None
  if algorithm.critic:
    values = jax.jit(make_values(spec.graphdef, hp.max_new_tokens, **chunking),
                     in_shardings=(spec.shardings.params, spec.shardings.opt_state.params, batch_shardings),
                     out_shardings=rows)
  guards_cfg = program.cfg.guards
  step = drills.wrap_step(program.cfg.faults, lambda **drill: make_rl_step(
      spec.graphdef, program.optimizer, algorithm, hp, on_policy=on_policy, spike_zscore=guards_cfg.spike_zscore,
      spike_warmup=guards_cfg.spike_warmup, **chunking, **drill))
  step_shardings = drills.batch_shardings(program.cfg.faults, program.mesh, batch_shardings)  # + a drilled run's fault input
  train = jax.jit(step, in_shardings=(spec.shardings, step_shardings),
                  out_shardings=(spec.shardings, NamedSharding(program.mesh, P())), donate_argnums=0)
  return RlProgram(program=program, logprobs=logprobs, step=train, batch_shardings=step_shardings, values=values)


def for_config(program: Any) -> RlProgram:
  """The RL pieces the config's post.* asks for (the algorithm resolved by the registry)."""
  algorithm, hp = algorithms.resolve(program.cfg.post)
  p = program.cfg.post
  return build(program, algorithm, hp, on_policy=p.ppo_epochs * p.minibatches == 1)


def jit_pieces(program: Any, algorithm: str = "grpo", *, on_policy: bool, **hyper: Any) -> tuple[Callable, Callable]:
  """(jitted logprobs, jitted step) for `algorithm` with the given Hyper fields (tests and tools)."""
  pieces = build(program, algorithms.get(algorithm), Hyper(**hyper), on_policy=on_policy)
  return pieces.logprobs, pieces.step


def to_device(rows: dict[str, np.ndarray], program: Any) -> dict[str, jax.Array]:
  """Host rows (KEYS + RL_KEYS), the whole round's batch on every process -> global arrays with the
  batch's row sharding."""
  shardings = {k: program.batch_shardings["inputs"] for k in rows}
  return batch_lib.global_to_device(rows, shardings)
