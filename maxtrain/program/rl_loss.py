"""The GRPO objective as pure functions of per-token log-probabilities (no model inside): the group
-normalised advantages, the clipped importance-ratio surrogate, the k3 estimate of KL(policy || ref)
and token-level averaging. `program/rl_step.py` feeds it the training forward pass's log-probs.

Shape legend: B rows (completions), T length, P prompts, G completions per prompt (B = P x G).

For completion i of a group with rewards r_1..r_G:
  A_i = (r_i - mean(r)) / (std(r) + eps)        population std; a group of equal rewards gives A = 0
and per response token t (mask 1), with logp the current policy, old the policy that sampled the
rollout (kept, not differentiated), ref the frozen reference:
  ratio = exp(logp - old)
  surrogate = min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A)
  kl_k3 = exp(ref - logp) - (ref - logp) - 1      (>= 0; unbiased for KL(policy || ref) under policy samples)
  loss = sum_t mask * (kl_coef * kl_k3 - surrogate) / sum_t mask   (token-level: every token counts the same)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ADVANTAGE_EPS = 1e-6


def group_advantages(rewards_PG: jax.Array, eps: float = ADVANTAGE_EPS) -> jax.Array:
  """[P, G] advantages: each reward minus its group's mean over the group's (population) std + eps."""
  rewards_PG = rewards_PG.astype(jnp.float32)
  mean = jnp.mean(rewards_PG, axis=-1, keepdims=True)
  std = jnp.std(rewards_PG, axis=-1, keepdims=True)
  return (rewards_PG - mean) / (std + eps)


def k3_kl(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
  """Per-token k3 estimate of KL(policy || ref) from a policy sample: exp(d) - d - 1, d = ref - logp."""
  d = ref_logp - logp
  return jnp.exp(d) - d - 1.0


def grpo_loss(logp_BT: jax.Array, old_logp_BT: jax.Array, ref_logp_BT: jax.Array, advantages_BT: jax.Array,
              mask_BT: jax.Array, *, clip_eps: float, kl_coef: float) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(token-mean loss, metrics: kl, clip_fraction, ratio_mean, tokens), all fp32. `old_logp_BT` and
  `ref_logp_BT` are constants (gradients stopped); advantages are per token (a row's A repeated)."""
  logp = logp_BT.astype(jnp.float32)
  old = jax.lax.stop_gradient(old_logp_BT.astype(jnp.float32))
  ref = jax.lax.stop_gradient(ref_logp_BT.astype(jnp.float32))
  adv = jax.lax.stop_gradient(advantages_BT.astype(jnp.float32))
  mask = mask_BT.astype(jnp.float32)
  count = jnp.maximum(jnp.sum(mask), 1.0)
  ratio = jnp.exp(logp - old)
  clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
  surrogate = jnp.minimum(ratio * adv, clipped * adv)
  kl = k3_kl(logp, ref)
  loss = jnp.sum(mask * (kl_coef * kl - surrogate)) / count
  was_clipped = (clipped * adv < ratio * adv).astype(jnp.float32)  # the min took the clipped term
  metrics = {"kl": jnp.sum(mask * kl) / count, "clip_fraction": jnp.sum(mask * was_clipped) / count,
             "ratio_mean": jnp.sum(mask * ratio) / count, "tokens": jnp.sum(mask)}
  return loss, metrics
