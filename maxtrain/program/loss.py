"""Per-token cross-entropy and log-partition of the output head, plain and chunked.

Shape legend: B batch, T length, D model, V vocab, K number of chunks, C positions per chunk (of each
sequence; a chunk holds B x C tokens), G batch shards.

Both paths return `(ce_BT, log_z_BT)` in fp32: the token cross-entropy `log Z - logit[target]` and the
log partition `log Z = logsumexp(logits)` that the z-loss squares. They are one kernel family
(STYLE 17): `reference_head_losses` is the oracle, `chunked_token_losses` takes the same arguments
plus a chunk size, and `head_losses` picks one by `chunk_tokens` (0 = reference).

Why chunk: the plain head materialises fp32 `[B, T, V]` logits, 4 GiB per 8192-token sequence at
V = 128256, and autodiff keeps them (or their softmax) alive for a backward that builds a second
`[B, T, V]` cotangent. Nothing downstream needs them: the loss needs two numbers per token.

Algorithm (`chunked_token_losses`, a `jax.custom_vjp`):
- The length dim is padded to K x C and the tokens are processed in K chunks of `[B, C]` by
  `lax.scan`. Chunks cut the length dim, never the batch dim, because the batch dim is the sharded one
  ("data", "fsdp"): every device works on every chunk and the scanned dim stays unsharded, so GSPMD
  never gathers activations to slice them.
- Forward, per chunk: `logits_BCV = x_BCD @ head_DV` (compute-dtype operands, fp32 accumulation),
  `log_z = logsumexp` in fp32, target logit picked by comparing a vocab iota with the target (a
  masked sum, not a gather: with the vocab dim sharded over "tensor" that is a local select plus the
  same small all-reduce as the logsumexp, where a gather would make GSPMD all-gather the logits).
  Only `log_z_BT` is saved for the backward, besides the inputs.
- Backward, per chunk, the logits are recomputed and, with cotangents `g_ce`, `g_z` of the two
  outputs, `d logits = (g_ce + g_z) * softmax - g_ce * onehot(target)` (d log Z / d logits is the
  softmax; d ce is softmax - onehot). Then `d x_BCD = d logits @ head^T` per chunk (stacked by the
  scan) and `d head_DV += x_BCD^T @ d logits` in an fp32 carry across chunks, one partial sum per
  batch shard, reduced across devices once at the end (see `batch_shards`).
  Peak memory is a few `[B, C, V]` fp32 buffers plus the `[D, V]` fp32 gradient accumulator,
  instead of several `[B, T, V]` ones. Cost: the head matmul runs three times forward+backward as in
  the plain path, plus one recompute (4 matmuls instead of 3).
- Under bf16 compute, `d logits` is rounded to bf16 before the two backward matmuls so that they run
  as bf16 x bf16 -> fp32 (tensor cores), and `d head` is accumulated and returned in fp32. The plain
  path's autodiff differs on both counts: it keeps fp32 `d logits` in a mixed bf16 x fp32 matmul (an
  fp32 matmul in practice) and rounds `d head` to bf16 through the transpose of the head's cast.

Exactness: in fp32 the chunked path computes the same per-token values as the reference (the same
logits row, the same fp32 logsumexp); only the order of the `d head` summation over tokens differs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.models.layers import project
from maxtrain.sharding.rules import NONE, Parallel

# Default `chunk_tokens` (per device), from `tools/bench_loss.py` on the 2-core CPU, jax 0.10.2: at
# 8B dims (8192 tokens, V=128256, bf16) the compiled fwd+bwd temp is 4.7 GiB at 2048 (4.3 at 512,
# 6.1 at 4096, 10.1 plain); time varied by less than the machine's noise between 256 and 2048, and a
# GPU wants the larger matmul.
DEFAULT_CHUNK_TOKENS = 2048
# From V=4096 up the chunked path was 0.70-0.76x the plain path's time (and half its memory or
# less); at V=384 the plain path was 13-18% faster than chunks of 512-2048 and its logits are 6 MiB.
CHUNK_MIN_VOCAB = 4096
# Logical axes of `head_DV` (the head, or the tied embedding transposed: models/decoder.py).
HEAD_AXES = ("embed", "vocab")


def token_losses(logits_BTV: jax.Array, targets_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per-token cross-entropy and log partition function log Z (the z-loss input), fp32."""
  logits_BTV = logits_BTV.astype(jnp.float32)
  log_z_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
  # A masked sum, not a gather: the same value (one term, the rest exact zeros), and XLA's SPMD partitioner
  # aborts on this gather with the vocab dim sharded over tensor inside the 1f1b stage loop (sharding/schedules.py).
  target_logit_BT = jnp.sum(jnp.where(_target_mask(targets_BT, logits_BTV.shape[-1]), logits_BTV, 0.0), axis=-1)
  return log_z_BT - target_logit_BT, log_z_BT


def head_logits(x_BTD: jax.Array, head_DV: jax.Array, compute_dtype, quant=None) -> jax.Array:
  """fp32 logits from compute-dtype operands (fp32 accumulation, no rounding of the result); `quant`:
  the head in FP8/int8 (models/quant.py)."""
  return project(x_BTD.astype(compute_dtype), head_DV.astype(compute_dtype), preferred_element_type=jnp.float32,
                 quant=quant)


def softcap(logits: jax.Array, cap: float) -> jax.Array:
  """Gemma 2's final-logit soft-capping, cap * tanh(logits / cap) (`model.final_logit_softcap`; 0: off)."""
  return cap * jnp.tanh(logits / cap) if cap else logits


def reference_head_losses(x_BTD: jax.Array, head_DV: jax.Array, targets_BT: jax.Array, *,
                          compute_dtype=jnp.float32, quant=None, logit_cap: float = 0.0) -> tuple[jax.Array, jax.Array]:
  """The oracle: full `[B, T, V]` logits (soft-capped by `logit_cap`: 0 off), then `token_losses`."""
  return token_losses(softcap(head_logits(x_BTD, head_DV, compute_dtype, quant), logit_cap), targets_BT)


def default_chunk_tokens(vocab_size: int) -> int:
  """The chunk size to use for a vocabulary: 0 (plain path) below `CHUNK_MIN_VOCAB`."""
  return DEFAULT_CHUNK_TOKENS if vocab_size >= CHUNK_MIN_VOCAB else 0


def head_losses(x_BTD: jax.Array, head_DV: jax.Array, targets_BT: jax.Array, *, chunk_tokens: int,
                compute_dtype=jnp.float32, batch_shards: int = 1, length_shards: int = 1,
                quant=None, logit_cap: float = 0.0, parallel: Parallel = NONE) -> tuple[jax.Array, jax.Array]:
  """`(ce_BT, log_z_BT)` of the head: chunked when `chunk_tokens > 0`, else the reference; the logits
  soft-capped by `logit_cap` (0: off) in both. `parallel`: the model's layout (sharding/rules.py), by which the
  chunked backward lays out its head gradient (none: GSPMD decides).

  `length_shards` > 1 (context parallelism: the length dim split into that many shards): the chunked
  path sees each sequence as `length_shards` rows of T / length_shards tokens, so its chunks cut
  every shard's own tokens and the scanned dim stays unsharded (cutting the sharded length dim
  would make GSPMD gather it). Per-token values do not depend on the grouping."""
  if chunk_tokens > 0:
    B, T = targets_BT.shape
    if T % length_shards:
      raise ValueError(f"length_shards={length_shards} must divide the length {T}")
    rows, cols = B * length_shards, T // length_shards
    ce, log_z = chunked_token_losses(x_BTD.reshape(rows, cols, -1), head_DV, targets_BT.reshape(rows, cols),
                                     chunk_tokens=chunk_tokens, compute_dtype=compute_dtype,
                                     batch_shards=batch_shards * length_shards, logit_cap=logit_cap,
                                     parallel=parallel)
    return ce.reshape(B, T), log_z.reshape(B, T)
  return reference_head_losses(x_BTD, head_DV, targets_BT, compute_dtype=compute_dtype, quant=quant,
                               logit_cap=logit_cap)


def chunked_token_losses(x_BTD: jax.Array, head_DV: jax.Array, targets_BT: jax.Array, *,
                         chunk_tokens: int, compute_dtype=jnp.float32,
                         batch_shards: int = 1, logit_cap: float = 0.0,
                         parallel: Parallel = NONE) -> tuple[jax.Array, jax.Array]:
  """`reference_head_losses` without the `[B, T, V]` logits, forward or backward.

  `logit_cap` > 0: the logits soft-capped (c tanh(z / c)); the backward multiplies d logits by its
  derivative 1 - tanh(z / c)^2 before the two matmuls.

  `chunk_tokens` is the number of tokens per chunk on each batch shard (device): each chunk takes
  `C = max(1, chunk_tokens * batch_shards // B)` positions of every sequence, so a device holds
  about `chunk_tokens x V_local` fp32 logits at a time, whatever the mesh size. Differentiable in
  `x_BTD` and `head_DV`, through both outputs.

  `batch_shards`: the number of shards of the batch dim (the product of the batch mesh axes). The
  backward keeps one fp32 `d head` partial sum per batch shard (`[G, D, V]`, G sharded like the
  batch, so still one `[D, V_local]` per device) and sums them once after the last chunk. With a
  single accumulator GSPMD all-reduces `d head` across the batch shards after every chunk: K
  all-reduces of the whole head gradient instead of the plain path's one.
  """
  if chunk_tokens <= 0:
    raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
  B, T = targets_BT.shape
  if batch_shards <= 0 or B % batch_shards:
    raise ValueError(f"batch_shards={batch_shards} must be positive and divide the batch size {B}")
  C = min(T, max(1, chunk_tokens * batch_shards // B))
  return _chunked(x_BTD, head_DV, targets_BT, C, np.dtype(compute_dtype), batch_shards, float(logit_cap), parallel)


def _to_chunks(a_BT: jax.Array, C: int) -> jax.Array:
  """[B, T, ...] -> [K, B, C, ...], the length dim zero-padded to K x C."""
  B, T = a_BT.shape[:2]
  K = -(-T // C)
  pad = [(0, 0)] * a_BT.ndim
  pad[1] = (0, K * C - T)
  a_BKC = jnp.pad(a_BT, pad).reshape(B, K, C, *a_BT.shape[2:])
  return jnp.moveaxis(a_BKC, 1, 0)


def _from_chunks(a_KBC: jax.Array, T: int) -> jax.Array:
  """[K, B, C, ...] -> [B, T, ...], dropping the padding."""
  K, B, C = a_KBC.shape[:3]
  return jnp.moveaxis(a_KBC, 0, 1).reshape(B, K * C, *a_KBC.shape[3:])[:, :T]


def _matmul(a, b, dims):
  return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)


def _chunk_logits(x_BCD, head_DV, compute_dtype):
  return _matmul(x_BCD.astype(compute_dtype), head_DV, ((2,), (0,)))  # head already in compute dtype


def _target_mask(targets_BC, V):
  # An iota compare instead of a gather: elementwise, so a vocab-sharded dim stays sharded.
  return jax.lax.broadcasted_iota(jnp.int32, (*targets_BC.shape, V), 2) == targets_BC[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _chunked(x_BTD, head_DV, targets_BT, C, compute_dtype, G, cap, parallel):
  return _chunked_fwd(x_BTD, head_DV, targets_BT, C, compute_dtype, G, cap, parallel)[0]


def _chunked_fwd(x_BTD, head_DV, targets_BT, C, compute_dtype, G, cap, parallel):
  del parallel  # only the backward lays out what it computes (the head gradient)
  T, V = targets_BT.shape[1], head_DV.shape[1]
  head_cd_DV = head_DV.astype(compute_dtype)

  def body(_, chunk):
    x_BCD, targets_BC = chunk
    logits_BCV = softcap(_chunk_logits(x_BCD, head_cd_DV, compute_dtype), cap)
    log_z_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
    target_logit_BC = jnp.sum(jnp.where(_target_mask(targets_BC, V), logits_BCV, 0.0), axis=-1)
    return None, (log_z_BC - target_logit_BC, log_z_BC)

  _, (ce_KBC, log_z_KBC) = jax.lax.scan(body, None, (_to_chunks(x_BTD, C), _to_chunks(targets_BT, C)))
  log_z_BT = _from_chunks(log_z_KBC, T)
  return (_from_chunks(ce_KBC, T), log_z_BT), (x_BTD, head_DV, targets_BT, log_z_BT)


def _chunked_bwd(C, compute_dtype, G, cap, parallel, residuals, cotangents):
  x_BTD, head_DV, targets_BT, log_z_BT = residuals
  g_ce_BT, g_z_BT = cotangents
  D, V = head_DV.shape
  T = targets_BT.shape[1]
  head_cd_DV = head_DV.astype(compute_dtype)

  def body(d_head_GDV, chunk):
    x_BCD, targets_BC, log_z_BC, g_ce_BC, g_z_BC = chunk
    x_cd_BCD = x_BCD.astype(compute_dtype)
    logits_BCV = _matmul(x_cd_BCD, head_cd_DV, ((2,), (0,)))
    if cap:
      tanh_BCV = jnp.tanh(logits_BCV / cap)
      logits_BCV = cap * tanh_BCV
    softmax_BCV = jnp.exp(logits_BCV - log_z_BC[..., None])
    d_logits_BCV = ((g_ce_BC + g_z_BC)[..., None] * softmax_BCV
                    - jnp.where(_target_mask(targets_BC, V), g_ce_BC[..., None], 0.0))
    if cap:  # through the cap: d z = d (c tanh(z / c)) * (1 - tanh^2)
      d_logits_BCV = d_logits_BCV * (1.0 - tanh_BCV * tanh_BCV)
    d_logits_BCV = d_logits_BCV.astype(compute_dtype)
    d_x_BCD = _matmul(d_logits_BCV, head_cd_DV, ((2,), (1,))).astype(x_BTD.dtype)
    # Summed over the tokens of each batch shard only: no cross-device reduction inside the loop.
    x_cd_GBCD = x_cd_BCD.reshape(G, -1, *x_cd_BCD.shape[1:])
    d_logits_GBCV = d_logits_BCV.reshape(G, -1, *d_logits_BCV.shape[1:])
    d_head_GDV = d_head_GDV + jax.lax.dot_general(x_cd_GBCD, d_logits_GBCV, (((1, 2), (1, 2)), ((0,), (0,))),
                                                  preferred_element_type=jnp.float32)
    return d_head_GDV, d_x_BCD

  # Padded positions get zero cotangents, so they add nothing to d head.
  chunks = tuple(_to_chunks(a, C) for a in (x_BTD, targets_BT, log_z_BT, g_ce_BT.astype(jnp.float32),
                                             g_z_BT.astype(jnp.float32)))
  # Zeros with the inputs' varying manual axes (the loss head inside a pipeline schedule's shard_map,
  # sharding/schedules.py), as the carry out has them; zeros_like keeps them and XLA folds the adds.
  zero = jnp.zeros_like(head_DV[:1, :1], jnp.float32) + jnp.zeros_like(x_BTD[:1, :1, :1], jnp.float32)[0]
  d_head_GDV, d_x_KBCD = jax.lax.scan(body, jnp.zeros((G, D, V), jnp.float32) + zero, chunks)
  # Resharded from G (one partial sum per batch shard) to the parameter's layout, then summed locally:
  # a reduce-scatter as an all-to-all. A plain sum over G was an all-reduce of the whole fp32 [D, V]
  # on every device (then sliced to the parameter's shard) wherever XLA does not rewrite that into a
  # reduce-scatter (XLA:CPU, hence the AOT memory figures).
  d_head_GDV = parallel.constrain(d_head_GDV, (None, *HEAD_AXES))
  d_head_DV = parallel.constrain(jnp.sum(d_head_GDV, axis=0), HEAD_AXES)
  return _from_chunks(d_x_KBCD, T), d_head_DV.astype(head_DV.dtype), None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
