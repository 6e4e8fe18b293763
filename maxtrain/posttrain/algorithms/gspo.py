"""GSPO (Zheng et al. 2025, Group Sequence Policy Optimization): the importance ratio of a sequence.

The reward is given per sequence, so GSPO corrects off-policy samples per sequence too: a token-level
ratio weighs each token by a one-sample estimate whose noise grows with length. Its sequence ratio is
the length-normalised likelihood ratio (a geometric mean of the token ratios):
  s_i = exp( (1/|o_i|) sum_t (logp_t - old_t) )
  A_i = GRPO's group-normalised advantage
  loss = mean_i -min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i) + kl_coef x token-mean k3
Since s_i is a mean over ~|o_i| tokens, its clip range is ~3e-4..4e-4, two orders below the token one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.posttrain.algorithms.base import Algorithm, Hyper, group_advantages, k3_kl, per_row


def advantages(rewards_PG: np.ndarray, old_BT: np.ndarray, ref_BT: np.ndarray, mask_BT: np.ndarray,
               hp: Hyper) -> np.ndarray:
  return per_row(np.asarray(group_advantages(rewards_PG)), mask_BT)


def loss(logp_BT, old_logp_BT, ref_logp_BT, advantages_BT, mask_BT, hp: Hyper):
  logp = logp_BT.astype(jnp.float32)
  old = jax.lax.stop_gradient(old_logp_BT.astype(jnp.float32))
  ref = jax.lax.stop_gradient(ref_logp_BT.astype(jnp.float32))
  adv_BT = jax.lax.stop_gradient(advantages_BT.astype(jnp.float32))
  mask = mask_BT.astype(jnp.float32)
  length_B = jnp.sum(mask, axis=1)
  rows = length_B > 0
  safe = jnp.maximum(length_B, 1.0)
  ratio_B = jnp.exp(jnp.sum(mask * (logp - old), axis=1) / safe)
  adv_B = jnp.sum(adv_BT * mask, axis=1) / safe  # the row's A (spread over its tokens)
  clipped = jnp.clip(ratio_B, 1.0 - hp.clip_low, 1.0 + hp.clip_high)
  surrogate_B = jnp.minimum(ratio_B * adv_B, clipped * adv_B)
  n_rows = jnp.maximum(jnp.sum(rows), 1)
  count = jnp.maximum(jnp.sum(mask), 1.0)
  kl = k3_kl(logp, ref)
  loss = -jnp.sum(jnp.where(rows, surrogate_B, 0.0)) / n_rows + hp.kl_coef * jnp.sum(mask * kl) / count
  was_clipped = (clipped * adv_B < ratio_B * adv_B) & rows
  metrics = {"kl": jnp.sum(mask * kl) / count, "clip_fraction": jnp.sum(was_clipped) / n_rows,
             "ratio_mean": jnp.sum(jnp.where(rows, ratio_B, 0.0)) / n_rows, "tokens": jnp.sum(mask)}
  return loss, metrics


ALGORITHM = Algorithm("gspo", advantages, loss, defaults={"clip_eps": 3e-4, "clip_eps_high": 4e-4, "kl_coef": 0.0})
