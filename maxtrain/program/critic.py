"""A critic for RL algorithms that learn a value function (PPO): a value head on the policy's final
features and on what the policy's log-probabilities say of the completion so far (all with their gradient
stopped, so the value loss never moves the policy), a second parameter tree with its own optimizer (Adam
at post.critic_lr, constant).

  V_t = w . h_t + u . e_t + b,   e_t = (s_t, exp(s_t), k_t / max_new_tokens)

with h_t the final features at the position that predicts completion token t, k_t the completion tokens
before t and s_t their summed log-probability under the policy (the prefix's likelihood: a state feature,
known before token t is drawn). Why e: on a terminal reward the value of a prefix is mostly whether the
sample has strayed from what the policy would say, which the features h do not show linearly. On the
arithmetic task from the SFT checkpoint (docs/post_training.md) a least-squares fit of the Monte Carlo
returns on h alone predicts held-out prompts worse than a constant (explained variance -0.02 to -0.09),
on e alone it explains +0.17. So w learns at 1/100 of the head's rate (W_LR_RATIO): at the same rate its
256 noisy directions drown e (explained variance -0.05 instead of +0.17 over the same rollouts).

The critic rides in the train state's optimizer state (`CriticState`), so it is checkpointed, restored,
rolled back and resharded exactly as the policy's optimizer moments are, with no new field in the state
of any other run: `with_critic` wraps the policy's optimizer so that its init also makes the critic, and
its update passes the critic through unchanged (the RL step updates it, `posttrain/rl_step.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from maxtrain.optim import optimizer as optim

PREFIX_FEATURES = 3  # e_t above
W_LR_RATIO = 0.01  # w's learning rate over the head's (module docstring)


class CriticState(NamedTuple):
  policy: Any  # the policy optimizer's own state
  params: dict[str, jax.Array]  # the value head: w [D], u [PREFIX_FEATURES], b []
  opt: Any  # the critic optimizer's state


@dataclasses.dataclass(frozen=True)
class _WithCritic:
  """A GradientTransformation-like pair: the policy's transform, and the critic made at init."""
  inner: Any
  dim: int
  critic_tx: optax.GradientTransformation

  def init(self, params: Any) -> CriticState:
    # Zero init: the first values are 0, the returns are learned from there (no random scale to undo).
    head = {"w": jnp.zeros((self.dim,), jnp.float32), "u": jnp.zeros((PREFIX_FEATURES,), jnp.float32),
            "b": jnp.zeros((), jnp.float32)}
    return CriticState(self.inner.init(params), head, self.critic_tx.init(head))

  def update(self, updates: Any, state: CriticState, params: Any = None, **extra: Any) -> tuple[Any, CriticState]:
    updates, policy = self.inner.update(updates, state.policy, params, **extra)
    return updates, state._replace(policy=policy)


def with_critic(optimizer: optim.Optimizer, dim: int, lr: float) -> optim.Optimizer:
  """`optimizer` whose state also holds a value head over `dim` features and its Adam state."""
  critic_tx = optax.multi_transform({"head": optax.adam(lr), "features": optax.adam(lr * W_LR_RATIO)},
                                    {"w": "features", "u": "head", "b": "head"})
  return dataclasses.replace(optimizer, tx=_WithCritic(optimizer.tx, dim, critic_tx))


def prefix_features(logp_BT: jax.Array, mask_BT: jax.Array, max_new_tokens: int) -> jax.Array:
  """e_t per position, fp32 [B, T, PREFIX_FEATURES] (module docstring): from the completion tokens before
  t only, so V_t never sees the token it is the value before."""
  mask = mask_BT.astype(jnp.float32)
  logp = jax.lax.stop_gradient(logp_BT).astype(jnp.float32) * mask
  s_BT = jnp.cumsum(logp, axis=1) - logp  # exclusive: the tokens before t
  k_BT = jnp.cumsum(mask, axis=1) - mask
  return jnp.stack([s_BT, jnp.exp(s_BT), k_BT / max_new_tokens], axis=-1)


def values(head: dict[str, jax.Array], x_BTD: jax.Array, logp_BT: jax.Array, mask_BT: jax.Array,
           max_new_tokens: int) -> jax.Array:
  """V per position, fp32 [B, T], from the policy's features and its log-probs of the completion's tokens
  (`logp_BT`, the position predicting token t holds log p(token t)), their gradient stopped."""
  x = jax.lax.stop_gradient(x_BTD).astype(jnp.float32)
  e_BTF = prefix_features(logp_BT, mask_BT, max_new_tokens)
  return jnp.einsum("btd,d->bt", x, head["w"]) + jnp.einsum("btf,f->bt", e_BTF, head["u"]) + head["b"]
