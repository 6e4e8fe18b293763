"""What every RL algorithm is made of, and the pieces they share.

An `Algorithm` is an advantage estimator (host side, once per round, on the round's rewards and the
rollout's log-probabilities) and a loss (in the jitted step, differentiated in the current policy's
log-probabilities), plus its recommended settings of the shared `post.*` keys that are left at -1
("the algorithm's default"). Shape legend: P prompts, G completions per prompt, B = P x G rows, T length.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

ADVANTAGE_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Hyper:
  """The resolved hyperparameters of a run's algorithm (`post.*`, -1 replaced by the algorithm's default)."""
  clip_low: float = 0.2  # ratio clipped below at 1 - clip_low
  clip_high: float = 0.2  # ... and above at 1 + clip_high
  kl_coef: float = 0.02  # weight of the k3 KL to the reference in the loss
  max_new_tokens: int = 6  # the generation budget (Dr. GRPO's constant normaliser, DAPO's overlong length)
  overlong_buffer: int = 0  # DAPO: tokens before max_new_tokens where the length penalty ramps to -1; 0 = off
  max_draws: int = 1  # DAPO: prompt batches drawn per round to fill it with groups whose rewards differ
  gamma: float = 1.0  # PPO: GAE discount
  lam: float = 0.95  # PPO: GAE lambda
  value_clip: float = 0.2  # PPO: the value loss's clip around the rollout's values


Advantages = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Hyper], np.ndarray]
Loss = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class Algorithm:
  name: str
  # (rewards [P, G], old log-probs [B, T], reference log-probs [B, T], loss mask [B, T], hyper) -> advantages [B, T]
  advantages: Advantages
  # (logp [B, T], old [B, T], ref [B, T], advantages [B, T], mask [B, T], hyper) -> (loss, metrics)
  loss: Loss
  defaults: dict  # the algorithm's recommended values of post.* keys left at -1
  dynamic_sampling: bool = False  # drop groups of equal rewards and draw more prompts (DAPO)
  # A critic (PPO): `advantages` also takes values_BT= (the critic's at the rollout) and returns
  # (advantages, returns); value_loss(values, old_values, returns, mask, hyper) -> (loss, metrics).
  critic: bool = False
  value_loss: Callable | None = None


def per_row(adv_PG: np.ndarray, mask_BT: np.ndarray) -> np.ndarray:
  """A sequence-level advantage [P, G] spread over its row's completion tokens: [B, T] float32."""
  return (np.asarray(adv_PG, np.float32).reshape(-1, 1) * mask_BT).astype(np.float32)


def group_advantages(rewards_PG: jax.Array, eps: float = ADVANTAGE_EPS) -> jax.Array:
  """[P, G] advantages: each reward minus its group's mean over the group's (population) std + eps."""
  rewards_PG = jnp.asarray(rewards_PG).astype(jnp.float32)
  mean = jnp.mean(rewards_PG, axis=-1, keepdims=True)
  std = jnp.std(rewards_PG, axis=-1, keepdims=True)
  return (rewards_PG - mean) / (std + eps)


def k3_kl(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
  """Per-token k3 estimate of KL(policy || ref) from a policy sample: exp(d) - d - 1, d = ref - logp."""
  d = ref_logp - logp
  return jnp.exp(d) - d - 1.0


def clipped_token_terms(logp_BT: jax.Array, old_logp_BT: jax.Array, ref_logp_BT: jax.Array, advantages_BT: jax.Array,
                        mask_BT: jax.Array, hp: Hyper) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Per-token (kl_coef x k3 - min(ratio A, clip(ratio, 1 - clip_low, 1 + clip_high) A)) [B, T] and the
  metrics every token-ratio algorithm reports (token means over the mask)."""
  logp = logp_BT.astype(jnp.float32)
  old = jax.lax.stop_gradient(old_logp_BT.astype(jnp.float32))
  ref = jax.lax.stop_gradient(ref_logp_BT.astype(jnp.float32))
  adv = jax.lax.stop_gradient(advantages_BT.astype(jnp.float32))
  mask = mask_BT.astype(jnp.float32)
  count = jnp.maximum(jnp.sum(mask), 1.0)
  ratio = jnp.exp(logp - old)
  clipped = jnp.clip(ratio, 1.0 - hp.clip_low, 1.0 + hp.clip_high)
  surrogate = jnp.minimum(ratio * adv, clipped * adv)
  kl = k3_kl(logp, ref)
  was_clipped = (clipped * adv < ratio * adv).astype(jnp.float32)  # the min took the clipped term
  metrics = {"kl": jnp.sum(mask * kl) / count, "clip_fraction": jnp.sum(mask * was_clipped) / count,
             "ratio_mean": jnp.sum(mask * ratio) / count, "tokens": jnp.sum(mask)}
  return mask * (hp.kl_coef * kl - surrogate), metrics


def token_mean_loss(logp_BT, old_logp_BT, ref_logp_BT, advantages_BT, mask_BT, hp: Hyper):
  """The token-level loss: every completion token of the batch weighs the same (sum / tokens)."""
  terms, metrics = clipped_token_terms(logp_BT, old_logp_BT, ref_logp_BT, advantages_BT, mask_BT, hp)
  return jnp.sum(terms) / jnp.maximum(jnp.sum(mask_BT.astype(jnp.float32)), 1.0), metrics
