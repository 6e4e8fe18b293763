"""Dropless expert parallelism (`model.moe.dispatch=dropless` with `mesh.expert` > 1): every token's
assignments travel to the devices holding their experts by a ragged all-to-all, run there as grouped
matmuls over the local experts, and come back by the reverse exchange. No capacity: nothing drops.

Shape legend: B batch (this device's rows), T length, D model, K experts per token, E experts, X expert
shards, El = E / X local experts, N = B x T x K this device's assignments, W = B x T x min(K, El) the
most rows one device can send to one other (a token takes an expert at most once), M = X x W the
receive buffer (the most one device can receive: dropless needs the worst case), F expert hidden width.

Per device, per layer (under `jax.shard_map`, the same specs as `expert_dispatch.py`):
  1. its assignments sorted by expert, so each destination shard's rows are one contiguous run;
  2. the per-expert counts all-gathered over the expert axis ([X src, X dst, El]: X x X x El integers):
     from them every device computes every offset and size of both exchanges (`exchange_plan`);
  3. the exchange: `lax.ragged_all_to_all` on GPU/TPU. XLA:CPU does not implement that op (jax 0.10.2:
     "HLO opcode `ragged-all-to-all` is not supported by XLA:CPU"), so on CPU `padded_all_to_all` runs
     the same exchange, with the same arguments and result, as a `lax.all_to_all` of per-destination
     buffers of W rows (the worst case, so still dropless; X x W rows move instead of the payload);
  4. received rows sorted by local expert, the `grouped_ffn` (models/moe_dispatch.grouped_swiglu, or
     GPT-OSS's grouped_clamped_swiglu with its biases: `lax.ragged_dot`) on them, unsorted, and the reverse
     exchange puts each row back where it came from;
  5. this device's routing weights combine the K outputs of each token.
The gradient is JAX's own: `ragged_all_to_all`'s transpose is the reverse ragged exchange, the padded
one's is made of gathers, all-to-alls and scatters.

The model never names a mesh axis: `for_rules(rules, ...)` returns this dispatch when the model's rules split
`experts` over mesh axes of total size > 1 in the current mesh, else None.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from maxtrain.sharding import expert_dispatch
from maxtrain.sharding import rules as rules_lib

# (x_MD rows sorted by local expert, group_sizes_El, row_expert_M, expert weights, reduce) -> y_MD, where
# `reduce` sums partial outputs over the devices splitting the experts' hidden dim (models/moe_dispatch.py).
GroupedFFN = Callable[..., jax.Array]
SWIGLU_LOGICAL = (expert_dispatch.GATE_LOGICAL, expert_dispatch.GATE_LOGICAL, expert_dispatch.DOWN_LOGICAL)
# GPT-OSS: gate_up [E, D, 2F], down [E, F, D], and optionally their biases [E, 2F], [E, D].
CLAMPED_LOGICAL = (expert_dispatch.GATE_LOGICAL, expert_dispatch.DOWN_LOGICAL)
CLAMPED_BIAS_LOGICAL = (("experts", "expert_mlp"), ("experts", "expert_embed"))


class ExchangePlan(NamedTuple):
  """One device's view of both exchanges, from the all-gathered counts. The forward exchange is
  (input_offsets, send_sizes, output_offsets, recv_sizes) in `lax.ragged_all_to_all`'s terms; the
  reverse is (recv_offsets, recv_sizes, return_offsets, send_sizes)."""
  input_offsets_X: jax.Array  # where this device's rows for shard j start in its sorted rows
  send_sizes_X: jax.Array  # how many of its rows go to shard j
  output_offsets_X: jax.Array  # where they land in shard j's receive buffer
  recv_sizes_X: jax.Array  # how many rows it receives from shard i
  recv_offsets_X: jax.Array  # where shard i's rows start in its own receive buffer
  return_offsets_X: jax.Array  # where shard i's rows go back to in shard i's sorted rows
  local_sizes_El: jax.Array  # rows per local expert, all sources together
  row_expert_M: jax.Array  # local expert of each receive-buffer row (El: an unused row)


def _exclusive_cumsum(a: jax.Array, axis: int) -> jax.Array:
  return jnp.cumsum(a, axis=axis) - a


def exchange_plan(counts_XXE: jax.Array, me: jax.Array | int, rows: int) -> ExchangePlan:
  """`counts_XXE[i, j, e]`: rows shard i sends to local expert e of shard j; `me`: this shard; `rows`:
  the receive buffer's length M. Received rows are laid out source by source (in shard order), each
  source's by local expert, so the buffer is one run of (source, expert) segments from row 0."""
  X, _, El = counts_XXE.shape
  sizes_XX = jnp.sum(counts_XXE, axis=-1)  # [src, dst]
  mine_XE = counts_XXE[:, me, :]  # what each source sends me, per local expert
  recv_X = sizes_XX[:, me]
  segment_ends = jnp.cumsum(mine_XE.reshape(-1))  # (source, expert) segments in buffer order
  segment_M = jnp.searchsorted(segment_ends, jnp.arange(rows, dtype=segment_ends.dtype), side="right")
  row_expert_M = jnp.where(segment_M < X * El, segment_M % El, El)
  return ExchangePlan(input_offsets_X=_exclusive_cumsum(sizes_XX[me], 0), send_sizes_X=sizes_XX[me],
                      output_offsets_X=_exclusive_cumsum(sizes_XX, 0)[me], recv_sizes_X=recv_X,
                      recv_offsets_X=_exclusive_cumsum(recv_X, 0),
                      return_offsets_X=_exclusive_cumsum(sizes_XX, 1)[:, me],
                      local_sizes_El=jnp.sum(mine_XE, axis=0), row_expert_M=row_expert_M.astype(jnp.int32))


def padded_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
                      output_offsets: jax.Array, recv_sizes: jax.Array, *, axis_name: tuple[str, ...],
                      max_chunk: int) -> jax.Array:
  """`lax.ragged_all_to_all`'s result (one chunk per destination shard) by a fixed-size `lax.all_to_all`:
  each chunk padded to `max_chunk` rows (which must bound every send size), the receiver scattering
  the valid rows of each to the offset its sender chose. Runs on every backend, XLA:CPU included."""
  r = jnp.arange(max_chunk, dtype=input_offsets.dtype)
  take_XC = jnp.clip(input_offsets[:, None] + r, 0, operand.shape[0] - 1)
  valid_XC = r < send_sizes[:, None]
  chunks = jnp.where(valid_XC.reshape(*valid_XC.shape, *(1,) * (operand.ndim - 1)), operand[take_XC], 0)
  exchange = functools.partial(jax.lax.all_to_all, axis_name=axis_name, split_axis=0, concat_axis=0, tiled=True)
  got = exchange(chunks)  # [X, C, ...]: row block i came from shard i
  at_X = exchange(output_offsets)  # where each sender asked its rows to land here
  put_XC = jnp.where(r < recv_sizes[:, None], at_X[:, None] + r, output.shape[0])  # out of range: not written
  return output.at[put_XC.reshape(-1)].set(got.reshape(-1, *operand.shape[1:]), mode="drop")


def ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
                      output_offsets: jax.Array, recv_sizes: jax.Array, *, axis_name: tuple[str, ...],
                      max_chunk: int) -> jax.Array:
  """`lax.ragged_all_to_all` with `padded_all_to_all`'s signature (`max_chunk` unused: only the payload moves)."""
  del max_chunk
  return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                   axis_name=axis_name)


TRANSPORTS = {"ragged": ragged_all_to_all, "padded": padded_all_to_all}


def transport_for(platform: str) -> str:
  """`ragged` where XLA implements it (GPU, TPU), `padded` on CPU (no ragged-all-to-all there)."""
  return "padded" if platform == "cpu" else "ragged"


def dropless_expert_parallel(x_BTD: jax.Array, experts_BTK: jax.Array, weights_BTK: jax.Array,
                             *expert_weights: jax.Array, grouped_ffn: GroupedFFN, num_experts: int, transport: str,
                             weight_logical: tuple[tuple[str | None, ...], ...], expert_axes: tuple[str, ...],
                             embed_axes: tuple[str, ...], mlp_axes: tuple[str, ...], token_axes: tuple[str, ...],
                             replicas: int) -> tuple[jax.Array, jax.Array]:
  """The shard_map body: (y_BTD of this device's tokens, the bytes of token rows all devices' exchanges
  send to other devices in this layer's forward and backward, replicated). `expert_weights`: this
  device's experts' weights, their logical axes `weight_logical`."""
  if embed_axes:  # FSDP: gather the model dim of this device's experts (backward: reduce-scatter)
    expert_weights = tuple(jax.lax.all_gather(w, embed_axes, axis=logical.index("expert_embed"), tiled=True)
                           if "expert_embed" in logical else w for w, logical in zip(expert_weights, weight_logical))
  B, T, K = experts_BTK.shape
  D, El = x_BTD.shape[-1], expert_weights[0].shape[0]
  X = num_experts // El
  W = B * T * min(K, El)
  expert_N = experts_BTK.reshape(-1)
  order_N = jnp.argsort(expert_N, stable=True)
  x_ND = x_BTD.reshape(B * T, D)[order_N // K]  # assignment n belongs to token n // K
  counts_XE = jnp.sum(jax.nn.one_hot(expert_N, num_experts, dtype=jnp.int32), axis=0).reshape(X, El)
  counts_XXE = jax.lax.all_gather(counts_XE, expert_axes)  # [src, dst, El]
  me = jax.lax.axis_index(expert_axes)
  plan = exchange_plan(counts_XXE, me, X * W)
  exchange = functools.partial(TRANSPORTS[transport], axis_name=expert_axes, max_chunk=W)
  x_MD = exchange(x_ND, jnp.zeros((X * W, D), x_ND.dtype), plan.input_offsets_X, plan.send_sizes_X,
                  plan.output_offsets_X, plan.recv_sizes_X)
  order_M = jnp.argsort(plan.row_expert_M, stable=True)  # unused rows (expert El) last, never sent back
  # each tensor shard sums its own part of the hidden dim: `reduce` adds them up
  reduce = functools.partial(jax.lax.psum, axis_name=mlp_axes) if mlp_axes else None
  y_MD = grouped_ffn(x_MD[order_M], plan.local_sizes_El, plan.row_expert_M[order_M], expert_weights, reduce)
  y_MD = y_MD[jnp.argsort(order_M)]
  y_ND = exchange(y_MD, jnp.zeros_like(x_ND), plan.recv_offsets_X, plan.recv_sizes_X, plan.return_offsets_X,
                  plan.send_sizes_X)
  y_BTKD = y_ND[jnp.argsort(order_N)].reshape(B, T, K, D)  # back to assignment order
  y_BTD = jnp.einsum("btk,btkd->btd", weights_BTK.astype(y_ND.dtype), y_BTKD)
  # Rows leaving this device, there and back, forward and backward (the gradients retrace the same routes),
  # summed over the devices holding different tokens, times the `replicas` (tensor) repeating their exchange.
  moved = 4 * (B * T * K - plan.send_sizes_X[me]).astype(jnp.float32) * D * x_ND.dtype.itemsize
  return y_BTD, jax.lax.psum(moved, token_axes) * replicas


def sharded(mesh: jax.sharding.AbstractMesh | jax.sharding.Mesh, rules: rules_lib.Rules, *,
            grouped_ffn: GroupedFFN, num_experts: int, transport: str,
            weight_logical: tuple[tuple[str | None, ...], ...] = SWIGLU_LOGICAL) -> Callable:
  """`dropless_expert_parallel` under shard_map on `mesh`, its specs from `rules`: a function of global
  arrays (x_BTD, experts_BTK, weights_BTK, *expert weights of `weight_logical`) -> (y_BTD, bytes)."""
  axes = lambda logical: rules_lib.mesh_axes(rules[logical])
  spec = lambda logical: rules_lib.logical_to_mesh(logical, rules)
  token_axes = tuple(a for logical in expert_dispatch.TOKENS_LOGICAL if logical for a in axes(logical))
  body = functools.partial(dropless_expert_parallel, grouped_ffn=grouped_ffn, num_experts=num_experts,
                           transport=transport, weight_logical=weight_logical,
                           expert_axes=axes("experts"), embed_axes=axes("expert_embed"),
                           mlp_axes=axes("expert_mlp"), token_axes=token_axes,
                           replicas=math.prod(mesh.shape.values()) // math.prod(mesh.shape[a] for a in token_axes))
  routing = spec(expert_dispatch.ROUTING_LOGICAL)
  return jax.shard_map(body, mesh=mesh, in_specs=(spec(expert_dispatch.TOKENS_LOGICAL), routing, routing,
                                                  *map(spec, weight_logical)),
                       out_specs=(spec(expert_dispatch.TOKENS_LOGICAL), jax.sharding.PartitionSpec()))


def for_rules(rules: rules_lib.Rules | None, grouped_ffn: GroupedFFN, num_experts: int,
              weight_logical: tuple[tuple[str | None, ...], ...] = SWIGLU_LOGICAL) -> Callable | None:
  """Dropless expert-parallel dispatch when `rules` (the model's) split `experts` over mesh axes of total
  size > 1 in the current mesh, with the transport of the default backend; None otherwise."""
  mesh = jax.sharding.get_abstract_mesh()
  if rules is None or mesh.empty or expert_dispatch.expert_shards(mesh, rules) == 1:
    return None
  return sharded(mesh, rules, grouped_ffn=grouped_ffn, num_experts=num_experts,
                 transport=transport_for(jax.default_backend()), weight_logical=weight_logical)


def capacity_bytes(rules: rules_lib.Rules | None, num_experts: int, capacity: int, x_shape: tuple[int, ...],
                   itemsize: int) -> float:
  """The bytes capacity dispatch's all-to-alls (`expert_dispatch.py`) send to other devices in one
  layer's forward and backward, all devices together (0 without expert parallelism): each device's
  slots [B/batch shards, E, C, D], all but 1/X of them leaving it, there and back, twice."""
  mesh = jax.sharding.get_abstract_mesh()
  if rules is None or mesh.empty or (shards := expert_dispatch.expert_shards(mesh, rules)) == 1:
    return 0.0
  batch_shards = math.prod(mesh.shape[a] for a in rules_lib.mesh_axes(rules["act_batch"]))
  B, _, D = x_shape
  per_device = B // batch_shards * num_experts * capacity * D * itemsize * (shards - 1) / shards
  return 4.0 * per_device * math.prod(mesh.shape.values())
