"""Logical axis names -> mesh axes. The only place that knows how the model is laid out.

Parameters and activations carry logical names; a rules table maps each to a mesh axis
(or a tuple of them, or None = replicated). Parameter and activation names are kept
separate so that, e.g., the parameter `embed` dim can be FSDP-sharded while the
activation `act_embed` dim stays whole.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]

# Default strategy: data parallel x FSDP (ZeRO-3 style parameter sharding) x tensor parallel.
DEFAULT_RULES: dict[str, MeshAxes] = {
    # parameters
    "vocab": "tensor",
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "norm": None,
    "layers": None,
    # activations
    "act_batch": ("data", "fsdp"),
    "act_length": None,
    "act_embed": None,
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
}


def logical_to_mesh(spec: P | tuple, rules: Rules = DEFAULT_RULES) -> P:
  """Maps a spec of logical names (or None) to a spec of mesh axes."""
  out = []
  for name in spec:
    if name is None:
      out.append(None)
    elif name not in rules:
      raise KeyError(f"logical axis {name!r} has no sharding rule; add it to DEFAULT_RULES")
    else:
      out.append(rules[name])
  return P(*out)


def is_spec(x: Any) -> bool:
  return isinstance(x, P)


def named_shardings(logical_specs: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
  """A tree of logical PartitionSpecs -> the same tree of NamedShardings on `mesh`."""
  return jax.tree.map(
      lambda spec: NamedSharding(mesh, logical_to_mesh(spec, rules)), logical_specs, is_leaf=is_spec
  )


def constrain(x: jax.Array, logical: tuple[str | None, ...], rules: Rules | None) -> jax.Array:
  """Sharding constraint on an activation; a no-op when the model runs without rules."""
  if rules is None:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_mesh(logical, rules))
