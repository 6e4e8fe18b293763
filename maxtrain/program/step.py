"""The jitted train and eval steps: pure functions of (state, batch).

Everything happens in the graph: no host callbacks, no lax.cond, no data-dependent Python,
so the same step compiles on every backend.

Shape legend: B batch, T length, D model.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.program import loss, microbatch, update as update_lib
from maxtrain.optim import optimizer as optim
from maxtrain.models import moe as moe_lib
from maxtrain.models import mtp as mtp_lib
from maxtrain.models.moe import MoEConfig
from maxtrain.models import stack as stack_lib
from maxtrain.sharding import context_attention, pipeline as pipeline_lib
from maxtrain.sharding import schedules
from maxtrain.program.state import TrainState

Batch = dict[str, jax.Array]


def head_losses(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, *, chunk_tokens: int = 0,
                batch_shards: int = 1, length_shards: int = 1) -> tuple[jax.Array, jax.Array, dict[str, jax.Array], MoEConfig]:
  """Per-token (cross-entropy, log Z) of the model on `batch`, fp32: the output head through
  `loss.head_losses` (chunked when `chunk_tokens` > 0: never the full [B, T, V] logits); the MoE
  layers' statistics (models/moe.py STATS, stacked over MoE layers; {} for a dense model), and the
  model's own MoE config, whose loss weights the objective uses."""
  ce_BT, log_z_BT, moe_stats, moe, _ = head_losses_and_features(graphdef, params, batch, chunk_tokens=chunk_tokens,
                                                                batch_shards=batch_shards, length_shards=length_shards)
  return ce_BT, log_z_BT, moe_stats, moe


def head_losses_and_features(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, *, chunk_tokens: int = 0,
                             batch_shards: int = 1, length_shards: int = 1,
                             stack_hook: pipeline_lib.StackHook | None = None,
                             ) -> tuple[jax.Array, jax.Array, dict, MoEConfig, jax.Array]:
  """`head_losses` and the features the head reads, [B, T, D] (a critic's value head reads them too).
  `stack_hook`: sharding/schedules.py's, run in place of the pipelined layer stack (models/stack.py)."""
  model = nnx.merge(graphdef, params)
  x_BTD, moe_stats = model.features(batch["inputs"], batch["segment_ids"], batch["positions"], stack_hook)
  ce_BT, log_z_BT = _head(model, x_BTD, batch["targets"], chunk_tokens, batch_shards, length_shards)
  return ce_BT, log_z_BT, moe_stats, model.cfg.moe, x_BTD


def _head(model, x_BTD, targets_BT, chunk_tokens, batch_shards, length_shards) -> tuple[jax.Array, jax.Array]:
  return loss.head_losses(x_BTD, model.head_weights(), targets_BT, chunk_tokens=chunk_tokens,
                          compute_dtype=model.cfg.compute_dtype, batch_shards=batch_shards,
                          length_shards=length_shards, quant=model.cfg.quant.for_kind("head"),
                          logit_cap=model.cfg.final_logit_softcap, parallel=model.parallel)


def mtp_parts(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, x_BTD: jax.Array, *, chunk_tokens: int = 0,
              batch_shards: int = 1, length_shards: int = 1) -> dict[str, jax.Array]:
  """Per multi-token-prediction depth k (models/mtp.py): `mtp_ce_k`, the sum of its cross-entropy over its valid
  positions (`mtp.depth_targets`), and `mtp_count_k`, their number; {} without MTP. `x_BTD`: the main features."""
  model = nnx.merge(graphdef, params)
  if not model.cfg.mtp_layers:
    return {}
  parts = {}
  # Context parallelism lays each sequence out in its load-balancing order (program/batch.py context_order):
  # "k tokens later" is counted in the sequence's own order.
  order = context_attention.zigzag_order(x_BTD.shape[1], length_shards) if length_shards > 1 else None
  features = model.mtp_features(x_BTD, batch["inputs"], batch["segment_ids"], batch["positions"], order)
  for k, h_BTD in enumerate(features, start=1):
    targets_BT, mask_BT = mtp_lib.depth_targets(batch, k, order)
    ce_BT, _ = _head(model, h_BTD, targets_BT, chunk_tokens, batch_shards, length_shards)
    parts[f"mtp_ce_{k}"], parts[f"mtp_count_{k}"] = jnp.sum(ce_BT * mask_BT), jnp.sum(mask_BT)
  return parts


def _moe_parts(moe_stats: dict[str, jax.Array], count: jax.Array) -> dict[str, jax.Array]:
  """The MoE layers' statistics as sums over microbatches. aux and z are means over a microbatch's
  tokens (aux is not a sum over tokens: a product of two means), averaged over MoE layers, then
  weighted by the microbatch's loss tokens so that `loss_and_grads`'s single division by all loss
  tokens gives their token-weighted mean, as for the cross-entropy (exactly the batch's value for one
  microbatch)."""
  return {"moe_aux": jnp.mean(moe_stats["aux"]) * count, "moe_z": jnp.mean(moe_stats["z"]) * count,
          "moe_load": moe_stats["load"], "moe_dropped": jnp.sum(moe_stats["dropped"]),
          "moe_assignments": jnp.sum(moe_stats["assignments"]), "moe_a2a_bytes": jnp.sum(moe_stats["a2a_bytes"]),
          # per layer [L]; the one part microbatches combine by their max (microbatch.py: the `_max` suffix)
          "moe_capacity_needed_max": moe_stats["capacity_needed"]}


def loss_sums(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, z_loss: float = 0.0, *,
              chunk_tokens: int = 0, batch_shards: int = 1, length_shards: int = 1,
              with_mtp: bool = True, stack_hook: pipeline_lib.StackHook | None = None,
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(objective summed over loss tokens, its parts): sums, not means, so that microbatches add up.

  objective = sum of (cross-entropy + z_loss * log(Z)^2) over loss tokens; the z term keeps the
  softmax normaliser near 1 (PaLM), which keeps bf16 logits well conditioned. A MoE model adds
  aux_loss_weight x its load-balancing loss and router_z_loss_weight x its router z-loss (`_moe_parts`),
  the weights of the model's own config; a model with multi-token prediction (`with_mtp`) its `mtp_parts`.
  `stack_hook`: see `head_losses_and_features`.
  """
  chunking = dict(chunk_tokens=chunk_tokens, batch_shards=batch_shards, length_shards=length_shards)
  ce_BT, log_z_BT, moe_stats, moe, x_BTD = head_losses_and_features(graphdef, params, batch, **chunking,
                                                                    stack_hook=stack_hook)
  mask_BT = batch["loss_mask"].astype(jnp.float32)
  parts = {"ce": jnp.sum(ce_BT * mask_BT), "z": jnp.sum(jnp.square(log_z_BT) * mask_BT), "count": jnp.sum(mask_BT)}
  objective = parts["ce"] + z_loss * parts["z"]
  mtp = mtp_parts(graphdef, params, batch, x_BTD, **chunking) if with_mtp else {}
  if mtp:  # DeepSeek-V3: weight x the mean over depths of each depth's CE summed and divided by the main count
    parts.update(mtp)
    depths = len(mtp) // 2
    cfg = nnx.merge(graphdef, params).cfg
    objective = objective + cfg.mtp_loss_weight / depths * sum(mtp[f"mtp_ce_{k}"] for k in range(1, depths + 1))
  if moe_stats:
    parts.update(_moe_parts(moe_stats, parts["count"]))
    objective = objective + moe.aux_loss_weight * parts["moe_aux"] + moe.router_z_loss_weight * parts["moe_z"]
  return objective, parts


def moe_metrics(parts: dict[str, jax.Array], count: jax.Array) -> dict[str, jax.Array]:
  """The MoE metrics of a step's summed parts: the two losses (unweighted), the dropped assignments (count
  and share), the bytes the expert-parallel all-to-alls sent between devices, per MoE layer [L] the load
  entropy / log E, the max / mean expert load and the capacity_factor that would have dropped nothing,
  and per layer and expert [L, E] the assignments (tokens per expert)."""
  load_LE = parts["moe_load"]
  return {"moe/aux_loss": parts["moe_aux"] / count, "moe/router_z_loss": parts["moe_z"] / count,
          "moe/dropped_fraction": parts["moe_dropped"] / jnp.maximum(parts["moe_assignments"], 1.0),
          "moe/dropped": parts["moe_dropped"], "moe/all_to_all_bytes": parts["moe_a2a_bytes"],
          "moe/capacity_needed": parts["moe_capacity_needed_max"], "moe/expert_load": load_LE,
          "moe/load_entropy": moe_lib.load_entropy(load_LE),
          "moe/max_load": jnp.max(load_LE, axis=-1) / jnp.maximum(jnp.mean(load_LE, axis=-1), 1e-9)}


def loss_and_grads(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, *, z_loss: float = 0.0,
                   grad_accum_steps: int = 1, chunk_tokens: int = 0,
                   batch_shards: int = 1, length_shards: int = 1) -> tuple[dict[str, jax.Array], nnx.State]:
  """Metrics (mean cross-entropy `loss`, `z_loss` term, `loss_tokens`; of a MoE model `moe_metrics`
  and `moe_load`, the [L, E] assignments per layer and expert that the router bias follows) and the
  gradient of the mean objective over the batch's loss tokens."""
  # The model's own stack (the builder's: models/stack.py) says whether a schedule writes the backward.
  stack = nnx.merge(graphdef, params).stack
  schedule = stack.schedule if isinstance(stack, stack_lib.Pipelined) else None

  def sums_and_grads(p, b):
    objective = lambda p, b=b, hook=None: loss_sums(graphdef, p, b, z_loss, chunk_tokens=chunk_tokens,
                                                    batch_shards=batch_shards, length_shards=length_shards,
                                                    stack_hook=hook)
    if schedule is not None and schedule.kind != "gpipe":  # the backward written by the schedule, not autodiff
      return schedules.value_and_grad(objective, p, b, schedule)
    (_, parts), grads = jax.value_and_grad(objective, has_aux=True)(p)
    return parts, grads

  parts, grads = microbatch.accumulate(sums_and_grads, params, batch, grad_accum_steps)
  count = jnp.maximum(parts["count"], 1.0)
  grads = jax.tree.map(lambda g: (g / count).astype(g.dtype), grads)
  metrics = {"loss": parts["ce"] / count, "loss_tokens": parts["count"]}
  if z_loss:
    metrics["z_loss"] = z_loss * parts["z"] / count  # the term added to the objective
  if "moe_load" in parts:
    metrics.update(moe_metrics(parts, count), moe_load=parts["moe_load"])
  metrics.update(mtp_metrics(parts))
  return metrics, grads


def mtp_metrics(parts: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """`mtp/loss_<k>`: depth k's mean cross-entropy over its own valid positions (TensorBoard `train/mtp/loss_<k>`)."""
  depths = sum(1 for name in parts if name.startswith("mtp_ce_"))
  return {f"mtp/loss_{k}": parts[f"mtp_ce_{k}"] / jnp.maximum(parts[f"mtp_count_{k}"], 1.0)
          for k in range(1, depths + 1)}


def make_train_step(graphdef: nnx.GraphDef, optimizer: optim.Optimizer, *, z_loss: float = 0.0,
                    moe: MoEConfig = MoEConfig(), grad_accum_steps: int = 1, spike_zscore: float = 6.0,
                    spike_warmup: int = 20, chunk_tokens: int = 0,
                    batch_shards: int = 1, length_shards: int = 1,
                    perturb: update_lib.Perturb | None = None) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
  """The step. `perturb`: a change to the loss and gradients before the guards (a drill: `program/drills.py`).
  `chunk_tokens`, `batch_shards`, `length_shards`: see `loss.head_losses`. How the model is laid out and its
  layer stacks run (a pipeline) is the graphdef's own (program/state.py `spec` builds it): the step reads the
  model's `parallel` for the optimizer's layout (Muon) too."""
  def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
    metrics, grads = loss_and_grads(graphdef, state.params, batch, z_loss=z_loss,
                                    grad_accum_steps=grad_accum_steps,
                                    chunk_tokens=chunk_tokens, batch_shards=batch_shards,
                                    length_shards=length_shards)
    load_LE = metrics.pop("moe_load", None)
    # aux-loss-free balancing: part of the candidate, so a skipped step keeps the old bias too
    adjust = (lambda p: moe_lib.update_router_bias(p, load_LE, moe.bias_update_rate)) if moe.bias_update_rate else None
    state, metrics["loss"], update_metrics = update_lib.guarded_update(
        state, metrics["loss"], grads, optimizer, spike_zscore=spike_zscore, spike_warmup=spike_warmup,
        parallel=nnx.merge(graphdef, state.params).parallel, adjust_candidate=adjust, perturb=perturb)
    metrics.update(update_metrics)
    return state, metrics

  return train_step


def make_eval_step(graphdef: nnx.GraphDef, *, chunk_tokens: int = 0, batch_shards: int = 1,
                   length_shards: int = 1) -> Callable[[nnx.State, Batch], tuple[jax.Array, jax.Array]]:
  """(sum of token losses, loss tokens) of a batch: sums, so batches add up. The graphdef's layout and stack
  (a pipeline runs its forward: sharding/pipeline.py) are the model's own."""
  def eval_step(params: nnx.State, batch: Batch) -> tuple[jax.Array, jax.Array]:
    # the main model's loss only: the MTP depths would add compute to a number no one reads
    _, parts = loss_sums(graphdef, params, batch, chunk_tokens=chunk_tokens, batch_shards=batch_shards,
                         length_shards=length_shards, with_mtp=False)
    return parts["ce"], parts["count"]

  return eval_step
