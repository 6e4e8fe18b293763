"""A model's layout on a mesh, read from its logical axis names through a rule set: how many ways
each dim is split, the per-device shapes, and the checks that fail a bad layout before compiling.

Everything outside `sharding/` asks a `Layout` ("how many shards does `act_batch` have?") instead
of naming mesh axes, so a new rule set or mesh axis changes nothing there.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxtrain.errors import UserError
from maxtrain.sharding import rules as rules_lib

# The parts of a batch row: sequences, then tokens within a sequence.
BATCH_LOGICAL = ("act_batch", "act_length")


_axes = rules_lib.mesh_axes


def param_name(path: tuple) -> str:
  """'blocks/attn/wq' for a key path into an nnx.State (attribute keys like `.value` dropped)."""
  return "/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


@dataclasses.dataclass(frozen=True)
class Layout:
  mesh_sizes: Mapping[str, int]  # mesh axis -> size
  rules: rules_lib.Rules

  def axes(self, logical: str | None) -> tuple[str, ...]:
    return () if logical is None else _axes(self.rules[logical])

  def shards(self, logical: str | None) -> int:
    """Into how many parts a dim with this logical name is split."""
    return math.prod(self.mesh_sizes[a] for a in self.axes(logical))

  def describe(self, logical: str) -> str:
    """How a dim is split, for messages: 'mesh.tensor=8', or 'data x fsdp = 8' for several axes
    (`expert` and `context` left out while they are 1, as in mesh descriptions)."""
    axes = self.axes(logical)
    axes = tuple(a for a in axes if a not in ("expert", "context") or self.mesh_sizes[a] > 1) or axes[:1]
    if not axes:
      return "nothing (replicated)"
    if len(axes) == 1:
      return f"mesh.{axes[0]}={self.shards(logical)}"
    return " x ".join(axes) + f" = {self.shards(logical)}"

  def local_shape(self, shape: tuple[int, ...], logical: tuple[str | None, ...]) -> tuple[int, ...]:
    """The per-device block of an array; an uneven split rounds up, as XLA pads it."""
    logical = tuple(logical) + (None,) * (len(shape) - len(logical))
    return tuple(-(-dim // self.shards(name)) for dim, name in zip(shape, logical))

  def spec(self, logical: tuple[str | None, ...]) -> P:
    return rules_lib.logical_to_mesh(logical, self.rules)

  def unused_axes(self) -> tuple[str, ...]:
    """Mesh axes of size > 1 that no rule maps anything to: their devices would all hold and
    compute the same thing."""
    # The optimizer's own resharding (`opt_layers`) does not count: it splits no model work.
    used = {a for name, mapped in self.rules.items() if name not in rules_lib.OPTIMIZER_ONLY for a in _axes(mapped)}
    return tuple(a for a, n in self.mesh_sizes.items() if n > 1 and a not in used)

  def batch_sharding(self, mesh: Mesh) -> NamedSharding:
    """Rows over the `act_batch` axes, tokens over the `act_length` axes."""
    return NamedSharding(mesh, self.spec(BATCH_LOGICAL))


def named_leaves(abstract_params: Any) -> list[tuple[str, Any, tuple]]:
  """(name, ShapeDtypeStruct, logical names) of every parameter of an abstract nnx.State."""
  specs = jax.tree.leaves(_logical_specs(abstract_params), is_leaf=rules_lib.is_spec)
  leaves = jax.tree_util.tree_leaves_with_path(abstract_params)
  return [(param_name(path), leaf, tuple(spec)) for (path, leaf), spec in zip(leaves, specs, strict=True)]


def _logical_specs(abstract_params: Any) -> Any:
  from flax import nnx

  return nnx.get_partition_spec(abstract_params)


def check_divisible(abstract_params: Any, layout: Layout, config_keys: Mapping[str, str]) -> None:
  """Every sharded parameter dim divides into equal parts. `config_keys` names the config key that
  sets each logical dim (the model's), so the error says what to change."""
  problems: dict[str, str] = {}
  for name, leaf, logical in named_leaves(abstract_params):
    for dim, axis_name in zip(leaf.shape, logical):
      n = layout.shards(axis_name)
      if axis_name is None or n == 1 or dim % n == 0 or axis_name in problems:
        continue
      key = config_keys.get(axis_name, f"the {axis_name!r} dim of {name}")
      problems[axis_name] = (f"config.{key}={dim} is not divisible by {layout.describe(axis_name)}: parameter "
                             f"{name} splits its {axis_name!r} dim over it")
  if problems:
    ordered = [problems[k] for k in config_keys if k in problems] + \
              [v for k, v in problems.items() if k not in config_keys]
    raise UserError("; ".join(ordered) + ". Choose mesh sizes dividing these dims, or change the model.")


def check_replication(abstract_params: Any, shardings: Any, layout: Layout, max_share: float = 0.1) -> None:
  """Fails when more than `max_share` of parameter bytes would sit whole on every device of a
  mesh that could shard them: almost always a missing or wrong sharding rule."""
  # The mesh axes that some rule set shards parameters over: when all have size 1, replication is
  # the plan (pure data parallelism), not a mistake.
  axes = {a for rules in (*rules_lib.RULE_SETS.values(), layout.rules) for name, mapped in rules.items()
          if not name.startswith("act_") for a in _axes(mapped)}
  if math.prod(layout.mesh_sizes[a] for a in axes) == 1:
    return
  sizes, replicated = {}, {}
  for (name, leaf, _), sharding in zip(named_leaves(abstract_params), jax.tree.leaves(shardings)):
    sizes[name] = leaf.size * leaf.dtype.itemsize
    if sharding.is_fully_replicated:
      replicated[name] = sizes[name]
  share = sum(replicated.values()) / max(sum(sizes.values()), 1)
  if share > max_share:
    worst = sorted(replicated.items(), key=lambda kv: -kv[1])[:5]
    listing = ", ".join(f"{name} ({size / 2**20:.1f} MiB)" for name, size in worst)
    raise UserError(
        f"{share:.0%} of parameter bytes would be replicated on every device of mesh {dict(layout.mesh_sizes)} "
        f"(limit {max_share:.0%}); largest: {listing}. Check the sharding rules in maxtrain/sharding/rules.py."
    )


def with_shardings(abstract: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs that carry their shardings: the inputs of an ahead-of-time lowering or a
  sharded restore. `shardings` is a prefix of the state (an optax MaskedNode is an empty subtree
  under one sharding)."""
  return jax.tree.map(lambda s, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) if hasattr(a, "shape") else a,
                      shardings, abstract)
