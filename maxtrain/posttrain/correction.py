"""Off-policy correction of the RL loss (`post.correction`, `post.is_cap`): a per-token importance weight
of the trainer's policy at the round's start (the proximal policy, the "old" log-probs of the PPO ratio)
against the policy that sampled the rollout (its own log-probs, recorded by the generator), for rollouts
a few versions behind (`post.max_staleness`) or computed at another precision.

With pi_prox the trainer's probability of a completion token and pi_roll the rollout's, r_t =
pi_prox / pi_roll (computed as exp(old_logp - sampler_logp) on the completion tokens) and cap = is_cap:
  none       w = 1                                     (the ratio is taken against pi_prox alone)
  tis        w = min(r, cap)                            truncated IS (Yao et al. 2025; verl's rollout_is)
  mis        w = 1[1/cap <= r <= cap]                   masked IS (IcePop): a token the two policies disagree
                                                        on beyond the cap, either way, does not train
  decoupled  w = r 1[r <= cap]                          decoupled PPO (Hilton et al. 2021; AReaL): the
                                                        behaviour weight, tokens above the cap masked
Every algorithm's policy term is sum_t mask_t f(ratio_t, A_t) with f positively homogeneous in A
(min(ratio A, clip(ratio) A) and its sequence-level form), so w_t f(ratio_t, A_t) = f(ratio_t, w_t A_t):
the weight multiplies the round's advantages (host side, gradient-free as an IS weight must be) and the
jitted step is unchanged. The KL to the reference is not weighted (it is a regulariser, not an estimate
under the rollout's distribution). A sequence-level algorithm (gspo) reads the row's mean advantage,
so its weight is the mean of its tokens' weights.

Metrics (TensorBoard): `rl/mismatch_kl` the k3 estimate of KL(pi_roll || pi_prox) per completion token
under the rollout's samples, mean(exp(d) - d - 1) with d = old_logp - sampler_logp (>= 0, 0 iff equal);
`rl/is_weight_mean` the weights' token mean; `rl/is_clipped_share` (tis) or `rl/is_masked_share` (mis,
decoupled) the share of completion tokens the cap changed.
"""

from __future__ import annotations

import numpy as np


def weights(old_logp_BT: np.ndarray, sampler_logp_BT: np.ndarray, mask_BT: np.ndarray, kind: str,
            cap: float) -> tuple[np.ndarray, dict[str, float]]:
  """(per-token weights [B, T] float32, 1 off the completion tokens, and the round's scalars)."""
  mask = np.asarray(mask_BT, np.float64) > 0
  d = np.where(mask, np.asarray(old_logp_BT, np.float64) - np.asarray(sampler_logp_BT, np.float64), 0.0)
  ratio = np.exp(np.clip(d, -60.0, 60.0))  # a token the rollout found ~impossible: a huge ratio, not inf
  count = max(int(mask.sum()), 1)
  scalars = {"rl/mismatch_kl": float(np.sum(np.where(mask, np.expm1(d) - d, 0.0)) / count)}
  if kind == "none":
    w = np.ones_like(ratio)
  elif kind == "tis":
    w = np.minimum(ratio, cap)
    scalars["rl/is_clipped_share"] = float(np.sum(mask & (ratio > cap)) / count)
  elif kind == "mis":
    keep = (ratio <= cap) & (ratio >= 1.0 / cap)
    w = keep.astype(np.float64)
    scalars["rl/is_masked_share"] = float(np.sum(mask & ~keep) / count)
  elif kind == "decoupled":
    keep = ratio <= cap
    w = np.where(keep, ratio, 0.0)
    scalars["rl/is_masked_share"] = float(np.sum(mask & ~keep) / count)
  else:
    raise ValueError(f"unknown correction {kind!r}")  # plan.validate names the key before this runs
  w = np.where(mask, w, 1.0)
  scalars["rl/is_weight_mean"] = float(np.sum(np.where(mask, w, 0.0)) / count)
  return w.astype(np.float32), scalars
