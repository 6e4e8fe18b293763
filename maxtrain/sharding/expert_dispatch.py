"""Expert parallelism: the routed experts of a MoE layer split over the mesh axes of `experts`, the
tokens sent to their experts' devices and back by fixed-capacity all-to-alls under `jax.shard_map`.

Shape legend: B batch (Bl: this device's rows), T length, D model, E experts (El = E / X local), X
expert shards, C capacity per expert per sequence, K experts per token, F expert hidden width (Fl:
this device's part under tensor parallelism).

Per device, per layer (the same functions as the single-device path, `models/moe_dispatch.py`, passed
in as a `LocalExperts`: sharding/ sits below models/ and imports nothing from it):
  1. its own sequences' slots, x_BECD [Bl, E, C, D] (`dispatch`: slots were chosen per sequence
     outside, so they do not depend on the mesh);
  2. all-to-all over the expert axes: the E dim cut into X parts of El experts, part j sent to expert
     shard j; what arrives is every peer's slots for this device's experts, [X x Bl, El, C, D];
  3. the local experts' SwiGLUs on them (expert weights all-gathered over their FSDP axes first, so
     that the backward reduce-scatters their gradients; a partial sum over `tensor` is psum-ed);
  4. the reverse all-to-all, then `combine` with this device's routing weights.
Fixed capacity makes every message the same size, which `lax.all_to_all` needs (and which runs on
CPU); the dropless exchange (`ragged_dispatch.py`) sends ragged messages.

The model never names a mesh axis: `for_rules(rules, ...)` returns this dispatch when the model's rules
split `experts` over mesh axes of total size > 1 in the current mesh, else None.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax

from maxtrain.sharding import rules as rules_lib

TOKENS_LOGICAL = ("act_batch", "act_length", None)
ROUTING_LOGICAL = ("act_batch", "act_length", None)
GATE_LOGICAL = ("experts", "expert_embed", "expert_mlp")  # gate and up [E, D, F]
DOWN_LOGICAL = ("experts", "expert_mlp", "expert_embed")  # down [E, F, D]


class LocalExperts(NamedTuple):
  """The single-device MoE functions run on each device's blocks (models/moe_dispatch.LOCAL)."""
  dispatch: Callable  # (x_BTD, slot_BTK, num_experts, capacity) -> x_BECD
  experts_ffn: Callable  # (x_BECD, gate_EDF, up_EDF, down_EFD) -> y_BECD
  combine: Callable  # (y_BECD, slot_BTK, weights_BTK) -> y_BTD


def expert_parallel(x_BTD: jax.Array, slot_BTK: jax.Array, weights_BTK: jax.Array, gate_EDF: jax.Array,
                    up_EDF: jax.Array, down_EFD: jax.Array, *, local: LocalExperts, num_experts: int, capacity: int,
                    expert_axes: tuple[str, ...], embed_axes: tuple[str, ...], mlp_axes: tuple[str, ...]) -> jax.Array:
  """The shard_map body (local blocks in, local block out)."""
  # Over every axis of the rules, size 1 included: shard_map's replication check needs the weights to
  # be gathered (and the hidden-dim partial sums reduced) over all of them.
  if embed_axes:  # FSDP: gather the model dim of this device's experts (backward: reduce-scatter)
    gather = functools.partial(jax.lax.all_gather, axis_name=embed_axes, tiled=True)
    gate_EDF, up_EDF, down_EFD = gather(gate_EDF, axis=1), gather(up_EDF, axis=1), gather(down_EFD, axis=2)
  x_BECD = local.dispatch(x_BTD, slot_BTK, num_experts, capacity)
  to_experts = functools.partial(jax.lax.all_to_all, axis_name=expert_axes, tiled=True)
  x_XBECD = to_experts(x_BECD, split_axis=1, concat_axis=0)  # [X*Bl, El, C, D]: all peers' slots, my experts
  y_XBECD = local.experts_ffn(x_XBECD, gate_EDF, up_EDF, down_EFD)
  if mlp_axes:  # each tensor shard summed its own part of the hidden dim
    y_XBECD = jax.lax.psum(y_XBECD, mlp_axes)
  y_BECD = to_experts(y_XBECD, split_axis=0, concat_axis=1)  # back to the tokens' devices, [Bl, E, C, D]
  return local.combine(y_BECD, slot_BTK, weights_BTK)


def sharded(mesh: jax.sharding.AbstractMesh | jax.sharding.Mesh, rules: rules_lib.Rules, *, local: LocalExperts,
            num_experts: int, capacity: int) -> Callable:
  """`expert_parallel` of the `local` functions under shard_map on `mesh`, its specs from `rules`: a
  function of global arrays (x_BTD, slot_BTK, weights_BTK, gate, up, down) -> y_BTD."""
  axes = lambda logical: rules_lib.mesh_axes(rules[logical])
  spec = lambda logical: rules_lib.logical_to_mesh(logical, rules)
  body = functools.partial(expert_parallel, local=local, num_experts=num_experts, capacity=capacity,
                           expert_axes=axes("experts"), embed_axes=axes("expert_embed"),
                           mlp_axes=axes("expert_mlp"))
  return jax.shard_map(body, mesh=mesh,
                       in_specs=(spec(TOKENS_LOGICAL), spec(ROUTING_LOGICAL), spec(ROUTING_LOGICAL),
                                 spec(GATE_LOGICAL), spec(GATE_LOGICAL), spec(DOWN_LOGICAL)),
                       out_specs=spec(TOKENS_LOGICAL))


def expert_shards(mesh: jax.sharding.AbstractMesh | jax.sharding.Mesh, rules: rules_lib.Rules) -> int:
  return math.prod(mesh.shape[a] for a in rules_lib.mesh_axes(rules["experts"]))


def for_rules(rules: rules_lib.Rules | None, local: LocalExperts, num_experts: int,
              capacity: int) -> Callable | None:
  """Expert-parallel dispatch when `rules` (the model's) split `experts` over mesh axes of total size > 1
  in the current mesh (the step traces under `jax.set_mesh`); None otherwise (the caller dispatches
  on its own devices)."""
  mesh = jax.sharding.get_abstract_mesh()
  if rules is None or mesh.empty or expert_shards(mesh, rules) == 1:
    return None
  return sharded(mesh, rules, local=local, num_experts=num_experts, capacity=capacity)
