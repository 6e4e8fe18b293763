"""REINFORCE++ (Hu 2025): REINFORCE with PPO's stabilisers and a batch-wide normalisation, no critic.

The KL to the reference is part of the reward, per token (k1, from the rollout's log-probabilities),
and each token's return is the sequence reward minus the KL still to come:
  kl_t = old_t - ref_t,     G_t = r - kl_coef sum_{s >= t} kl_s       (gamma = 1; r at the last token)
The advantages are those returns normalised over every completion token of the whole batch (not per
group: a prompt's difficulty is left in the signal, and no single group's small std inflates it):
  A_t = (G_t - mean_batch(G)) / (std_batch(G) + eps)
Loss: the token-level clipped surrogate, with no KL term (the KL is in the reward already).
"""

from __future__ import annotations

import numpy as np

from maxtrain.posttrain.algorithms.base import ADVANTAGE_EPS, Algorithm, Hyper, token_mean_loss


def advantages(rewards_PG: np.ndarray, old_BT: np.ndarray, ref_BT: np.ndarray, mask_BT: np.ndarray,
               hp: Hyper) -> np.ndarray:
  mask = np.asarray(mask_BT, np.float64)
  kl = (np.asarray(old_BT, np.float64) - np.asarray(ref_BT, np.float64)) * mask
  to_come = np.cumsum(kl[:, ::-1], axis=1)[:, ::-1]  # sum_{s >= t} kl_s
  returns = np.asarray(rewards_PG, np.float64).reshape(-1, 1) - hp.kl_coef * to_come
  n = max(mask.sum(), 1.0)
  mean = (returns * mask).sum() / n
  std = np.sqrt((np.square(returns - mean) * mask).sum() / n)
  return ((returns - mean) / (std + ADVANTAGE_EPS) * mask).astype(np.float32)


def loss(logp_BT, old_logp_BT, ref_logp_BT, advantages_BT, mask_BT, hp: Hyper):
  import dataclasses

  return token_mean_loss(logp_BT, old_logp_BT, ref_logp_BT, advantages_BT, mask_BT,
                         dataclasses.replace(hp, kl_coef=0.0))  # the KL is in the advantages


ALGORITHM = Algorithm("reinforce_pp", advantages, loss, defaults={"clip_eps": 0.2, "kl_coef": 0.01})
