"""A masked update: the guards' way to skip a step without a branch (`jnp.where`, no `lax.cond`), shared
by the optimizers and the step."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def keep_if(skip: jax.Array, old: Any, new: Any) -> Any:
  """`old` where `skip`, else `new`, leaf by leaf: a masked update, not a branch."""
  return jax.tree.map(lambda o, n: jnp.where(skip, o, n), old, new)
