"""PPO with a critic (Schulman et al. 2017; the RLHF recipe of Ouyang et al. 2022): advantages from a
learned value function by GAE, instead of a group baseline.

The critic (`program/critic.py`) is a value head on the policy's final features and on the log-probability
of the completion so far, V_t = w . h_t + u . e_t + b (their gradient stopped: its loss moves only the
head), a second parameter tree with its own Adam state, checkpointed with the policy. Per completion token t (the position whose target is token t of
the completion), with the KL to the reference in the reward (k1, from the rollout) and the sequence
reward R at the last token:
  r_t = -kl_coef (old_t - ref_t) + [t = last] R
  delta_t = r_t + gamma V_{t+1} - V_t          (V after the last token = 0)
  A_t = delta_t + gamma lam A_{t+1}              (GAE: lam = 1 gives Monte Carlo returns minus V, lam = 0 one-step TD)
  returns_t = A_t + V_t                          (the critic's target)
and A is whitened over the batch's completion tokens. V are the critic's values at the rollout (the old
values). Losses:
  policy = token mean of -min(ratio A, clip(ratio, 1 - clip_eps, 1 + clip_eps) A)   (no KL term: it is in r)
  value = token mean of 1/2 max((V - returns)^2, (V_old + clip(V - V_old, -value_clip, value_clip) - returns)^2)
(the clipped value loss keeps one update from moving a value further than value_clip from the rollout's).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.posttrain.algorithms.base import ADVANTAGE_EPS, Algorithm, Hyper, token_mean_loss


def gae(rewards_B: np.ndarray, old_BT: np.ndarray, ref_BT: np.ndarray, mask_BT: np.ndarray, values_BT: np.ndarray,
        hp: Hyper) -> tuple[np.ndarray, np.ndarray]:
  """(advantages before whitening, returns), float64 [B, T], zero off the mask."""
  mask = np.asarray(mask_BT, np.float64)
  values = np.asarray(values_BT, np.float64) * mask
  token_r = -hp.kl_coef * (np.asarray(old_BT, np.float64) - np.asarray(ref_BT, np.float64)) * mask
  B, T = mask.shape
  last = T - 1 - np.argmax(mask[:, ::-1] > 0, axis=1)  # each row's last completion position
  token_r[np.arange(B), last] += np.asarray(rewards_B, np.float64)
  adv = np.zeros((B, T))
  running, next_value = np.zeros(B), np.zeros(B)
  for t in range(T - 1, -1, -1):  # backwards; positions off the mask carry nothing through
    on = mask[:, t] > 0
    delta = token_r[:, t] + hp.gamma * next_value - values[:, t]
    running = np.where(on, delta + hp.gamma * hp.lam * running, running)
    next_value = np.where(on, values[:, t], next_value)
    adv[:, t] = np.where(on, running, 0.0)
  return adv, (adv + values) * mask


def advantages(rewards_PG: np.ndarray, old_BT: np.ndarray, ref_BT: np.ndarray, mask_BT: np.ndarray, hp: Hyper, *,
               values_BT: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(whitened advantages, returns), float32 [B, T]."""
  adv, returns = gae(np.asarray(rewards_PG).reshape(-1), old_BT, ref_BT, mask_BT, values_BT, hp)
  mask = np.asarray(mask_BT, np.float64)
  n = max(mask.sum(), 1.0)
  mean = (adv * mask).sum() / n
  std = np.sqrt((np.square(adv - mean) * mask).sum() / n)
  return ((adv - mean) / (std + ADVANTAGE_EPS) * mask).astype(np.float32), returns.astype(np.float32)


def loss(logp_BT, old_logp_BT, ref_logp_BT, advantages_BT, mask_BT, hp: Hyper):
  return token_mean_loss(logp_BT, old_logp_BT, ref_logp_BT, advantages_BT, mask_BT,
                         dataclasses.replace(hp, kl_coef=0.0))  # the KL is in the reward


def value_loss(values_BT: jax.Array, old_values_BT: jax.Array, returns_BT: jax.Array, mask_BT: jax.Array,
               hp: Hyper) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(the clipped value loss, metrics: value_loss, explained_variance of the values before this update)."""
  mask = mask_BT.astype(jnp.float32)
  count = jnp.maximum(jnp.sum(mask), 1.0)
  old = jax.lax.stop_gradient(old_values_BT.astype(jnp.float32))
  ret = jax.lax.stop_gradient(returns_BT.astype(jnp.float32))
  clipped = old + jnp.clip(values_BT - old, -hp.value_clip, hp.value_clip)
  per_token = 0.5 * jnp.maximum(jnp.square(values_BT - ret), jnp.square(clipped - ret))
  v_loss = jnp.sum(mask * per_token) / count
  mean_ret = jnp.sum(mask * ret) / count
  var_ret = jnp.sum(mask * jnp.square(ret - mean_ret)) / count
  err = jax.lax.stop_gradient(values_BT) - ret
  mean_err = jnp.sum(mask * err) / count
  var_err = jnp.sum(mask * jnp.square(err - mean_err)) / count
  return v_loss, {"value_loss": v_loss, "explained_variance": 1.0 - var_err / jnp.maximum(var_ret, 1e-8)}


ALGORITHM = Algorithm("ppo", advantages, loss, critic=True, value_loss=value_loss,
                      defaults={"clip_eps": 0.2, "kl_coef": 0.02})
