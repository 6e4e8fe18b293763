"""How tokens reach their experts and come back: capacity slots, dispatch, the expert SwiGLUs and the
weighted combine (capacity-based), and the sorted grouped matmul (dropless). Pure functions of arrays:
`models/moe.py` calls them directly; `sharding/expert_dispatch.py` (capacity) and
`sharding/ragged_dispatch.py` (dropless) call the same ones on each device with all-to-alls in between
(expert parallelism).

Shape legend: B batch, T length, D model, E routed experts, K experts per token, C capacity (slots per
expert per sequence), S = E x C slots, F expert hidden width, N = B x T x K assignments.

Capacity-based dispatch (GShard): every sequence has C slots per expert. A sequence's assignments
take their expert's slots in priority order: every token's first choice in token order, then every
token's second choice, and so on, so a token loses its 2nd expert before another token loses its 1st.
Assignments beyond C are dropped: they contribute zero, and the token's residual stream carries it
past the layer. Groups are sequences (not devices), so which assignments drop is the same on every
mesh: expert parallelism changes where slots are computed, never which tokens fill them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxtrain.models import quant as quant_lib
from maxtrain.sharding import expert_dispatch


def capacity_slots(experts_BTK: jax.Array, num_experts: int, capacity: int) -> tuple[jax.Array, jax.Array]:
  """(slot_BTK, kept_BTK): each assignment's slot e x C + position in its expert's queue, or the
  empty slot S = E x C when dropped; kept = not dropped."""
  B, T, K = experts_BTK.shape
  onehot_BNE = jax.nn.one_hot(jnp.swapaxes(experts_BTK, 1, 2).reshape(B, K * T), num_experts, dtype=jnp.int32)
  # Slot-major priority: position = earlier assignments (k, then t) to the same expert.
  position_BN = jnp.sum((jnp.cumsum(onehot_BNE, axis=1) - 1) * onehot_BNE, axis=-1)
  position_BTK = jnp.swapaxes(position_BN.reshape(B, K, T), 1, 2)
  kept_BTK = position_BTK < capacity
  slot_BTK = jnp.where(kept_BTK, experts_BTK * capacity + position_BTK, num_experts * capacity)
  return slot_BTK.astype(jnp.int32), kept_BTK


def dispatch(x_BTD: jax.Array, slot_BTK: jax.Array, num_experts: int, capacity: int) -> jax.Array:
  """x_BECD: each slot's token (zeros in empty slots), by a gather: the slots' token indices come
  from a scatter of integers, so no [B, T, S] one-hot tensor is built."""
  B, T, K = slot_BTK.shape
  S = num_experts * capacity
  token_BTK = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :, None], (B, T, K))
  rows_BTK = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None, None], (B, T, K))
  # Slot S is the bin of dropped assignments (any token may land there); it is cut off below.
  token_BS = jnp.full((B, S + 1), T, jnp.int32).at[rows_BTK, slot_BTK].set(token_BTK)[:, :S]
  x_pad_BTD = jnp.concatenate([x_BTD, jnp.zeros_like(x_BTD[:, :1])], axis=1)  # row T: the empty slot's zeros
  x_BSD = jnp.take_along_axis(x_pad_BTD, token_BS[..., None], axis=1)
  return x_BSD.reshape(B, num_experts, capacity, x_BTD.shape[-1])


def combine(y_BECD: jax.Array, slot_BTK: jax.Array, weights_BTK: jax.Array) -> jax.Array:
  """out_BTD = sum over k of weight x the expert output in the assignment's slot (zero if dropped)."""
  B, E, C, D = y_BECD.shape
  T, K = slot_BTK.shape[1:]
  y_pad_BSD = jnp.concatenate([y_BECD.reshape(B, E * C, D), jnp.zeros((B, 1, D), y_BECD.dtype)], axis=1)
  y_BNKD = jnp.take_along_axis(y_pad_BSD, slot_BTK.reshape(B, T * K)[..., None], axis=1).reshape(B, T, K, D)
  return jnp.einsum("btk,btkd->btd", weights_BTK.astype(y_BECD.dtype), y_BNKD)


def experts_ffn(x_BECD: jax.Array, gate_EDF: jax.Array, up_EDF: jax.Array, down_EFD: jax.Array,
                quant: "quant_lib.Quant | None" = None) -> jax.Array:
  """Each expert's SwiGLU on its slots: down(silu(x @ gate) * (x @ up)), batched over experts.

  Expert-major inside ([E, B x C, ...], transposed once in and once out): with the batch dim outside
  the experts dim, XLA:CPU transposed every [B, E, C, F] activation for the weight gradients, which
  took a fifth of the train step (tools/bench.py --top-ops; BENCHMARKS.md). `quant`: each expert's
  matmuls in FP8/int8, scaled per expert (models/quant.py), when D and F reach its min_dim."""
  B, E, C, D = x_BECD.shape
  matmul = lambda a, w: jax.lax.dot_general(a, w, (((2,), (1,)), ((0,), (0,))))  # [E, N, I] x [E, I, O]
  if quant is not None and quant.applies(D, gate_EDF.shape[-1]):
    matmul = functools.partial(quant_lib.batched_matmul, quant=quant)
  x_END = jnp.swapaxes(x_BECD, 0, 1).reshape(E, B * C, D)
  h_ENF = jax.nn.silu(matmul(x_END, gate_EDF)) * matmul(x_END, up_EDF)
  return jnp.swapaxes(matmul(h_ENF, down_EFD).reshape(E, B, C, D), 0, 1)


def _local(reduce):
  return (lambda y: y) if reduce is None else reduce


def balanced_ragged_dot(x_NI: jax.Array, w_EIO: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
  """`lax.ragged_dot`'s memory stand-in for ahead-of-time compiles on XLA:CPU, which lowers ragged_dot densely
  (every row times every group: E times the rows' buffers and FLOPs). The rows are cut into E equal groups
  (padded to a multiple of E) and multiplied in one batched matmul, so the buffers and FLOPs are those of a
  grouped matmul (a GPU kernel's) with every expert equally loaded, forward and backward. Equal to ragged_dot
  only when `group_sizes_E` are all N / E: compiled for its memory (`program/fit.py` memory_standin), never run."""
  del group_sizes_E
  N, E = x_NI.shape[0], w_EIO.shape[0]
  rows = -(-N // E)
  x_ERI = jnp.pad(x_NI, ((0, rows * E - N), (0, 0))).reshape(E, rows, x_NI.shape[1])
  y_ERO = jax.lax.dot_general(x_ERI, w_EIO, (((2,), (1,)), ((0,), (0,))))
  return y_ERO.reshape(rows * E, -1)[:N]


def grouped_swiglu(x_ND: jax.Array, group_sizes_E: jax.Array, expert_N: jax.Array, weights: tuple[jax.Array, ...],
                   reduce=None, *, matmul=jax.lax.ragged_dot) -> jax.Array:
  """Each expert's SwiGLU on its run of the rows (sorted by expert, `group_sizes_E` long each; rows past
  their sum come out 0): three grouped matmuls of weights (gate_EDF, up_EDF, down_EFD). `expert_N` (each
  row's expert) is unused here; `reduce` sums the partial outputs of a hidden dim split over devices.
  Dropless expert parallelism runs it on the local experts (sharding/ragged_dispatch.py). `matmul`: the grouped
  matmul (`balanced_ragged_dot`: the memory stand-in)."""
  del expert_N
  gate_EDF, up_EDF, down_EFD = weights
  gate_NF = matmul(x_ND, gate_EDF, group_sizes_E)
  up_NF = matmul(x_ND, up_EDF, group_sizes_E)
  return _local(reduce)(matmul(jax.nn.silu(gate_NF) * up_NF, down_EFD, group_sizes_E))


def grouped_clamped_swiglu(x_ND: jax.Array, group_sizes_E: jax.Array, expert_N: jax.Array,
                           weights: tuple[jax.Array, ...], reduce=None, *, alpha: float, limit: float,
                           matmul=jax.lax.ragged_dot) -> jax.Array:
  """GPT-OSS's experts on sorted rows: weights (gate_up_ED2F, down_EFD) or with their biases (..., gate_up_b_E2F,
  down_b_ED), each row's biases those of its expert `expert_N` (rows past the groups: any, their output is
  0 before the bias and cut off by the caller). The clamped SwiGLU over the interleaved gate_up columns
  (gate even, up odd): (clip(up, -limit, limit) + 1) x g x sigmoid(alpha x g), g = min(gate, limit)."""
  gate_up_ED2F, down_EFD = weights[:2]
  biases = weights[2:]
  gate_up_N2F = matmul(x_ND, gate_up_ED2F, group_sizes_E)
  take = lambda b_EX: jnp.take(b_EX, expert_N, axis=0, mode="clip")
  if biases:
    gate_up_N2F = gate_up_N2F + take(biases[0])
  gate_NF = jnp.minimum(gate_up_N2F[:, 0::2], limit)
  up_NF = jnp.clip(gate_up_N2F[:, 1::2], -limit, limit)
  h_NF = (up_NF + 1) * gate_NF * jax.nn.sigmoid(alpha * gate_NF)
  y_ND = _local(reduce)(matmul(h_NF, down_EFD, group_sizes_E))
  return y_ND + take(biases[1]) if biases else y_ND  # once, after the partial sums over the hidden dim


def dropless(x_BTD: jax.Array, experts_BTK: jax.Array, weights_BTK: jax.Array, expert_weights: tuple[jax.Array, ...],
             grouped_ffn=grouped_swiglu) -> jax.Array:
  """No capacity: the B x T x K assignments sorted by expert, each expert's rows one group of a
  grouped matmul (`lax.ragged_dot`: `grouped_ffn` of `expert_weights`), unsorted and combined. Every
  assignment is computed."""
  B, T, K = experts_BTK.shape
  E, D = expert_weights[0].shape[0], x_BTD.shape[-1]
  expert_N = experts_BTK.reshape(-1)
  order_N = jnp.argsort(expert_N, stable=True)
  x_ND = x_BTD.reshape(B * T, D)[order_N // K]  # assignment n belongs to token n // K
  group_sizes_E = jnp.sum(jax.nn.one_hot(expert_N, E, dtype=jnp.int32), axis=0)
  y_ND = grouped_ffn(x_ND, group_sizes_E, expert_N[order_N], expert_weights)
  y_BTKD = y_ND[jnp.argsort(order_N)].reshape(B, T, K, D)  # back to assignment order
  return jnp.einsum("btk,btkd->btd", weights_BTK.astype(y_ND.dtype), y_BTKD)


# What expert parallelism runs on each device (sharding/ takes them as arguments).
LOCAL = expert_dispatch.LocalExperts(dispatch=dispatch, experts_ffn=experts_ffn, combine=combine)


@functools.lru_cache(maxsize=None)
def local_experts(quant: "quant_lib.Quant | None") -> expert_dispatch.LocalExperts:
  """LOCAL with the experts' matmuls quantized by `quant` (None: LOCAL itself); one object per Quant."""
  if quant is None:
    return LOCAL
  return LOCAL._replace(experts_ffn=functools.partial(experts_ffn, quant=quant))
