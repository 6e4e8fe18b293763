"""DAPO (Yu et al. 2025, Decoupled clip and Dynamic sAmpling Policy Optimization): GRPO with four changes.

1. Clip-higher: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high] with clip_eps_high > clip_eps
   (0.2, 0.28): a symmetric clip caps how fast an unlikely token with a positive advantage can grow,
   which collapses the entropy; a looser upper bound leaves exploration room.
2. Dynamic sampling: a group whose completions all earn the same reward has A = 0 and no gradient; such
   groups are dropped and more prompts are drawn (up to post.max_draws batches a round) to fill the
   batch with groups that teach something (`rollout.py`); if the draws run out, the batch is topped up
   with the dropped groups (their only term is the KL).
3. Token-level loss: sum over every completion token of the batch / tokens (GRPO as maxtrain runs it
   already; the paper's GRPO averages per sequence first).
4. Overlong shaping: a soft length penalty added to the reward, for L = max_new_tokens, C = overlong_buffer:
     R_len(|o|) = 0 if |o| <= L - C;  ((L - C) - |o|) / C if L - C < |o| <= L  (down to -1)
   so a truncated answer is discouraged smoothly instead of scored like a wrong one.
No KL term by default (kl_coef 0: long reasoning is meant to drift from the reference).
Advantages: GRPO's group-normalised ones on the shaped rewards.
"""

from __future__ import annotations

import numpy as np

from maxtrain.posttrain.algorithms.base import Algorithm, Hyper, group_advantages, per_row, token_mean_loss


def overlong_penalty(lengths: np.ndarray, hp: Hyper) -> np.ndarray:
  """R_len per completion (its tokens, EOS included); 0 everywhere when overlong_buffer is 0."""
  if hp.overlong_buffer <= 0:
    return np.zeros(len(lengths), np.float32)
  start = hp.max_new_tokens - hp.overlong_buffer
  return np.clip((start - np.asarray(lengths, np.float32)) / hp.overlong_buffer, -1.0, 0.0).astype(np.float32)


def advantages(rewards_PG: np.ndarray, old_BT: np.ndarray, ref_BT: np.ndarray, mask_BT: np.ndarray,
               hp: Hyper) -> np.ndarray:
  lengths = np.asarray(mask_BT).sum(axis=1)  # the loss mask covers each completion's tokens, EOS included
  shaped = np.asarray(rewards_PG, np.float32) + overlong_penalty(lengths, hp).reshape(np.shape(rewards_PG))
  return per_row(np.asarray(group_advantages(shaped)), mask_BT)


ALGORITHM = Algorithm("dapo", advantages, token_mean_loss, dynamic_sampling=True,
                      defaults={"clip_eps": 0.2, "clip_eps_high": 0.28, "kl_coef": 0.0, "max_draws": 3,
                                "overlong_buffer": lambda post: max(1, post.max_new_tokens // 4)})
