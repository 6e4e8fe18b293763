"""GRPO (Shao et al. 2024, DeepSeekMath), as maxtrain has run it since issue 30.

Advantage: for completion i of a group with rewards r_1..r_G,
  A_i = (r_i - mean(r)) / (std(r) + eps)        population std; a group of equal rewards gives A = 0.
The group mean is a baseline (an unbiased REINFORCE estimate for any baseline that does not depend on
the sample itself, up to the 1/G share of r_i in the mean); the std makes the scale per prompt.
Loss, per completion token t (mask 1), logp the current policy, old the policy that sampled the
rollout (kept, not differentiated), ref the frozen reference:
  ratio = exp(logp - old)
  surrogate = min(ratio A, clip(ratio, 1 - clip_eps, 1 + clip_eps) A)      (PPO's clipped objective)
  kl_k3 = exp(ref - logp) - (ref - logp) - 1      (>= 0; unbiased for KL(policy || ref) under policy samples)
  loss = sum_t mask (kl_coef kl_k3 - surrogate) / sum_t mask               (token-level: every token counts the same)
"""

from __future__ import annotations

import numpy as np

from maxtrain.posttrain.algorithms.base import Algorithm, Hyper, group_advantages, per_row, token_mean_loss


def advantages(rewards_PG: np.ndarray, old_BT: np.ndarray, ref_BT: np.ndarray, mask_BT: np.ndarray,
               hp: Hyper) -> np.ndarray:
  return per_row(np.asarray(group_advantages(rewards_PG)), mask_BT)


ALGORITHM = Algorithm("grpo", advantages, token_mean_loss, defaults={"clip_eps": 0.2, "kl_coef": 0.02})
