"""Causal attention by query blocks over their key prefix, probabilities kept for the backward pass.

Shape legend: B batch, T length (queries = keys), N query heads, K kv heads, G = N // K query heads
per kv head, H head dim; q rows of one query block, s its key prefix.

Algorithm. The queries are cut into a few blocks; block [r0, r1) attends to the keys [0, r1): every
key at or before its last row, so the blocks wholly above the causal diagonal are never computed
(flash's saving) while each block sees all the keys it needs at once. Its softmax is then exact in
one pass (no running max, no rescaling), and its probabilities P are kept for the backward pass,
which needs no recomputation:
  dV += P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(P * dP)),  dQ = dS K,  dK += dS^T Q.
Masks come from segment ids and the block's static row and column indices.

Why, next to flash: at short T flash's pair loop spends most of its time outside the matmuls' peak:
at the default CPU config (T=256, 128-blocks) it visits 3 pairs, each with batched [B*K] matmuls of
128 x 128 x 64 that XLA:CPU runs at about a third of its matmul peak, and recomputes the scores in
the backward pass. Here there are 4 blocks of fewer, larger matmuls and no recomputation: 1.46x
flash's forward + backward at T=256, 1.50x at 512 and 1.31x at 1024 on the 2-core CPU
(`tools/bench_attention.py --heads 4,2,64 --tokens 4096 --time-lengths 256,512,1024`).
The price is memory: the kept P is O(T^2), 5/8 of B x N x T x T fp32 with 4 blocks, so `auto` picks
this kernel only for short sequences (`models/attention.resolve_kernel`).
Scores, P and the gradients' accumulators are fp32 whatever the input dtype; the matmuls take the
input dtype as operands with fp32 accumulation, as in flash.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.models.attention import mask as mask_lib


def default_block_q(t: int) -> int:
  """4 query blocks, each of 64..256 rows (measured best at T = 256, 512 and 1024 on the 2-core CPU)."""
  return min(t, min(256, max(64, -(-t // 4))))


def blocked_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, segment_ids_BT: jax.Array, *,
                      block_q: int | None = None, window: int = 0) -> jax.Array:
  """Causal self-attention with document masking; same inputs and result as `dot_product_attention`.
  A sliding `window` (0: none) cuts each query block's keys to [r0 - window + 1, r1): the keys wholly
  before the window are never computed."""
  b, t, n, h = q_BTNH.shape
  k = k_BTKH.shape[2]
  if n % k or k_BTKH.shape != v_BTKH.shape or k_BTKH.shape[:2] != (b, t) or k_BTKH.shape[3] != h:
    raise ValueError(f"need q [B, T, N, H] and k = v [B, T, K, H] with N % K == 0; got q {q_BTNH.shape}, "
                     f"k {k_BTKH.shape}, v {v_BTKH.shape}")
  bq = block_q or default_block_q(t)
  bounds = tuple((max(0, r0 - window + 1) if window else 0, r0, min(r0 + bq, t)) for r0 in range(0, t, bq))
  # [B, K, T, G, H]: each block's matmuls are plain batched (B, K) matmuls over (rows x G).
  q_BKTGH = q_BTNH.reshape(b, t, k, n // k, h).transpose(0, 2, 1, 3, 4)
  out_BKTGH = _blocked(bounds, window, q_BKTGH, k_BTKH.transpose(0, 2, 1, 3), v_BTKH.transpose(0, 2, 1, 3),
                       segment_ids_BT.astype(jnp.int32))
  return out_BKTGH.transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)


def _probabilities(q_BKTGH, k_BKSH, segment_ids_BT, k0: int, r0: int, r1: int, window: int) -> jax.Array:
  """fp32 softmax P [B, K, q, G, s] of query rows [r0, r1) over the keys [k0, r1)."""
  scale = q_BKTGH.shape[-1] ** -0.5
  s_BKqGs = jnp.einsum("bkqgh,bksh->bkqgs", q_BKTGH[:, :, r0:r1], k_BKSH[:, :, k0:r1],
                       preferred_element_type=jnp.float32) * scale
  visible_Bqs = mask_lib.visible(q_segment_ids_BT=segment_ids_BT[:, r0:r1], kv_segment_ids_BS=segment_ids_BT[:, k0:r1],
                                 q_positions_BT=np.arange(r0, r1)[None], kv_positions_BS=np.arange(k0, r1)[None],
                                 window=window)
  s_BKqGs = mask_lib.apply(s_BKqGs, visible_Bqs[:, None, :, None, :])
  # Every row sees at least its own key, so the row max is a real score and the sum is >= 1.
  p_BKqGs = jnp.exp(s_BKqGs - s_BKqGs.max(axis=-1, keepdims=True))
  return p_BKqGs / p_BKqGs.sum(axis=-1, keepdims=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _blocked(bounds, window, q_BKTGH, k_BKSH, v_BKSH, segment_ids_BT):
  return _blocked_fwd(bounds, window, q_BKTGH, k_BKSH, v_BKSH, segment_ids_BT)[0]


def _blocked_fwd(bounds, window, q_BKTGH, k_BKSH, v_BKSH, segment_ids_BT):
  outs, probs = [], []
  for k0, r0, r1 in bounds:
    p_BKqGs = _probabilities(q_BKTGH, k_BKSH, segment_ids_BT, k0, r0, r1, window)
    outs.append(jnp.einsum("bkqgs,bksh->bkqgh", p_BKqGs.astype(v_BKSH.dtype), v_BKSH[:, :, k0:r1],
                           preferred_element_type=jnp.float32).astype(q_BKTGH.dtype))
    probs.append(p_BKqGs)
  return jnp.concatenate(outs, axis=2), (q_BKTGH, k_BKSH, v_BKSH, probs)


def _blocked_bwd(bounds, window, residuals, dout_BKTGH):
  del window  # in the kept probabilities
  q_BKTGH, k_BKSH, v_BKSH, probs = residuals
  scale = q_BKTGH.shape[-1] ** -0.5
  dout_BKTGH = dout_BKTGH.astype(q_BKTGH.dtype)
  dk_BKSH, dv_BKSH = jnp.zeros(k_BKSH.shape, jnp.float32), jnp.zeros(v_BKSH.shape, jnp.float32)
  dqs = []
  for (k0, r0, r1), p_BKqGs in zip(bounds, probs):
    q_BKqGH, dout_BKqGH = q_BKTGH[:, :, r0:r1], dout_BKTGH[:, :, r0:r1]
    dv_BKSH = dv_BKSH.at[:, :, k0:r1].add(jnp.einsum("bkqgs,bkqgh->bksh", p_BKqGs.astype(dout_BKqGH.dtype),
                                                   dout_BKqGH, preferred_element_type=jnp.float32))
    dp_BKqGs = jnp.einsum("bkqgh,bksh->bkqgs", dout_BKqGH, v_BKSH[:, :, k0:r1], preferred_element_type=jnp.float32)
    # The softmax backward on the kept P itself: sum_s P dP is consistent with dP by construction.
    ds_BKqGs = (p_BKqGs * (dp_BKqGs - jnp.sum(p_BKqGs * dp_BKqGs, axis=-1, keepdims=True)) * scale
                ).astype(q_BKTGH.dtype)
    dqs.append(jnp.einsum("bkqgs,bksh->bkqgh", ds_BKqGs, k_BKSH[:, :, k0:r1], preferred_element_type=jnp.float32))
    dk_BKSH = dk_BKSH.at[:, :, k0:r1].add(jnp.einsum("bkqgs,bkqgh->bksh", ds_BKqGs, q_BKqGH,
                                                   preferred_element_type=jnp.float32))
  # Integer ids have no cotangent.
  return (jnp.concatenate(dqs, axis=2).astype(q_BKTGH.dtype), dk_BKSH.astype(k_BKSH.dtype),
          dv_BKSH.astype(v_BKSH.dtype), None)


_blocked.defvjp(_blocked_fwd, _blocked_bwd)
