"""Multi-token prediction (DeepSeek-V3, `model.mtp_layers`): extra modules that predict tokens further ahead.

Depth k (1..K) at position i predicts token t_{i+k+1} from the previous depth's hidden state h^{k-1}_i (depth 0:
the main model's final-norm output, what the output head reads) and the embedding of token t_{i+k}:

  h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])   (the order DeepSeek's checkpoints hold: embedding first)
  h^k  = Block(h')                                           (one decoder layer of the family, causal over i)
  logits = Head(norm(h^k))                                   (`shared_head.norm`; the main model's head and embedding)

The decoder builds the modules (`models/decoder.py`: a Block of the family, MoE when the model's last layer is) and
`program/step.py` adds the loss: main CE + mtp_loss_weight x mean over depths of the depth's CE, each summed over its
valid positions and divided by the main loss-token count (DeepSeek-V3's 1/T normalisation, so microbatches add
up); the per-depth mean CE over its own positions is reported as `mtp/loss_<k>`.

Decoding (`inference/speculative.py`): depth 1 drafts the token after next, the main model verifies it.

Shape legend: B batch, T length, D model, K depths.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxtrain.models.layers import param, project


class MTPLayer(nnx.Module):
  """One depth: its two input norms, the 2D -> D projection, a Block of the family, its output norm."""

  def __init__(self, d_model: int, block: nnx.Module, make_norm, *, init_std: float, param_dtype: Any,
               compute_dtype: Any, rngs: nnx.Rngs):
    self.enorm, self.hnorm, self.norm = make_norm(), make_norm(), make_norm()
    # Logical axes of a residual-writing matrix (the MLP's down projection's): its 2D input dim is not the stream.
    self.eh_proj = param(rngs, nnx.initializers.normal(init_std), (2 * d_model, d_model), ("mlp", "embed"),
                         param_dtype)
    self.block = block
    self.compute_dtype = compute_dtype

  def __call__(self, h_BTD: jax.Array, e_BTD: jax.Array, segment_ids_BT: jax.Array, positions_BT: jax.Array,
               cache: Any = None, write: Any = None) -> tuple[jax.Array, jax.Array, Any]:
    """(this depth's hidden state h^k [B, T, D]: the next depth's input, its normed output: the head's input,
    the block's KV cache updated: None without one)."""
    x_BT2D = jnp.concatenate([self.enorm(e_BTD), self.hnorm(h_BTD)], axis=-1).astype(self.compute_dtype)
    x_BTD = project(x_BT2D, self.eh_proj[...].astype(self.compute_dtype))
    x_BTD, _, cache = self.block(x_BTD, segment_ids_BT, positions_BT, cache, write)
    return x_BTD, self.norm(x_BTD), cache


def shift_left(a_BT: jax.Array, k: int, fill: int | bool = 0, order: np.ndarray | None = None) -> jax.Array:
  """The element k tokens later in the sequence at each position; `fill` past the end. `order`: the sequence
  order of the array's positions (position j holds token order[j]: the context-parallel layout,
  sharding/context_attention.py zigzag_order), None: the natural order."""
  if k == 0:
    return a_BT
  if order is None:
    pad = jnp.full((a_BT.shape[0], k), fill, a_BT.dtype)
    return jnp.concatenate([a_BT[:, k:], pad], axis=1)
  order = np.asarray(order)
  later, inverse = order + k, np.argsort(order)  # token order[j] + k is at position inverse[order[j] + k]
  inside = later < len(order)
  index = np.where(inside, inverse[np.minimum(later, len(order) - 1)], 0)
  return jnp.where(jnp.asarray(inside)[None], jnp.take(a_BT, jnp.asarray(index), axis=1),
                   jnp.asarray(fill, a_BT.dtype))


def depth_targets(batch: dict[str, jax.Array], k: int, order: np.ndarray | None = None) -> tuple[jax.Array, jax.Array]:
  """(targets, loss mask) of depth k (1-based): position i predicts targets[i + k] = token t_{i+k+1}, counted where
  that target is a loss token and still in position i's document (same segment), and inside the sequence;
  `order`: as `shift_left`'s."""
  shift = lambda a, fill=0: shift_left(a, k, fill, order)
  targets_BT = shift(batch["targets"])
  same_BT = shift(batch["segment_ids"], -1) == batch["segment_ids"]
  mask_BT = shift(batch["loss_mask"].astype(jnp.float32)) * same_BT.astype(jnp.float32)
  return targets_BT, mask_BT
