"""Context-parallel attention: the sequence split over the mesh axes of `act_length`, attention run
under `jax.shard_map` with keys and values all-gathered over those axes.

Shape legend: B batch, T length (L = T / C local), N query heads, K kv heads, H head dim, C context
shards; chunks: the sequence cut into 2C equal chunks of c = T / 2C tokens.

Layout (causal load balancing). Each context shard holds two chunks of every sequence: shard i holds
chunks i and 2C-1-i (an early and the matching late one), so every shard has the same amount of
visible (causal) work: chunk i sees i+1 chunks of keys, chunk 2C-1-i sees 2C-i, 2C+1 in all on every
shard. `zigzag_order` is the token permutation; `batch.to_device` applies it to every host batch
once, before it goes to the device, so the step itself never reorders. Token ids, targets, loss
mask, segment ids and positions move together, so the loss (a masked sum over tokens) and rotary
positions (per-document positions travel with their tokens) are unchanged.

Algorithm, per layer and shard: all-gather K, V, their segment ids and positions over the context
axes (the gathered sequence is in zigzag order), then `flash_attention_qkv` of the local queries
against them with explicit positions: key s is visible from query t iff same segment and
pos[s] <= pos[t]. That mask needs only per-document positions and segment ids, because packed
documents are contiguous with distinct segment ids (`data/pipeline.py`). Wholly masked block pairs
are skipped: the visited (query block, key block) list is built from the shard index (a traced
value, so the list is an array of static length, 2C-1 full chunk pairs plus 2 diagonal ones, the
same on every shard); nothing is computed for the masked half. The backward of the all-gather is a
reduce-scatter of dK, dV (autodiff through shard_map).

Why all-gather and not a ring (ppermute of K/V chunks overlapped with the blockwise compute), by
measurement (tools/bench_context.py, 8 fake CPU devices, fsdp=2 x context=4, B=2, T=4096, N=8,
K=2, H=64, fp32 forward + backward, median of 5; BENCHMARKS.md):
  gathered (this module) 2.79 s; the same with the all-gather replaced by a local copy of the same
  shape (the computation without any communication) 2.94 s; without the zigzag layout and skipping
  (natural order, every block pair) 5.28 s.
So the all-gather costs nothing measurable next to the attention itself: a ring could at most hide
that difference, and would cost a second, harder kernel (partial results merged through their row
logsumexp, a backward that sends dK/dV around the ring the other way). The 1.89x is load balancing
plus skipping, which the gathered form gets with a static-length pair list. On real hardware the
sizes say the same: with GQA the gathered K/V are K/N of the query bytes; for LLaMA 3 8B at 131072
tokens one layer's all-gather moves 2 x 131072 x 8 x 128 x 2 B = 512 MiB (about 1 ms over NVLink at
~450 GB/s), against ~1.8e13 FLOPs of attention forward per device at context=8 (tens of ms), and
XLA runs collectives asynchronously. A ring pays off across slow links or at C beyond a node, which
the mesh does not do (context stays inside a granule); it would be a second function with this
signature.

The model never names a mesh axis: `for_rules(rules, ...)` returns this attention when the model's rules
split `act_length` over mesh axes of total size > 1 in the current mesh, else None. The local kernel
is the caller's (models/ passes `flash_attention_qkv`): sharding/ sits below models/ and imports
nothing from it, so the collective takes the kernel as an argument.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.sharding import rules as rules_lib

Q_LOGICAL = ("act_batch", "act_length", "act_heads", None)
KV_LOGICAL = ("act_batch", "act_length", "act_kv_heads", None)
IDS_LOGICAL = ("act_batch", "act_length")


def zigzag_order(seq_len: int, shards: int) -> np.ndarray:
  """The token permutation of a sequence for `shards` context shards: position j of the reordered
  sequence holds token order[j]; shard i's contiguous slice holds chunks i and 2C-1-i."""
  if seq_len % (2 * shards):
    raise ValueError(f"seq_len={seq_len} is not divisible by 2 x {shards} context shards")
  chunks = np.arange(seq_len).reshape(2 * shards, -1)
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


def _block_size(chunk: int, block: int) -> int:
  """The largest size <= `block` that divides the chunk, so no block straddles two chunks."""
  return max(d for d in range(1, min(block, chunk) + 1) if chunk % d == 0)


def block_pairs(shard: jax.Array, shards: int, chunk: int, bq: int, bkv: int) -> jax.Array:
  """int32 [P, 2]: the (local query block, gathered key block) pairs shard `shard` must visit.

  Local queries: early chunk (natural chunk i = shard) then late chunk (2C-1-i), nq = chunk/bq
  blocks each. Gathered keys: shard s's 2 chunks at [2cs, 2c(s+1)): natural chunk m < C is at
  shard m's first half, m >= C at shard 2C-1-m's second half. The early chunk sees chunks 0..i-1
  fully, the late chunk 0..2C-2-i fully: 2C-1 full chunk pairs, enumerated by slot u as (early, u)
  for u < i, else (late, u - i); plus each chunk against itself, lower block triangle only.
  """
  if chunk % bq or chunk % bkv:
    raise ValueError(f"blocks {bq} x {bkv} must divide the chunk of {chunk} tokens")
  nq, nk = chunk // bq, chunk // bkv
  u = jnp.arange(2 * shards - 1, dtype=jnp.int32)
  side = (u >= shard).astype(jnp.int32)  # 0 early, 1 late
  kv_chunk = jnp.where(side == 0, u, u - shard)
  full_side, full_chunk = side, kv_chunk
  # The two diagonal chunk pairs.
  diag_side = jnp.array([0, 1], jnp.int32)
  diag_chunk = jnp.stack([shard, 2 * shards - 1 - shard]).astype(jnp.int32)

  def kv_block0(m):  # first gathered key block of natural chunk m
    owner = jnp.where(m < shards, m, 2 * shards - 1 - m)
    return (owner * 2 + (m >= shards)) * nk

  full = np.array([(r, s) for r in range(nq) for s in range(nk)], np.int32)  # static
  tri = np.array([(r, s) for r in range(nq) for s in range(nk) if s * bkv <= (r + 1) * bq - 1], np.int32)

  def expand(sides, chunks, sub):
    q = sides[:, None] * nq + sub[None, :, 0]
    k = kv_block0(chunks)[:, None] + sub[None, :, 1]
    return jnp.stack([q, k], axis=-1).reshape(-1, 2)

  return jnp.concatenate([expand(full_side, full_chunk, full), expand(diag_side, diag_chunk, tri)])


def context_attention(q_BLNH: jax.Array, k_BLKH: jax.Array, v_BLKH: jax.Array, segment_ids_BL: jax.Array,
                      positions_BL: jax.Array, *, kernel: Callable, axes: tuple[str, ...], shards: int, block_q: int,
                      block_kv: int) -> jax.Array:
  """The shard_map body: this shard's queries (chunks i, 2C-1-i) against all keys, gathered over
  the mesh `axes` (the `act_length` ones, of total size `shards`). `kernel`: flash's core signature,
  (q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions, *, block_q, block_kv, block_pairs)."""
  gather = functools.partial(jax.lax.all_gather, axis_name=axes, axis=1, tiled=True)
  k_BTKH, v_BTKH, seg_BT, pos_BT = gather(k_BLKH), gather(v_BLKH), gather(segment_ids_BL), gather(positions_BL)
  chunk = q_BLNH.shape[1] // 2
  bq, bkv = _block_size(chunk, block_q), _block_size(chunk, block_kv)
  pairs = block_pairs(jax.lax.axis_index(axes), shards, chunk, bq, bkv)
  return kernel(q_BLNH, k_BTKH, v_BTKH, segment_ids_BL, seg_BT, positions_BL, pos_BT,
                             block_q=bq, block_kv=bkv, block_pairs=pairs)


def sharded(mesh: jax.sharding.AbstractMesh | jax.sharding.Mesh, rules: rules_lib.Rules, kernel: Callable, *,
            block_q: int, block_kv: int) -> Callable:
  """`context_attention` with the local `kernel` under shard_map on `mesh`, its specs from `rules`: a
  function of global arrays (q, k, v, segment_ids, positions) in zigzag token order."""
  axes = rules_lib.mesh_axes(rules["act_length"])
  shards = math.prod(mesh.shape[a] for a in axes)
  spec = lambda logical: rules_lib.logical_to_mesh(logical, rules)
  body = functools.partial(context_attention, kernel=kernel, axes=axes, shards=shards, block_q=block_q,
                           block_kv=block_kv)
  return jax.shard_map(body, mesh=mesh,
                       in_specs=(spec(Q_LOGICAL), spec(KV_LOGICAL), spec(KV_LOGICAL), spec(IDS_LOGICAL),
                                 spec(IDS_LOGICAL)),
                       out_specs=spec(Q_LOGICAL))


def for_rules(rules: rules_lib.Rules | None, kernel: Callable, *, block_q: int, block_kv: int) -> Callable | None:
  """Context-parallel attention when `rules` (the model's: sharding/rules.py Parallel) split `act_length` over
  mesh axes of total size > 1 in the current mesh (the step traces under `jax.set_mesh`); None otherwise
  (no rules: a model on its own; the caller runs its own kernel on the whole sequence)."""
  mesh = jax.sharding.get_abstract_mesh()
  if rules is None or mesh.empty:
    return None
  if math.prod(mesh.shape[a] for a in rules_lib.mesh_axes(rules["act_length"])) == 1:
    return None
  return sharded(mesh, rules, kernel=kernel, block_q=block_q, block_kv=block_kv)
