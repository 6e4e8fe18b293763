"""Blockwise (flash) attention in pure JAX: FlashAttention-2's forward and backward.

Shape legend: B batch, T query length, S key length, N query heads, K kv heads,
G = N // K query heads per kv head, H head dim. Blocked layouts add: Q number of query blocks,
C number of key blocks (chunks), P number of visited (query block, key block) pairs,
q rows of one query block, s columns of one key block.

Algorithm. The einsum reference materialises B x N x T x S scores, their mask and probabilities,
and autodiff keeps them for the backward pass: memory and memory traffic grow with T^2. Here the
sequence is cut into query blocks of `block_q` rows and key blocks of `block_kv` columns and one
`lax.scan` visits a static list of (query block, key block) pairs:
  forward  (online softmax): per pair, scores of the block in fp32, a running row max m and
           row sum l, and the output accumulator rescaled by exp(m_old - m_new); at the end
           out = acc / l and the per-row logsumexp lse = m + log(l) is saved.
  backward (recomputation): from the saved q, k, v, out and lse only -- probabilities are never
           stored -- per pair P = exp(S - lse), dV += P^T dO, dP = dO V^T, dS = P * (dP - D) with
           D = rowsum(dO * O), dQ += dS K, dK += dS^T Q.
Only O(T) arrays (inputs, accumulators, per-row statistics) and one block of scores exist at a time.

Why this shape:
  - Causal structure is exploited by the pair list, which is a compile-time constant: blocks wholly
    above the diagonal are never visited, yet the loop has a static trip count and one body, so
    program size and compile time do not grow with T (T=32768 with 512-blocks is 2080 pairs, one
    scan). No `lax.cond`, no dynamic `while_loop`, no callbacks, no variadic reductions: the same
    step compiles for AWS Neuron (DESIGN.md).
  - Masks are built per block from block-local ids (`mask.visible`): segment ids and positions of
    the block's rows and columns. The core takes query and key ids/positions separately, so it also serves a
    context-parallel caller whose local queries and gathered keys are different rows
    (`flash_attention_qkv`); `flash_attention` is the self-attention wrapper with the reference's
    signature. Padding keys get position int32-max, which every real query's causal test rejects.
  - GQA: q is viewed as [B, T, K, G, H] and contracted against k's K dim; K/V are never repeated.
  - Scores, softmax statistics and gradient accumulators are fp32 whatever the input dtype; the
    matmuls take the input dtype (bf16) as operands with fp32 accumulation.
  - Masked scores are `mask.MASK_VALUE`, a large finite negative, not -inf: a row with no visible key
    in a block (or a padded query row with none at all) stays finite, so gradients never see NaN.

Default block sizes: 128 x 128, measured with tools/bench_attention.py on the 2-core CPU (jax 0.10.2,
fp32 forward+backward, B*T = 16384, N=8, K=4, H=64, seconds, median of 3 on a shared machine):
  T=256:  64x64 0.78, 128x128 0.74, 256x256 1.34, 128x256 1.02, 256x128 1.15
  T=4096: 128x128 7.6, 256x256 9.1, 512x512 11.0, 256x512 13.5
Smaller blocks waste less on half-masked diagonal blocks and keep a block's scores in cache; the
per-iteration cost of the scan stays small at 128. GPUs will want other sizes (both are arguments).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.models.attention import mask as mask_lib
from maxtrain.models.attention.mask import MASK_VALUE

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_KV = 128

_PAD_POSITION = np.iinfo(np.int32).max


def flash_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, segment_ids_BT: jax.Array, *,
                    block_q: int = DEFAULT_BLOCK_Q, block_kv: int = DEFAULT_BLOCK_KV, window: int = 0,
                    sinks_N: jax.Array | None = None, logit_cap: float = 0.0) -> jax.Array:
  """Causal self-attention with document masking; same inputs and result as `dot_product_attention`.

  Positions are implicit (0..T-1), so key blocks wholly above the causal diagonal are skipped, and with a
  sliding `window` (0: none) also those wholly before it: the work grows with the window, not with T.
  """
  return flash_attention_qkv(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, segment_ids_BT,
                             block_q=block_q, block_kv=block_kv, window=window, sinks_N=sinks_N, logit_cap=logit_cap)


def flash_attention_qkv(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                        q_segment_ids_BT: jax.Array, kv_segment_ids_BS: jax.Array,
                        q_positions_BT: jax.Array | None = None, kv_positions_BS: jax.Array | None = None, *,
                        block_q: int = DEFAULT_BLOCK_Q, block_kv: int = DEFAULT_BLOCK_KV,
                        block_pairs: jax.Array | None = None, window: int = 0,
                        sinks_N: jax.Array | None = None, logit_cap: float = 0.0) -> jax.Array:
  """Attention of queries to keys where key s is visible from query t iff their segment ids are
  equal and kv_position[s] <= q_position[t].

  Positions None (both): implicit 0..T-1 and 0..S-1, and only the block pairs on or below the
  causal diagonal are visited (static). Positions given ([B, T] / [B, S], or [1, ...] broadcast over
  the batch): any layout, e.g. a context-parallel shard's queries against gathered keys; every
  block pair is visited and the mask comes from the positions alone. A query that sees no key at
  all (impossible in self-attention, possible for a caller's partial key set) gets a finite but
  meaningless row; merging partial results (ring attention) would need the row logsumexp too.

  `block_pairs` (int32 [P, 2], may be traced): the (query block, key block) pairs to visit, replacing
  the static list, for a caller that knows which blocks are wholly masked only at run time (a
  context shard's index); pairs left out must be wholly masked, and every query block must appear.
  `window` (static; 0: none): a key is visible only if q_position - kv_position < window as well.
  `sinks_N` ([N], differentiable; None: none): a learned logit per head that joins every row's softmax
  normaliser as one more column with no value (GPT-OSS's attention sinks): a row's weights sum to less
  than 1. The forward folds it into the final row max and sum; the backward needs nothing new for q, k, v
  (P = exp(S - lse) with the sink inside lse, and the sink column has dP = 0, so D = rowsum(dO * O) is
  unchanged) and d sink = -sum over rows of P_sink x D.
  `logit_cap` (static; 0: off; Gemma 2's `model.attn_logit_softcap`): the scaled scores become
  c tanh(s / c) before the mask, as in the dot kernel. The backward recomputes tanh with the scores and
  multiplies dS by its derivative 1 - tanh^2 before the matmuls: dQ and dK take the raw scores' gradient.
  """
  b, t, n, h = q_BTNH.shape
  _, s, k, _ = k_BSKH.shape
  if n % k or k_BSKH.shape != v_BSKH.shape or k_BSKH.shape[0] != b or k_BSKH.shape[3] != h:
    raise ValueError(f"need q [B, T, N, H] and k = v [B, S, K, H] with N % K == 0; got q {q_BTNH.shape}, "
                     f"k {k_BSKH.shape}, v {v_BSKH.shape}")
  if (q_positions_BT is None) != (kv_positions_BS is None):
    raise ValueError("give both q_positions_BT and kv_positions_BS, or neither")
  causal_skip = q_positions_BT is None
  if causal_skip:
    q_positions_BT = jnp.arange(t, dtype=jnp.int32)[None]
    kv_positions_BS = jnp.arange(s, dtype=jnp.int32)[None]
  bq, bkv = min(block_q, t), min(block_kv, s)  # a block larger than the sequence is clamped
  num_q, num_kv = -(-t // bq), -(-s // bkv)
  tp, sp = num_q * bq, num_kv * bkv

  def pad(x, length, value=0):
    return jnp.pad(x, [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2), constant_values=value)

  # Blocked layouts put the block index first (a cheap dynamic index in the scan) and the q rows
  # next to the group dim, so each block's matmuls are plain batched (B, K) matmuls.
  q_QBKqGH = pad(q_BTNH, tp).reshape(b, num_q, bq, k, n // k, h).transpose(1, 0, 3, 2, 4, 5)
  k_CBKsH = pad(k_BSKH, sp).reshape(b, num_kv, bkv, k, h).transpose(1, 0, 3, 2, 4)
  v_CBKsH = pad(v_BSKH, sp).reshape(b, num_kv, bkv, k, h).transpose(1, 0, 3, 2, 4)
  qseg_QBq = _blocks(pad(q_segment_ids_BT.astype(jnp.int32), tp), bq)
  kvseg_CBs = _blocks(pad(kv_segment_ids_BS.astype(jnp.int32), sp), bkv)
  # Padded keys: position int32-max, invisible to every real query. Padded query rows see real keys
  # (finite, and their cotangent is zero since they are sliced off below).
  qpos_QBq = _blocks(pad(q_positions_BT.astype(jnp.int32), tp, _PAD_POSITION - 1), bq)
  kvpos_CBs = _blocks(pad(kv_positions_BS.astype(jnp.int32), sp, _PAD_POSITION), bkv)

  if block_pairs is None:
    block_pairs = _block_pairs(num_q, num_kv, bq, bkv, s, causal_skip, window)
  has_sinks = sinks_N is not None
  sinks_KG = (sinks_N if has_sinks else jnp.zeros((n,), jnp.float32)).astype(jnp.float32).reshape(k, n // k)
  out_QBKqGH = _flash(window, has_sinks, float(logit_cap), jnp.asarray(block_pairs, jnp.int32), q_QBKqGH, k_CBKsH,
                      v_CBKsH, qseg_QBq, kvseg_CBs, qpos_QBq, kvpos_CBs, sinks_KG)
  return out_QBKqGH.transpose(1, 0, 3, 2, 4, 5).reshape(b, tp, n, h)[:, :t]


def _blocks(ids_BT: jax.Array, block: int) -> jax.Array:
  """[B, num * block] -> [num, B, block]."""
  return ids_BT.reshape(ids_BT.shape[0], -1, block).transpose(1, 0, 2)


def _block_pairs(num_q: int, num_kv: int, bq: int, bkv: int, s: int, causal_skip: bool, window: int = 0) -> tuple:
  """The static (query block, key block) visiting order, row-major. With implicit positions, key
  block j is visible from query block i iff its first key j * bkv <= the block's last query, and (a
  window) its last key (j + 1) * bkv - 1 > the block's first query i * bq - window."""
  pairs = []
  for i in range(num_q):
    last = min(num_kv, -(-min((i + 1) * bq, s) // bkv)) if causal_skip else num_kv
    first = max(0, (i * bq - window + 1) // bkv) if causal_skip and window else 0
    first = min(first, max(last, 1) - 1)  # every query block is visited at least once
    pairs.extend((i, j) for j in range(first, max(last, 1)))
  return tuple(pairs)


def _block_mask(qseg_Bq, kvseg_Bs, qpos_Bq, kvpos_Bs, window: int = 0) -> jax.Array:
  """[B, 1, q, 1, s] visibility of one block, from its rows' and columns' ids only."""
  mask_Bqs = mask_lib.visible(q_segment_ids_BT=qseg_Bq, kv_segment_ids_BS=kvseg_Bs, q_positions_BT=qpos_Bq,
                              kv_positions_BS=kvpos_Bs, window=window)
  return mask_Bqs[:, None, :, None, :]


def _pair_mask(q_BKqGH, qseg_QBq, kvseg_CBs, qpos_QBq, kvpos_CBs, i, j, window: int = 0) -> jax.Array:
  """`_block_mask` of pair (i, j), its ids tied to the query block by an optimization barrier.

  Why: the ids are not differentiated. Inside an enclosing scan that is differentiated (the model's
  layer scan), JAX's partial evaluation splits this loop into an id-only part and the rest, and
  the id-only part's per-pair masks become a stacked residual, pred[pairs, B, K, q, G, s]: O(T^2)
  memory (16 GiB per device for LLaMA 3 8B at T=32768). Through the barrier the ids depend on q,
  so the mask is computed where it is used, one block at a time.
  """
  ids, _ = jax.lax.optimization_barrier(((_take(qseg_QBq, i), _take(kvseg_CBs, j), _take(qpos_QBq, i),
                                          _take(kvpos_CBs, j)), q_BKqGH))
  return _block_mask(*ids, window)


def _scores(q_BKqGH, k_BKsH, mask_B1q1s, cap: float = 0.0) -> tuple[jax.Array, jax.Array | None]:
  """(the block's scaled scores, soft-capped when `cap` and masked; d capped / d raw = 1 - tanh^2 when `cap`,
  else None)."""
  scale = q_BKqGH.shape[-1] ** -0.5
  s_BKqGs = jnp.einsum("bkqgh,bksh->bkqgs", q_BKqGH, k_BKsH, preferred_element_type=jnp.float32) * scale
  slope_BKqGs = None
  if cap:
    tanh_BKqGs = jnp.tanh(s_BKqGs / cap)
    s_BKqGs, slope_BKqGs = cap * tanh_BKqGs, 1.0 - tanh_BKqGs * tanh_BKqGs
  return mask_lib.apply(s_BKqGs, mask_B1q1s), slope_BKqGs


def _take(x, i):
  return jax.lax.dynamic_index_in_dim(x, i, axis=0, keepdims=False)


def _put(x, update, i):
  return jax.lax.dynamic_update_index_in_dim(x, update, i, axis=0)


def _forward(window, has_sinks, cap, pairs, q_QBKqGH, k_CBKsH, v_CBKsH, qseg_QBq, kvseg_CBs, qpos_QBq, kvpos_CBs,
             sinks_KG):
  """Online softmax over the pair list. Returns out (q's dtype) and the row logsumexp (fp32), the sink
  column included when `has_sinks`."""

  def step(carry, ij):
    acc_QBKqGH, m_QBKqG, l_QBKqG = carry
    i, j = ij[0], ij[1]
    k_BKsH, v_BKsH, q_BKqGH = _take(k_CBKsH, j), _take(v_CBKsH, j), _take(q_QBKqGH, i)
    mask = _pair_mask(q_BKqGH, qseg_QBq, kvseg_CBs, qpos_QBq, kvpos_CBs, i, j, window)
    s_BKqGs, _ = _scores(q_BKqGH, k_BKsH, mask, cap)
    m_prev, l_prev = _take(m_QBKqG, i), _take(l_QBKqG, i)
    m_new = jnp.maximum(m_prev, s_BKqGs.max(axis=-1))
    correction = jnp.exp(m_prev - m_new)
    p_BKqGs = jnp.exp(s_BKqGs - m_new[..., None])
    l_new = correction * l_prev + p_BKqGs.sum(axis=-1)
    pv_BKqGH = jnp.einsum("bkqgs,bksh->bkqgh", p_BKqGs.astype(v_BKsH.dtype), v_BKsH,
                          preferred_element_type=jnp.float32)
    acc_new = correction[..., None] * _take(acc_QBKqGH, i) + pv_BKqGH
    return (_put(acc_QBKqGH, acc_new, i), _put(m_QBKqG, m_new, i), _put(l_QBKqG, l_new, i)), None

  # *_like keeps q's varying mesh axes under shard_map (a scan carry must match its body's output).
  init = (jnp.zeros_like(q_QBKqGH, jnp.float32), jnp.full_like(q_QBKqGH[..., 0], MASK_VALUE, jnp.float32),
          jnp.zeros_like(q_QBKqGH[..., 0], jnp.float32))
  (acc, m, l), _ = jax.lax.scan(step, init, pairs)
  if has_sinks:  # the sink column joins the normaliser: new max, rescaled sum and accumulator
    sink = sinks_KG[None, None, :, None, :]
    m_new = jnp.maximum(m, sink)
    correction = jnp.exp(m - m_new)
    l = correction * l + jnp.exp(sink - m_new)
    acc, m = acc * correction[..., None], m_new
  # Every row (padded ones included) has l >= 1: its max term is exp(0).
  return (acc / l[..., None]).astype(q_QBKqGH.dtype), m + jnp.log(l)


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """a + b = s + e exactly (Knuth): e is the rounding error of s."""
  s = a + b
  b_virtual = s - a
  return s, (a - (s - b_virtual)) + (b - b_virtual)


def _accurate_row_dot(x_QH: jax.Array, y_QH: jax.Array) -> jax.Array:
  """sum(x * y, -1) in fp32 to about fp32 rounding of the exact result (compensated, in the manner of
  Ogita-Rump-Oishi's Dot2), where a plain fp32 sum is off by several ulp of the sum of |x * y|.

  Why: FA2 takes D = rowsum(dO * O) for sum_s P_s dP_s, and dS = P * (dP - D) is a cancellation.
  The reference gets the subtraction consistent by construction (a query alone in its document
  has dQ exactly 0); here dP comes from the matmul and D from this sum, so D's own error shows up
  directly in dQ and dK. O(T * N * H) elementwise work, nothing against the O(T^2) matmuls.
  """
  # Products split through bf16 (a cast, so no FMA contraction can spoil it): hi * hi and hi * lo
  # are exact in fp32; the dropped rounding of lo * lo is ~2**-32 of the product.
  x_hi = x_QH.astype(jnp.bfloat16).astype(jnp.float32)
  y_hi = y_QH.astype(jnp.bfloat16).astype(jnp.float32)
  x_lo, y_lo = x_QH - x_hi, y_QH - y_hi
  prod = x_QH * y_QH
  err = (((x_hi * y_hi - prod) + x_hi * y_lo) + x_lo * y_hi) + x_lo * y_lo
  # Pairwise sum of the products, carrying each addition's exact rounding error along.
  while prod.shape[-1] > 1:
    if prod.shape[-1] % 2:
      prod, err = (jnp.concatenate([a, jnp.zeros_like(a[..., :1])], axis=-1) for a in (prod, err))
    prod, add_err = _two_sum(prod[..., 0::2], prod[..., 1::2])
    err = err[..., 0::2] + err[..., 1::2] + add_err
  return (prod + err)[..., 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _flash(window, has_sinks, cap, pairs, q_QBKqGH, k_CBKsH, v_CBKsH, qseg_QBq, kvseg_CBs, qpos_QBq, kvpos_CBs,
           sinks_KG):
  return _forward(window, has_sinks, cap, pairs, q_QBKqGH, k_CBKsH, v_CBKsH, qseg_QBq, kvseg_CBs, qpos_QBq, kvpos_CBs,
                  sinks_KG)[0]


def _flash_fwd(window, has_sinks, cap, pairs, q_QBKqGH, k_CBKsH, v_CBKsH, qseg_QBq, kvseg_CBs, qpos_QBq, kvpos_CBs,
               sinks_KG):
  ids = (qseg_QBq, kvseg_CBs, qpos_QBq, kvpos_CBs)
  out, lse_QBKqG = _forward(window, has_sinks, cap, pairs, q_QBKqGH, k_CBKsH, v_CBKsH, *ids, sinks_KG)
  return out, (pairs, q_QBKqGH, k_CBKsH, v_CBKsH, ids, out, lse_QBKqG, sinks_KG)


def _flash_bwd(window, has_sinks, cap, residuals, dout_QBKqGH):
  pairs, q_QBKqGH, k_CBKsH, v_CBKsH, ids, out_QBKqGH, lse_QBKqG, sinks_KG = residuals
  qseg_QBq, kvseg_CBs, qpos_QBq, kvpos_CBs = ids
  scale = q_QBKqGH.shape[-1] ** -0.5
  dout_QBKqGH = dout_QBKqGH.astype(q_QBKqGH.dtype)
  d_QBKqG = _accurate_row_dot(dout_QBKqGH.astype(jnp.float32), out_QBKqGH.astype(jnp.float32))

  def step(carry, ij):
    dq_QBKqGH, dk_CBKsH, dv_CBKsH = carry
    i, j = ij[0], ij[1]
    q_BKqGH, k_BKsH, v_BKsH = _take(q_QBKqGH, i), _take(k_CBKsH, j), _take(v_CBKsH, j)
    dout_BKqGH = _take(dout_QBKqGH, i)
    mask = _pair_mask(q_BKqGH, qseg_QBq, kvseg_CBs, qpos_QBq, kvpos_CBs, i, j, window)
    s_BKqGs, slope_BKqGs = _scores(q_BKqGH, k_BKsH, mask, cap)
    p_BKqGs = jnp.exp(s_BKqGs - _take(lse_QBKqG, i)[..., None])
    dv_BKsH = jnp.einsum("bkqgs,bkqgh->bksh", p_BKqGs.astype(dout_BKqGH.dtype), dout_BKqGH,
                         preferred_element_type=jnp.float32)
    dp_BKqGs = jnp.einsum("bkqgh,bksh->bkqgs", dout_BKqGH, v_BKsH, preferred_element_type=jnp.float32)
    ds_BKqGs = p_BKqGs * (dp_BKqGs - _take(d_QBKqG, i)[..., None]) * scale
    if cap:  # through the soft-cap: d raw score = d capped x (1 - tanh^2)
      ds_BKqGs = ds_BKqGs * slope_BKqGs
    ds_BKqGs = ds_BKqGs.astype(q_BKqGH.dtype)
    dq_BKqGH = jnp.einsum("bkqgs,bksh->bkqgh", ds_BKqGs, k_BKsH, preferred_element_type=jnp.float32)
    dk_BKsH = jnp.einsum("bkqgs,bkqgh->bksh", ds_BKqGs, q_BKqGH, preferred_element_type=jnp.float32)
    return (_put(dq_QBKqGH, _take(dq_QBKqGH, i) + dq_BKqGH, i), _put(dk_CBKsH, _take(dk_CBKsH, j) + dk_BKsH, j),
            _put(dv_CBKsH, _take(dv_CBKsH, j) + dv_BKsH, j)), None

  init = (jnp.zeros_like(q_QBKqGH, jnp.float32), jnp.zeros_like(k_CBKsH, jnp.float32),
          jnp.zeros_like(v_CBKsH, jnp.float32))
  (dq, dk, dv), _ = jax.lax.scan(step, init, pairs)
  dsinks_KG = jnp.zeros_like(sinks_KG)
  if has_sinks:  # d sink = sum over rows of P_sink x (0 - D): the sink column's dP is 0 (it has no value)
    p_sink = jnp.exp(sinks_KG[None, None, :, None, :] - lse_QBKqG)
    dsinks_KG = -jnp.sum(p_sink * d_QBKqG, axis=(0, 1, 3))
  # Integer ids have no cotangent.
  return (None, dq.astype(q_QBKqGH.dtype), dk.astype(k_CBKsH.dtype), dv.astype(v_CBKsH.dtype), None, None, None, None,
          dsinks_KG)


_flash.defvjp(_flash_fwd, _flash_bwd)
