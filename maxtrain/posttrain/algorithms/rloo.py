"""RLOO (Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019): REINFORCE with a leave-one-out baseline.

Each completion's baseline is the mean reward of the other G - 1 completions of its prompt, which
does not depend on the completion itself, so the estimate is unbiased (GRPO's group mean includes
r_i, a 1/G bias):
  A_i = r_i - (sum_j r_j - r_i) / (G - 1) = G / (G - 1) x (r_i - mean(r))
No std normalisation. Loss: GRPO's token-level clipped surrogate with the k3 KL (with one update per
rollout the ratio is 1 and the surrogate is plain REINFORCE; the clip only matters off-policy).
"""

from __future__ import annotations

import numpy as np

from maxtrain.posttrain.algorithms.base import Algorithm, Hyper, per_row, token_mean_loss


def advantages(rewards_PG: np.ndarray, old_BT: np.ndarray, ref_BT: np.ndarray, mask_BT: np.ndarray,
               hp: Hyper) -> np.ndarray:
  r = np.asarray(rewards_PG, np.float32)
  G = r.shape[-1]
  return per_row(r - (r.sum(axis=-1, keepdims=True) - r) / (G - 1), mask_BT)


ALGORITHM = Algorithm("rloo", advantages, token_mean_loss, defaults={"clip_eps": 0.2, "kl_coef": 0.02})
