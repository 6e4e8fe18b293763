"""Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): GRPO without its two biases.

GRPO's std normalisation weighs prompts by 1 / std(r) (too easy and too hard prompts, whose rewards
barely differ, get the largest weights), and its per-sequence length normalisation (1/|o_i|) makes a
wrong long answer cost less per token than a wrong short one, so lengths grow. Dr. GRPO removes both:
  A_i = r_i - mean(r)                                                     (no std)
  loss = sum_{i,t} mask (kl_coef kl_k3 - min(ratio A, clip(ratio) A)) / (B x max_new_tokens)
a sum over each sequence's tokens divided by one constant (the rows times the generation budget), so
the gradient is the unbiased policy gradient of the mean reward, whatever the lengths.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from maxtrain.posttrain.algorithms.base import Algorithm, Hyper, clipped_token_terms, per_row


def advantages(rewards_PG: np.ndarray, old_BT: np.ndarray, ref_BT: np.ndarray, mask_BT: np.ndarray,
               hp: Hyper) -> np.ndarray:
  r = np.asarray(rewards_PG, np.float32)
  return per_row(r - r.mean(axis=-1, keepdims=True), mask_BT)


def loss(logp_BT, old_logp_BT, ref_logp_BT, advantages_BT, mask_BT, hp: Hyper):
  terms, metrics = clipped_token_terms(logp_BT, old_logp_BT, ref_logp_BT, advantages_BT, mask_BT, hp)
  return jnp.sum(terms) / (mask_BT.shape[0] * hp.max_new_tokens), metrics


ALGORITHM = Algorithm("dr_grpo", advantages, loss, defaults={"clip_eps": 0.2, "kl_coef": 0.0})
