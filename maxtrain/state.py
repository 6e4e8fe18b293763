"""The train state pytree and its creation directly sharded on the mesh.

`TrainState` is everything a step reads and writes. The model's graph definition (structure,
static config) is split off once and kept outside, so the state is a plain pytree of arrays.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxtrain.models.llama import Llama, ModelConfig
from maxtrain.sharding import rules as sharding_rules


@struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken.
  params: nnx.State
  opt_state: optax.OptState


def _init_fn(model_cfg: ModelConfig, tx: optax.GradientTransformation, seed: int, rules):
  def init() -> TrainState:
    _, params = nnx.split(Llama(model_cfg, rngs=nnx.Rngs(params=seed), rules=rules))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  return init


def logical_specs(abstract_state: Any) -> Any:
  """Logical PartitionSpec per leaf; leaves without annotations (step, counts) are replicated."""
  return nnx.get_partition_spec(abstract_state)


def create(model_cfg: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh, seed: int,
           rules: sharding_rules.Rules = sharding_rules.DEFAULT_RULES):
  """Returns (graphdef, state, state_shardings). Parameters are born sharded: the init runs under
  jit with out_shardings, so no host ever holds a full copy."""
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Llama(model_cfg, rngs=nnx.Rngs(params=seed), rules=rules)))
  init = _init_fn(model_cfg, tx, seed, rules)
  shardings = sharding_rules.named_shardings(logical_specs(jax.eval_shape(init)), mesh, rules)
  with jax.set_mesh(mesh):
    state = jax.jit(init, out_shardings=shardings)()
  return graphdef, state, shardings


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
