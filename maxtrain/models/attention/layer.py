"""Grouped-query attention with causal and document (segment) masking.

Shape legend: B batch, T query length, S key length, D model, N query heads, K kv heads,
G = N // K query heads per kv head, H head dim.

Kernels behind one signature (q, k, v, segment ids), chosen by `model.attention`:
  dot    `dot_product_attention`: plain einsums over the full [T, S] scores. It compiles on every
         backend and is the reference the other kernels are checked against.
  flash  `flash_attention.flash_attention`: blockwise, online softmax, recomputing backward; memory
         linear in T. Measured faster than `dot` on CPU at every length tried (1.5x at T=256, 6.5x
         at 4096; BENCHMARKS.md), so `auto` picks it, except for short sequences on CPU:
  blocked `blocked_attention.blocked_attention`: a few query blocks over their key prefix, exact
         softmax, probabilities kept for the backward; memory O(T^2). 1.3-1.5x flash on CPU for
         T <= 1024, so `auto` picks it for those lengths.
  cudnn  `vendor_attention.cudnn_attention`: jax.nn.dot_product_attention on cuDNN (NVIDIA GPUs, bf16/fp16).
         `auto` picks it when a GPU runs the program in bf16 (3.5x flash on one H200; BENCHMARKS.md).
  nki    `vendor_attention.nki_attention`: the Neuron NKI flash kernels (Trainium, jax-neuronx); it has not
         run on this project's machines (see that module).
When the model's sharding rules (its `parallel`: sharding/rules.py Parallel) split the sequence over devices
(mesh.context > 1), attention runs as `sharding/context_attention.py` (flash on each shard against all-gathered
keys) whatever the kernel: it needs per-token positions and a block-pair list, which only the flash core takes.
Every kernel asks `mask.py` which keys a query sees and fills the rest with its one MASK_VALUE.

With a KV cache (generation: `Decoder.decode`) the same module writes this call's keys and values into
the cache's slots; a prefill (nothing cached yet) runs the kernel above on the prompt alone, later
calls (one token each) the dot path against the whole cache under `mask.visible` (slot order,
valid slots only): one query row needs no blocking.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.models.attention import mask as mask_lib
from maxtrain.models.attention import vendor as vendor_attention
from maxtrain.models.attention.blocked import blocked_attention
from maxtrain.models.attention.flash import flash_attention, flash_attention_qkv
from maxtrain.models.layers import RMSNorm, apply_rope, param, project
from maxtrain.sharding import context_attention
from maxtrain.sharding.rules import NONE, Parallel


KERNELS = ("dot", "flash", "blocked", "cudnn", "nki")
CHOICES = ("auto",) + KERNELS
# Longest sequence for which `auto` picks `blocked`: measured faster than flash up to here (on CPU), and
# its kept probabilities (O(T^2)) stay small next to the rest of the step.
BLOCKED_MAX_LEN = 1024


def resolve_kernel(name: str, seq_len: int, *, backend: str = "", dtype=None, head_dim: int = 128,
                   window: int = 0) -> str:
  """`auto` -> the kernel measured best: on a GPU backend in bf16/fp16, `cudnn` (one H200, LLaMA 3 8B widths at
  8192 tokens: 3.5x the step rate of `flash`, whose 128 x 128 blocks are thousands of small launches there;
  BENCHMARKS.md); elsewhere `blocked` up to BLOCKED_MAX_LEN, else flash (measured on CPU). cuDNN has no fp32
  attention and wants head dims in multiples of 8 (128 is what ran); a sliding window runs as cuDNN's own
  (tools/gpu_attention_check.py checks it). `backend` is the backend that runs the program (jax.default_backend()),
  so an ahead-of-time compile on XLA:CPU for a GPU target traces flash, whose memory is linear in T as
  cuDNN's is; `nki` has not run, so `auto` never picks it."""
  if name != "auto":
    return name
  half = dtype is not None and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
  if backend == "gpu" and half and head_dim % 8 == 0 and head_dim <= 128:
    return "cudnn"
  return "blocked" if seq_len <= BLOCKED_MAX_LEN else "flash"


def attention_mask(segment_ids_BT: jax.Array) -> jax.Array:
  """[B, T, S] boolean: key s is visible from query t iff s <= t and both are in one document."""
  return mask_lib.causal_self(segment_ids_BT)


def softcap(x: jax.Array, cap: float) -> jax.Array:
  """Gemma 2's logit soft-capping: cap * tanh(x / cap), smooth and bounded by +-cap (0: x unchanged)."""
  return cap * jnp.tanh(x / cap) if cap else x


def dot_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, visible_BTS: jax.Array,
                  sinks_N: jax.Array | None = None, logit_cap: float = 0.0) -> jax.Array:
  """Plain einsum attention under any mask from `mask.visible` ([B or 1, T, S]); `sinks_N` ([N] logits, GPT-OSS):
  one more softmax column per head with no value, dropped after the softmax; `logit_cap` (Gemma 2's
  `model.attn_logit_softcap`): the scaled scores soft-capped before the mask."""
  b, t, n, h = q_BTNH.shape
  k = k_BSKH.shape[2]
  q_BTKGH = q_BTNH.reshape(b, t, k, n // k, h)
  scores_BKGTS = softcap(jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH).astype(jnp.float32) * h**-0.5, logit_cap)
  scores_BKGTS = mask_lib.apply(scores_BKGTS, visible_BTS[:, None, None])
  if sinks_N is not None:
    sink_BKGT1 = jnp.broadcast_to(sinks_N.astype(jnp.float32).reshape(1, k, n // k, 1, 1), (*scores_BKGTS.shape[:-1], 1))
    probs_BKGTS = jax.nn.softmax(jnp.concatenate([scores_BKGTS, sink_BKGT1], axis=-1), axis=-1)[..., :-1]
    probs_BKGTS = probs_BKGTS.astype(v_BSKH.dtype)
  else:
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(v_BSKH.dtype)
  out_BTKGH = jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS, v_BSKH)
  return out_BTKGH.reshape(b, t, n, h)


def dot_product_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                          segment_ids_BT: jax.Array, window: int = 0, sinks_N: jax.Array | None = None,
                          logit_cap: float = 0.0) -> jax.Array:
  """The reference kernel: causal self-attention with document masking (and a sliding window: 0 off)."""
  return dot_attention(q_BTNH, k_BSKH, v_BSKH, mask_lib.causal_self(segment_ids_BT, window), sinks_N, logit_cap)


class KVCache(NamedTuple):
  """One layer's keys and values at S cache slots (a scanned stack holds them stacked: [L, B, S, K, H])."""
  k_BSKH: jax.Array
  v_BSKH: jax.Array


@dataclasses.dataclass(frozen=True)
class CacheWrite:
  """What every layer shares in one call over the cache: this call's T tokens go to slots start..start+T-1."""
  valid_BS: jax.Array  # bool: the slot holds a real token (this call's included; left padding does not)
  start: jax.Array  # int32 []
  # The cache held nothing before this call (a prefill): the prompt attends only to itself, so it runs the
  # run's own kernel (its padding as segment 0); later calls attend to the cache through the dot path.
  fresh: bool


class Attention(nnx.Module):
  """Pieces (each optional, any family): `head_dim` (default d_model / num_heads), q/k/v biases
  (`qkv_bias`, Qwen2), per-head RMSNorm of q and k before RoPE (`qk_norm_eps` not None, Qwen3; Gemma 3's
  (1 + w) norm with `qk_norm_one_plus`), and a
  sliding `window` (a query sees the `window` latest keys, itself included; 0: all, Mistral), Gemma 2's
  `query_pre_attn_scalar` (scores scaled by its -1/2 power instead of head_dim's: q is multiplied by
  sqrt(head_dim / it), so every kernel keeps its own head_dim^-1/2) and `logit_cap` (attention-score
  soft-capping: the dot and flash kernels and decoding; validate refuses the others, `auto` runs flash where it
  would pick blocked or cudnn)."""

  def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, *, rope_theta: float,
               init_std: float, out_std: float, param_dtype, compute_dtype, kernel: str = "dot",
               block_q: int = 128, block_kv: int = 128, rngs: nnx.Rngs, quant=None, head_dim: int | None = None,
               qkv_bias: bool = False, qk_norm_eps: float | None = None, window: int = 0, sinks: bool = False,
               o_bias: bool = False, query_pre_attn_scalar: float = 0.0, logit_cap: float = 0.0,
               qk_norm_one_plus: bool = False, parallel: Parallel = NONE):
    head_dim = head_dim or d_model // num_heads
    self.q_mult = (head_dim / query_pre_attn_scalar) ** 0.5 if query_pre_attn_scalar else 1.0
    self.logit_cap = logit_cap
    init, out_init = nnx.initializers.normal(init_std), nnx.initializers.normal(out_std)
    self.wq = param(rngs, init, (d_model, num_heads, head_dim), ("embed", "heads", "head_dim"), param_dtype)
    self.wk = param(rngs, init, (d_model, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), param_dtype)
    self.wv = param(rngs, init, (d_model, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), param_dtype)
    self.wo = param(rngs, out_init, (num_heads, head_dim, d_model), ("heads", "head_dim", "embed"), param_dtype)
    self.qkv_bias = qkv_bias
    if qkv_bias:
      zeros = nnx.initializers.zeros
      self.bq = param(rngs, zeros, (num_heads, head_dim), ("heads", "head_dim"), param_dtype)
      self.bk = param(rngs, zeros, (num_kv_heads, head_dim), ("kv_heads", "head_dim"), param_dtype)
      self.bv = param(rngs, zeros, (num_kv_heads, head_dim), ("kv_heads", "head_dim"), param_dtype)
    self.o_bias, self.has_sinks = o_bias, sinks
    if o_bias:  # GPT-OSS: the output projection's bias too
      self.bo = param(rngs, nnx.initializers.zeros, (d_model,), ("embed",), param_dtype)
    if sinks:  # GPT-OSS: a learned softmax-normaliser logit per head (the kernels' sinks_N)
      self.sinks = param(rngs, nnx.initializers.zeros, (num_heads,), ("heads",), param_dtype)
    self.qk_norm = qk_norm_eps is not None
    if self.qk_norm:
      self.q_norm = RMSNorm(head_dim, eps=qk_norm_eps, param_dtype=param_dtype, rngs=rngs, one_plus=qk_norm_one_plus)
      self.k_norm = RMSNorm(head_dim, eps=qk_norm_eps, param_dtype=param_dtype, rngs=rngs, one_plus=qk_norm_one_plus)
    self.rope_theta = rope_theta
    self.compute_dtype = compute_dtype
    self.quant = quant  # models/quant.py Quant of the projections, or None
    self.kernel, self.block_q, self.block_kv, self.window = kernel, block_q, block_kv, window
    self.parallel = parallel  # the builder's layout (static): the rules `constrain` and context attention read

  def _project_qkv(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [B, T, N, H], k and v [B, T, K, H], with their biases and qk-norm (before RoPE)."""
    dt = self.compute_dtype
    q_BTNH = project(x_BTD, self.wq[...].astype(dt), quant=self.quant)
    k_BTKH = project(x_BTD, self.wk[...].astype(dt), quant=self.quant)
    v_BTKH = project(x_BTD, self.wv[...].astype(dt), quant=self.quant)
    if self.qkv_bias:
      q_BTNH, k_BTKH, v_BTKH = (x + b[...].astype(dt) for x, b in ((q_BTNH, self.bq), (k_BTKH, self.bk),
                                                                   (v_BTKH, self.bv)))
    if self.qk_norm:
      q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
    return q_BTNH, k_BTKH, v_BTKH

  def __call__(self, x_BTD: jax.Array, segment_ids_BT: jax.Array, positions_BT: jax.Array,
               cache: KVCache | None = None, write: CacheWrite | None = None) -> tuple[jax.Array, KVCache | None]:
    """(output [B, T, D], this layer's cache with the call's keys and values written, or None without one).
    Training passes no cache; generation (inference/sampling.py) a prefill, then one token per call."""
    dt = self.compute_dtype
    q_BTNH, k_BTKH, v_BTKH = self._project_qkv(x_BTD)
    q_BTNH = apply_rope(q_BTNH, positions_BT, self.rope_theta)
    if self.q_mult != 1.0:  # query_pre_attn_scalar: the kernels scale by head_dim^-1/2, this makes it scalar^-1/2
      q_BTNH = q_BTNH * jnp.asarray(self.q_mult, q_BTNH.dtype)
    q_BTNH = self.parallel.constrain(q_BTNH, ("act_batch", "act_length", "act_heads", None))
    k_BTKH = self.parallel.constrain(apply_rope(k_BTKH, positions_BT, self.rope_theta),
                                      ("act_batch", "act_length", "act_kv_heads", None))
    v_BTKH = self.parallel.constrain(v_BTKH, ("act_batch", "act_length", "act_kv_heads", None))
    if cache is None:
      out_BTNH = self._attend(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, positions_BT)
    else:
      out_BTNH, cache = self._attend_cached(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, cache, write)
    y_BTD = project(out_BTNH, self.wo[...].astype(dt), contract=2, quant=self.quant)
    if self.o_bias:
      y_BTD = y_BTD + self.bo[...].astype(dt)
    return y_BTD, cache

  def _sinks(self) -> jax.Array | None:
    return self.sinks[...] if self.has_sinks else None

  def _attend_cached(self, q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, cache: KVCache,
                     write: CacheWrite) -> tuple[jax.Array, KVCache]:
    if cache.k_BSKH.shape[1] < write.valid_BS.shape[1]:  # a window layer's ring of window-many slots
      return self._attend_ring(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, cache, write)
    kv_logical = ("act_batch", None, "act_kv_heads", None)
    put = lambda c_BSKH, x_BTKH: self.parallel.constrain(
        jax.lax.dynamic_update_slice_in_dim(c_BSKH, x_BTKH.astype(c_BSKH.dtype), write.start, axis=1), kv_logical)
    cache = KVCache(put(cache.k_BSKH, k_BTKH), put(cache.v_BSKH, v_BTKH))
    if write.fresh:
      return self._attend(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, None), cache
    # Slot indices order the cache (left padding and unwritten slots are not valid).
    t, s = q_BTNH.shape[1], cache.k_BSKH.shape[1]
    visible_BTS = mask_lib.visible(q_positions_BT=(write.start + jnp.arange(t, dtype=jnp.int32))[None],
                                   kv_positions_BS=jnp.arange(s, dtype=jnp.int32)[None], kv_valid_BS=write.valid_BS)
    if self.window:  # by token positions (real tokens before), not slots: left padding is not in the window
      tokens_BS = jnp.cumsum(write.valid_BS, axis=1, dtype=jnp.int32)
      q_tokens_BT = jax.lax.dynamic_slice_in_dim(tokens_BS, write.start, t, axis=1)
      visible_BTS = visible_BTS & mask_lib.in_window(q_tokens_BT, tokens_BS, self.window)
    return dot_attention(q_BTNH, cache.k_BSKH.astype(q_BTNH.dtype), cache.v_BSKH.astype(q_BTNH.dtype),
                         visible_BTS, self._sinks(), self.logit_cap), cache

  def _attend_ring(self, q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, cache: KVCache,
                   write: CacheWrite) -> tuple[jax.Array, KVCache]:
    """A window layer's cache as a ring of R = window slots (decode memory window-sized, not sequence-sized):
    slot i of the sequence lives in ring entry i mod R. A call keeps only its last R tokens (the only ones a
    later query can see); after the prefill, one token per call (older keys a second one would need are gone)."""
    kv_logical = ("act_batch", None, "act_kv_heads", None)
    r, s, t = cache.k_BSKH.shape[1], write.valid_BS.shape[1], q_BTNH.shape[1]
    keep = min(t, r)
    entries = (write.start + t - keep + jnp.arange(keep, dtype=jnp.int32)) % r
    put = lambda c_BRKH, x_BTKH: self.parallel.constrain(
        c_BRKH.at[:, entries].set(x_BTKH[:, t - keep:].astype(c_BRKH.dtype)), kv_logical)
    cache = KVCache(put(cache.k_BSKH, k_BTKH), put(cache.v_BSKH, v_BTKH))
    if write.fresh:
      return self._attend(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, None), cache
    assert t == 1, f"a ring cache takes one token per call after the prefill, got {t}"
    end = write.start + t
    slot_R = end - 1 - (end - 1 - jnp.arange(r, dtype=jnp.int32)) % r  # the newest slot each entry holds (< 0: none)
    index_R = jnp.clip(slot_R, 0, s - 1)
    tokens_BS = jnp.cumsum(write.valid_BS, axis=1, dtype=jnp.int32)
    visible_BTR = mask_lib.visible(q_positions_BT=(write.start + jnp.arange(t, dtype=jnp.int32))[None],
                                   kv_positions_BS=slot_R[None],
                                   kv_valid_BS=jnp.take(write.valid_BS, index_R, axis=1) & (slot_R >= 0)[None])
    q_tokens_BT = jax.lax.dynamic_slice_in_dim(tokens_BS, write.start, t, axis=1)
    visible_BTR = visible_BTR & mask_lib.in_window(q_tokens_BT, jnp.take(tokens_BS, index_R, axis=1), self.window)
    return dot_attention(q_BTNH, cache.k_BSKH.astype(q_BTNH.dtype), cache.v_BSKH.astype(q_BTNH.dtype),
                         visible_BTR, self._sinks(), self.logit_cap), cache

  def _attend(self, q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, positions_BT) -> jax.Array:
    # Under context parallelism the window is a mask on explicit per-document positions (every causal block
    # pair is visited: correct, but the work does not shrink with the window there).
    context_parallel = context_attention.for_rules(
        self.parallel.rules, functools.partial(flash_attention_qkv, window=self.window, logit_cap=self.logit_cap),
        block_q=self.block_q, block_kv=self.block_kv)
    # No positions: a prefill's prompt, in natural (not zigzag) order, attends whole on every device.
    if context_parallel is not None and positions_BT is not None:  # the sequence is split over devices
      if self.has_sinks:
        raise ValueError("attention sinks under context parallelism (mesh.context > 1) are not supported")
      return context_parallel(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, positions_BT)
    kernel, w = resolve_kernel(self.kernel, q_BTNH.shape[1], backend=jax.default_backend(), dtype=q_BTNH.dtype,
                               head_dim=q_BTNH.shape[3], window=self.window), self.window
    if kernel in ("blocked", "cudnn") and (self.has_sinks or self.logit_cap):  # `auto`'s choice lacks them; flash
      kernel = "flash"  # has both (validate refused an explicit other kernel)
    if kernel == "flash":
      return flash_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, block_q=self.block_q, block_kv=self.block_kv,
                             window=w, sinks_N=self._sinks(), logit_cap=self.logit_cap)
    if kernel == "blocked":
      return blocked_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, window=w)
    if kernel == "cudnn":
      return vendor_attention.cudnn_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, window=w)
    if kernel == "nki":
      return vendor_attention.nki_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT)
    return dot_product_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, window=w, sinks_N=self._sinks(),
                                 logit_cap=self.logit_cap)
