"""A critic for RL algorithms that learn a value function (PPO): a value head on the policy's final
features (gradient stopped, so the value loss never moves the policy), a second parameter tree with
its own optimizer (Adam at post.critic_lr, constant).

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


class CriticState(NamedTuple):
  policy: Any  # the policy optimizer's own state
  params: dict[str, jax.Array]  # the value head: w [D], b []
  opt: Any  # the critic optimizer's state


@dataclasses.dataclass(frozen=True)
class _WithCritic:
  """A GradientTransformation-like pair: the policy's transform, and the critic made at init."""
  inner: Any
  dim: int
  critic_tx: optax.GradientTransformation

  def init(self, params: Any) -> CriticState:
    # Zero init: the first values are 0, the returns are learned from there (no random scale to undo).
    head = {"w": jnp.zeros((self.dim,), jnp.float32), "b": jnp.zeros((), jnp.float32)}
    return CriticState(self.inner.init(params), head, self.critic_tx.init(head))

  def update(self, updates: Any, state: CriticState, params: Any = None, **extra: Any) -> tuple[Any, CriticState]:
    updates, policy = self.inner.update(updates, state.policy, params, **extra)
    return updates, state._replace(policy=policy)


def with_critic(optimizer: optim.Optimizer, dim: int, lr: float) -> optim.Optimizer:
  """`optimizer` whose state also holds a value head over `dim` features and its Adam state."""
  return dataclasses.replace(optimizer, tx=_WithCritic(optimizer.tx, dim, optax.adam(lr)))


def values(head: dict[str, jax.Array], x_BTD: jax.Array) -> jax.Array:
  """V per position, fp32 [B, T], from the policy's features with their gradient stopped."""
  x = jax.lax.stop_gradient(x_BTD).astype(jnp.float32)
  return jnp.einsum("btd,d->bt", x, head["w"]) + head["b"]
