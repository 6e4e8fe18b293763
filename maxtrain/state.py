"""The train state pytree and its creation directly sharded on the mesh.

`TrainState` is everything a step reads and writes. The model's graph definition (structure,
static config) is split off once and kept outside, so the state is a plain pytree of arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxtrain import guards
from maxtrain.errors import UserError
from maxtrain.models.llama import Llama, ModelConfig
from maxtrain.sharding import rules as sharding_rules


@struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: steps taken (batches consumed; a guarded step may skip its update).
  params: nnx.State
  opt_state: optax.OptState
  guard: guards.GuardState


def _init_fn(model_cfg: ModelConfig, tx: optax.GradientTransformation, seed: int, rules, guard_window: int):
  def init() -> TrainState:
    _, params = nnx.split(Llama(model_cfg, rngs=nnx.Rngs(params=seed), rules=rules))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      guard=guards.init(guard_window))

  return init


def logical_specs(abstract_state: Any) -> Any:
  """Logical PartitionSpec per leaf; leaves without annotations (step, counts) are replicated."""
  return nnx.get_partition_spec(abstract_state)


def param_name(path: tuple) -> str:
  """'blocks/attn/wq' for a key path into an nnx.State (attribute keys like `.value` dropped)."""
  return "/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def check_replication(abstract_params: Any, shardings: Any, mesh: Mesh, max_share: float = 0.1) -> None:
  """Fails when more than `max_share` of parameter bytes would sit whole on every device of a
  mesh that could shard them: almost always a missing or wrong sharding rule."""
  if mesh.shape["fsdp"] * mesh.shape["tensor"] == 1:
    return
  sizes, replicated = {}, {}
  for (path, leaf), sharding in zip(jax.tree_util.tree_leaves_with_path(abstract_params), jax.tree.leaves(shardings)):
    name = param_name(path)
    sizes[name] = leaf.size * leaf.dtype.itemsize
    if sharding.is_fully_replicated:
      replicated[name] = sizes[name]
  share = sum(replicated.values()) / max(sum(sizes.values()), 1)
  if share > max_share:
    worst = sorted(replicated.items(), key=lambda kv: -kv[1])[:5]
    listing = ", ".join(f"{name} ({size / 2**20:.1f} MiB)" for name, size in worst)
    raise UserError(
        f"{share:.0%} of parameter bytes would be replicated on every device of mesh {dict(mesh.shape)} "
        f"(limit {max_share:.0%}); largest: {listing}. Check the sharding rules in maxtrain/sharding/rules.py."
    )


@dataclasses.dataclass(frozen=True)
class StateSpec:
  """Everything about the train state except its values."""
  graphdef: nnx.GraphDef
  abstract: TrainState  # ShapeDtypeStructs
  shardings: TrainState  # NamedShardings
  init: Callable[[], TrainState]


def spec(model_cfg: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh, seed: int,
         rules: sharding_rules.Rules = sharding_rules.DEFAULT_RULES, guard_window: int = 32) -> StateSpec:
  """Shapes and placement of the state, without allocating it."""
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Llama(model_cfg, rngs=nnx.Rngs(params=seed), rules=rules)))
  init = _init_fn(model_cfg, tx, seed, rules, guard_window)
  abstract = jax.eval_shape(init)
  # Optimizer moments carry their parameters' logical axes (optax builds them with tree maps over
  # the params), so they are sharded like them.
  shardings = sharding_rules.named_shardings(logical_specs(abstract), mesh, rules)
  check_replication(abstract.params, shardings.params, mesh)
  return StateSpec(graphdef, abstract, shardings, init)


def with_shardings(abstract: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs that carry their shardings: the inputs of an ahead-of-time lowering or a
  sharded restore. `shardings` is a prefix of the state (an optax MaskedNode is an empty subtree
  under one sharding)."""
  return jax.tree.map(lambda s, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) if hasattr(a, "shape") else a,
                      shardings, abstract)


def initialize(state_spec: StateSpec, mesh: Mesh) -> TrainState:
  """Parameters are born sharded: the init runs under jit with out_shardings, so no host ever
  holds a full copy."""
  with jax.set_mesh(mesh):
    return jax.jit(state_spec.init, out_shardings=state_spec.shardings)()


def create(model_cfg: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh, seed: int,
           rules: sharding_rules.Rules = sharding_rules.DEFAULT_RULES):
  """Returns (graphdef, state, state_shardings) of a freshly initialized state."""
  state_spec = spec(model_cfg, tx, mesh, seed, rules)
  return state_spec.graphdef, initialize(state_spec, mesh), state_spec.shardings


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
