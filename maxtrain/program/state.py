"""The train state pytree and its creation directly sharded on the mesh.

`TrainState` is everything a step reads and writes. The model's graph definition (structure,
static config) is split off once and kept outside, so the state is a plain pytree of arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxtrain.optim import offload as offload_lib
from maxtrain.program import guards
from maxtrain.models import registry
from maxtrain.models.decoder import ModelConfig
from maxtrain.models import stack as stack_lib
from maxtrain.sharding import rules as sharding_rules
from maxtrain.sharding.pipeline import Schedule
from maxtrain.sharding.layout import Layout, check_divisible, check_replication


@struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: steps taken (batches consumed; a guarded step may skip its update).
  params: nnx.State
  opt_state: optax.OptState
  guard: guards.GuardState


def _init_fn(model_cfg: ModelConfig, tx: optax.GradientTransformation, seed: int, guard_window: int,
             stack: stack_lib.Stack | None = None):
  def init() -> TrainState:
    _, params = nnx.split(registry.build(model_cfg, rngs=nnx.Rngs(params=seed), stack=stack))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      guard=guards.init(guard_window))

  return init


@dataclasses.dataclass(frozen=True)
class StateSpec:
  """Everything about the train state except its values."""
  graphdef: nnx.GraphDef
  abstract: TrainState  # ShapeDtypeStructs
  shardings: TrainState  # NamedShardings
  init: Callable[[], TrainState]


def spec(model_cfg: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh, seed: int,
         rules: sharding_rules.Rules = sharding_rules.DEFAULT_RULES, guard_window: int = 32,
         offload_optimizer: bool = False, pipeline: Schedule | None = None) -> StateSpec:
  """Shapes and placement of the state, without allocating it. Fails (UserError) on a layout that
  does not divide the parameters or replicates most of them. `offload_optimizer`: the optimizer state's
  shardings are in host memory (`optim/offload.py`; `tx` must then be `offload.streamed`).

  The graphdef is the model as every step runs it: laid out by `rules` (a `Parallel` the model keeps) and its
  layer stacks run through `pipeline` (None: no pipeline; models/stack.py). The steps built from it read
  nothing else about parallelism."""
  stack = stack_lib.for_model(model_cfg, pipeline)  # UserError for what the stack cannot run, before compiling
  graphdef, _ = registry.abstract(model_cfg, seed, parallel=sharding_rules.Parallel.of(rules), stack=stack)
  init = _init_fn(model_cfg, tx, seed, guard_window, stack)
  abstract = jax.eval_shape(init)
  layout = Layout(dict(mesh.shape), rules)
  check_divisible(abstract.params, layout, registry.CONFIG_KEYS)
  # Optimizer moments carry their parameters' logical axes (optax builds them with tree maps over
  # the params), so they are sharded like them.
  shardings = sharding_rules.named_shardings(nnx.get_partition_spec(abstract), mesh, rules)
  check_replication(abstract.params, shardings.params, layout)
  if offload_optimizer:
    shardings = shardings.replace(opt_state=offload_lib.host_shardings(shardings.opt_state))
  return StateSpec(graphdef, abstract, shardings, init)


def initialize(state_spec: StateSpec, mesh: Mesh) -> TrainState:
  """Parameters are born sharded: the init runs under jit with out_shardings, so no host ever
  holds a full copy."""
  with jax.set_mesh(mesh):
    return jax.jit(state_spec.init, out_shardings=state_spec.shardings)()


def create(model_cfg: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh, seed: int,
           rules: sharding_rules.Rules = sharding_rules.DEFAULT_RULES, pipeline: Schedule | None = None):
  """Returns (graphdef, state, state_shardings) of a freshly initialized state."""
  state_spec = spec(model_cfg, tx, mesh, seed, rules, pipeline=pipeline)
  return state_spec.graphdef, initialize(state_spec, mesh), state_spec.shardings


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
