"""Logical axis names -> mesh axes. With `sharding/layout.py`, the only place that knows how the
model is laid out on the mesh.

Parameters and activations carry logical names; a rule set maps each to a mesh axis (or a tuple of
them, or None = replicated). Parameter and activation names are kept separate so that, e.g., the
parameter `embed` dim can be FSDP-sharded while the activation `act_embed` dim stays whole. Rule sets
are named and chosen by `mesh.rules`; a new strategy (context or expert parallelism) is a new entry
in `RULE_SETS`, nothing else.

The builder hands the rules to the model at construction as a `Parallel` (a frozen, hashable value the
modules keep as a static attribute): `Parallel.constrain` lays an activation out by them; an empty `Parallel`
(a model on its own: a test, a conversion) constrains nothing. Nothing here is ambient state.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]

# Data parallel x FSDP (ZeRO-3 style parameter sharding) x context parallel x tensor parallel.
# Context parallelism splits the sequence (`act_length`) of every activation; attention, the one
# op that mixes positions, runs under shard_map (`context_attention.py`). The context axis also
# shards parameters FSDP-style: otherwise each of its devices would hold a full FSDP shard.
# Expert parallelism splits the routed experts of MoE layers over `expert` (tokens reach them by
# all-to-all, `expert_dispatch.py`); everywhere else `expert` is one more data-parallel / FSDP axis,
# so dense weights and activations are sharded over it too and no device duplicates another's work.
# Expert weights cannot use `expert` twice: their model dim has a rule of its own (`expert_embed`).
DEFAULT_RULES: dict[str, MeshAxes] = {
    # parameters
    "vocab": "tensor",
    "embed": ("fsdp", "context", "expert"),
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "norm": None,
    "lora": None,  # multi-head latent attention's latent as a down-projection's output (its input is sharded)
    "lora_in": ("fsdp", "context", "expert"),  # the latent as an up-projection's input (models/mla.py): FSDP-sharded
    # the stacked layer dim: a pipeline stage holds its own layers (sharding/pipeline.py); replicated without one
    "layers": "pipeline",
    # optimizer: Muon orthogonalises a stacked weight with its layers split over the devices that
    # shard it (maxtrain/optim/muon.py), so each device holds whole matrices: a stage its own layers
    # (pipeline), split further over the other axes as `layer_split` picks
    "opt_layers": ("pipeline", "fsdp", "context", "tensor"),
    "experts": "expert",  # the routed-expert dim of expert weights [experts, ...]
    "expert_embed": ("fsdp", "context"),  # the model dim of expert weights
    "expert_mlp": "tensor",  # the hidden dim of expert weights
    "router_experts": None,  # the expert dim of the router and its bias: small, every device routes its tokens
    # activations
    "act_batch": ("data", "fsdp", "expert"),
    "act_length": "context",
    "act_embed": None,
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
}

# Logical names only the optimizer uses (maxtrain/optim/muon.py): an axis they alone map splits no model work.
OPTIMIZER_ONLY = ("opt_layers",)

RULE_SETS: dict[str, Rules] = {"default": DEFAULT_RULES}  # config key mesh.rules


def get(name: str) -> Rules:
  return RULE_SETS[name]


def mesh_axes(mapped: MeshAxes) -> tuple[str, ...]:
  """A rule's value as a tuple of mesh axes."""
  return () if mapped is None else (mapped,) if isinstance(mapped, str) else tuple(mapped)


def logical_to_mesh(spec: P | tuple, rules: Rules = DEFAULT_RULES) -> P:
  """Maps a spec of logical names (or None) to a spec of mesh axes."""
  out = []
  for name in spec:
    if name is None:
      out.append(None)
    elif name not in rules:
      raise KeyError(f"logical axis {name!r} has no sharding rule; add it to the rule sets in sharding/rules.py")
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


@dataclasses.dataclass(frozen=True)
class LayerSplit:
  """How Muon splits a stack of layers [L, ...] so that each device orthogonalises whole layers."""
  axes: tuple[str, ...]  # the mesh axes of the split layers dim: the stored layout's own (pipeline) first
  groups: int  # parts of L the stored layout already splits (pipeline stages): each pads on its own
  per_group: int  # layers of each group after padding (a multiple of the other axes' product)


def layer_split(num_layers: int, sizes: Mapping[str, int], rules: Rules = DEFAULT_RULES) -> LayerSplit:
  """Muon's split of a stack of `num_layers` layers (logical `opt_layers`; `sizes`: mesh axis -> size). The
  `opt_layers` axes that already split the stored `layers` dim stay first (a pipeline stage orthogonalises its
  own layers: nothing crosses stages); of the other `opt_layers` axes, the subset that leaves the fewest layers
  per device (the critical path), then the least zero padding (ties: the rule's order). So an axis that does
  not divide a stage's layers is used only where it shortens the work, e.g. 32 layers on fsdp=16 x tensor=4:
  16 x 4 devices, 1 layer each (32 of them zeros) rather than 2 layers on each fsdp device (tensor duplicating
  them); on fsdp=8 x tensor=4, fsdp x tensor (1 each, no padding)."""
  size = lambda axes: math.prod(sizes.get(a, 1) for a in axes)
  split = mesh_axes(rules["opt_layers"])
  own = tuple(a for a in mesh_axes(rules["layers"]) if a in split and sizes.get(a, 1) > 1)
  if num_layers % size(own):
    own = ()
  per_group = num_layers // size(own)
  others = [a for a in split if a not in own and sizes.get(a, 1) > 1]
  cost = lambda combo: (-(-per_group // size(combo)), -per_group % size(combo))  # (layers per device, padding)
  best: tuple[str, ...] = ()
  for k in range(1, len(others) + 1):
    for combo in itertools.combinations(others, k):
      if cost(combo) < cost(best):
        best = combo
  return LayerSplit(axes=own + best, groups=size(own), per_group=per_group + cost(best)[1])


def constrain_layers(x: jax.Array, split: LayerSplit) -> jax.Array:
  """`x` [L, ...] with L split over `split.axes`, its other dims whole."""
  return jax.lax.with_sharding_constraint(x, P(split.axes, *(None,) * (x.ndim - 1)))


@dataclasses.dataclass(frozen=True)
class Parallel:
  """How a model lays out its activations on the mesh: the rule set as a frozen tuple of (logical name, mesh
  axes) pairs, so that it is hashable (an NNX static attribute, part of the graphdef). The builder resolves it
  (`Parallel.of(plan.layout.rules)`) and hands it to the model at construction; empty (the default): a model on
  its own, `constrain` does nothing (GSPMD decides alone)."""
  items: tuple[tuple[str, MeshAxes], ...] = ()

  @classmethod
  def of(cls, rules: Rules | None) -> "Parallel":
    freeze = lambda v: tuple(v) if isinstance(v, list) else v
    return cls(tuple((name, freeze(mapped)) for name, mapped in (rules or {}).items()))

  @property
  def rules(self) -> Rules | None:
    """The rule set as a mapping; None when empty (no layout: the callers' `for_rules` return None)."""
    return dict(self.items) if self.items else None

  def constrain(self, x: jax.Array, logical: tuple[str | None, ...]) -> jax.Array:
    """Sharding constraint on an activation by the rules; a no-op without them, or outside a mesh (the builder's
    model traced on its own, e.g. a one-device reference: the rules' axes name no devices there)."""
    if not self.items or jax.sharding.get_abstract_mesh().empty:
      return x
    return jax.lax.with_sharding_constraint(x, logical_to_mesh(logical, self.rules))

  def layer_split(self, num_layers: int) -> LayerSplit | None:
    """`layer_split` by these rules on the current mesh (the step traces under `jax.set_mesh`); None without
    rules or a mesh, or when it splits nothing."""
    mesh = jax.sharding.get_abstract_mesh()
    if not self.items or mesh.empty:
      return None
    split = layer_split(num_layers, dict(mesh.shape), self.rules)
    return split if split.axes else None


NONE = Parallel()  # a model on its own
