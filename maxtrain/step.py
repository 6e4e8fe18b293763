"""The jitted train and eval steps: pure functions of (state, batch).

Everything happens in the graph: no host callbacks, no lax.cond, no data-dependent Python,
so the same step compiles on every backend.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from maxtrain.state import TrainState

Batch = dict[str, jax.Array]


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Returns (sum of masked token losses, number of loss tokens); fp32."""
  losses_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32), targets_BT)
  mask_BT = mask_BT.astype(jnp.float32)
  return jnp.sum(losses_BT * mask_BT), jnp.sum(mask_BT)


def loss_fn(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch) -> tuple[jax.Array, jax.Array]:
  """Mean loss over loss tokens, and their count."""
  model = nnx.merge(graphdef, params)
  logits_BTV = model(batch["inputs"], batch["segment_ids"], batch["positions"])
  total, count = cross_entropy(logits_BTV, batch["targets"], batch["loss_mask"])
  return total / jnp.maximum(count, 1.0), count


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                    lr_schedule: optax.Schedule) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
  def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
    grad_fn = jax.value_and_grad(lambda p: loss_fn(graphdef, p, batch), has_aux=True)
    (loss, num_tokens), grads = grad_fn(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        "loss": loss,
        "grad_norm": optax.tree.norm(grads),  # before clipping
        "lr": lr_schedule(state.step),
        "loss_tokens": num_tokens,
    }
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return train_step


def make_eval_step(graphdef: nnx.GraphDef) -> Callable[[nnx.State, Batch], tuple[jax.Array, jax.Array]]:
  def eval_step(params: nnx.State, batch: Batch) -> tuple[jax.Array, jax.Array]:
    logits_BTV = nnx.merge(graphdef, params)(batch["inputs"], batch["segment_ids"], batch["positions"])
    return cross_entropy(logits_BTV, batch["targets"], batch["loss_mask"])

  return eval_step
