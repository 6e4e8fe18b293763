"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2; `model.mla.*`): queries and keys/values through
low-rank latents, and a decoupled RoPE head.

  q  = (RMSNorm(x @ wq_a) @ wq_b)            [N, nope + rope]   (x @ wq without q_lora_rank)
  c, k_rope = split(x @ wkv_a)               c: the kv latent [kv_lora_rank], k_rope: one shared RoPE head
  k_nope, v = split(RMSNorm(c) @ wkv_b)      [N, nope] and [N, v_head_dim]
  k = [k_nope, RoPE(k_rope) for every head], q = [q_nope, RoPE(q_rope)]
  softmax scale: (nope + rope)^-1/2 x mscale^2 (YaRN's mscale_all_dim: model.mla.softmax_mscale)

The RoPE head is Hugging Face DeepSeek's interleaved layout (pairs (0, 1), (2, 3), ...): its dims are
de-interleaved before maxtrain's rotate-half RoPE, the same permutation for q and k, so q.k is unchanged.
The kernels take q, k, v of one head width: v is padded with zeros to it (and the output cut back).
Decoding caches the expanded k and v ([N, nope + rope] each per token per layer), or with
`model.mla.latent_cache` only the normalised kv latent and the RoPE key (kv_lora_rank + rope_head_dim values
per token per layer), the up-projections absorbed into the query and the output:
  scores = (q_nope W_uk) . c + q_rope . k_rope,  out = (p @ c) W_uv  (W_uk, W_uv: wkv_b's two halves).

Shape legend: B batch, T length, D model, N heads, R latent rank, H head width.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.config.keys import check_known
from maxtrain.errors import require
from maxtrain.models.attention import mask as mask_lib
from maxtrain.models.attention.layer import Attention, KVCache
from maxtrain.models.layers import RMSNorm, apply_rope, param, project
from maxtrain.sharding.rules import NONE, Parallel


@dataclasses.dataclass(frozen=True)
class MLAConfig:
  kv_lora_rank: int = 0  # 0: MLA off (the decoder's GQA)
  q_lora_rank: int = 0  # 0: q straight from x (DeepSeek-V2-Lite)
  rope_head_dim: int = 64
  nope_head_dim: int = 128
  v_head_dim: int = 128
  rope_interleave: bool = True  # HF DeepSeek's layout of the RoPE head's dims
  softmax_mscale: float = 1.0  # YaRN's mscale_all_dim factor: the softmax scale times its square
  latent_cache: bool = False  # decode from the compressed cache: kv_lora_rank + rope_head_dim values per token

  @property
  def enabled(self) -> bool:
    return self.kv_lora_rank > 0

  @property
  def qk_head_dim(self) -> int:
    return self.nope_head_dim + self.rope_head_dim

  @property
  def head_dim(self) -> int:
    """The width the kernels and the decode cache see: q and k's, v padded to it (or q and k to v's)."""
    return max(self.qk_head_dim, self.v_head_dim)

  @classmethod
  def from_config(cls, c: Any) -> "MLAConfig":
    check_known(c, "model.mla")  # a UserError naming the key, not a TypeError
    return cls(**dict(c.items()))


def validate(m: Any) -> None:
  c = m.get("mla")
  if c is None or not c.kv_lora_rank:
    return
  for key in ("kv_lora_rank", "rope_head_dim", "nope_head_dim", "v_head_dim", "softmax_mscale"):
    require(c[key] > 0, f"config.model.mla.{key}={c[key]}: must be > 0")
  require(c.q_lora_rank >= 0, f"config.model.mla.q_lora_rank={c.q_lora_rank}: must be >= 0 (0: no q latent)")
  require(c.rope_head_dim % 2 == 0, f"config.model.mla.rope_head_dim={c.rope_head_dim} must be even for RoPE")
  require(not m.sliding_window and not m.get("attention_sinks") and not m.qkv_bias and not m.qk_norm,
          "config.model.mla.kv_lora_rank > 0: multi-head latent attention has no sliding_window, attention_sinks, "
          "qkv_bias or qk_norm")


class MLAttention(nnx.Module):
  """Attention's interface (models/attention/layer.py Attention): (x, segment ids, positions, cache, write);
  its kernels, cache writes and masks are Attention's own (no window, no sinks)."""
  _attend = Attention._attend
  _attend_cached = Attention._attend_cached
  _sinks = Attention._sinks
  logit_cap = 0.0  # Attention's soft-cap: off (validate refuses model.attn_logit_softcap with MLA)

  def __init__(self, d_model: int, num_heads: int, c: MLAConfig, *, rope, norm_eps: float, init_std: float,
               out_std: float, param_dtype, compute_dtype, kernel: str, block_q: int, block_kv: int, rngs: nnx.Rngs,
               parallel: Parallel = NONE):
    init, out_init = nnx.initializers.normal(init_std), nnx.initializers.normal(out_std)
    n = num_heads
    self.c, self.rope, self.compute_dtype, self.parallel = c, rope, compute_dtype, parallel
    self.kernel, self.block_q, self.block_kv, self.window, self.has_sinks = kernel, block_q, block_kv, 0, False
    if c.q_lora_rank:
      self.wq_a = param(rngs, init, (d_model, c.q_lora_rank), ("embed", "lora"), param_dtype)
      self.q_a_norm = RMSNorm(c.q_lora_rank, eps=norm_eps, param_dtype=param_dtype, rngs=rngs)
      self.wq_b = param(rngs, init, (c.q_lora_rank, n, c.qk_head_dim), ("lora_in", "heads", "head_dim"), param_dtype)
    else:
      self.wq = param(rngs, init, (d_model, n, c.qk_head_dim), ("embed", "heads", "head_dim"), param_dtype)
    self.wkv_a = param(rngs, init, (d_model, c.kv_lora_rank + c.rope_head_dim), ("embed", "lora"), param_dtype)
    self.kv_a_norm = RMSNorm(c.kv_lora_rank, eps=norm_eps, param_dtype=param_dtype, rngs=rngs)
    self.wkv_b = param(rngs, init, (c.kv_lora_rank, n, c.nope_head_dim + c.v_head_dim), ("lora_in", "heads", "head_dim"),
                       param_dtype)
    self.wo = param(rngs, out_init, (n, c.v_head_dim, d_model), ("heads", "head_dim", "embed"), param_dtype)

  def _rope(self, x: jax.Array, positions_BT: jax.Array) -> jax.Array:
    if self.c.rope_interleave:  # pairs (0, 1), (2, 3), ... -> rotate-half's (i, i + H/2)
      x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return apply_rope(x, positions_BT, self.rope)

  def _absorbed(self, q_nope_BTNH, q_rope_BTNH, cache: KVCache, write) -> jax.Array:
    """Attention over the latent cache with wkv_b absorbed: [B, T, N, v_head_dim] (fp32 scores)."""
    c, f32 = self.c, jnp.float32
    wkv_b = self.wkv_b[...].astype(f32)
    latent_BSR, k_rope_BSH = cache.k_BSKH[:, :, 0].astype(f32), cache.v_BSKH[:, :, 0].astype(f32)
    q_lat_BTNR = jnp.einsum("btnh,rnh->btnr", q_nope_BTNH.astype(f32), wkv_b[..., :c.nope_head_dim])
    scores_BNTS = (jnp.einsum("btnr,bsr->bnts", q_lat_BTNR, latent_BSR)
                   + jnp.einsum("btnh,bsh->bnts", q_rope_BTNH.astype(f32), k_rope_BSH))
    scores_BNTS = scores_BNTS * (c.qk_head_dim ** -0.5 * c.softmax_mscale ** 2)
    t, s = q_nope_BTNH.shape[1], latent_BSR.shape[1]
    visible_BTS = mask_lib.visible(q_positions_BT=(write.start + jnp.arange(t, dtype=jnp.int32))[None],
                                   kv_positions_BS=jnp.arange(s, dtype=jnp.int32)[None], kv_valid_BS=write.valid_BS)
    probs_BNTS = jax.nn.softmax(mask_lib.apply(scores_BNTS, visible_BTS[:, None]), axis=-1)
    out_BTNR = jnp.einsum("bnts,bsr->btnr", probs_BNTS, latent_BSR)
    return jnp.einsum("btnr,rnh->btnh", out_BTNR, wkv_b[..., c.nope_head_dim:])

  def __call__(self, x_BTD, segment_ids_BT, positions_BT, cache=None, write=None):
    c, dt = self.c, self.compute_dtype
    b, t, _ = x_BTD.shape
    if c.q_lora_rank:
      q_BTNH = project(self.q_a_norm(project(x_BTD, self.wq_a[...].astype(dt))), self.wq_b[...].astype(dt))
    else:
      q_BTNH = project(x_BTD, self.wq[...].astype(dt))
    n = q_BTNH.shape[2]
    kv_BTR = project(x_BTD, self.wkv_a[...].astype(dt))
    latent_BTR, k_rope_BTH = kv_BTR[..., :c.kv_lora_rank], kv_BTR[..., c.kv_lora_rank:]
    kv_BTNH = project(self.kv_a_norm(latent_BTR), self.wkv_b[...].astype(dt))
    k_nope_BTNH, v_BTNH = kv_BTNH[..., :c.nope_head_dim], kv_BTNH[..., c.nope_head_dim:]
    q_rope_BTNH = self._rope(q_BTNH[..., c.nope_head_dim:], positions_BT)
    k_rope_BT1H = self._rope(k_rope_BTH[:, :, None, :], positions_BT)
    if cache is not None and c.latent_cache:
      latent_BT1R = self.kv_a_norm(latent_BTR)[:, :, None, :]
      put = lambda c_BS1X, x_BT1X: jax.lax.dynamic_update_slice_in_dim(c_BS1X, x_BT1X.astype(c_BS1X.dtype), write.start,
                                                                       axis=1)
      cache = KVCache(put(cache.k_BSKH, latent_BT1R), put(cache.v_BSKH, k_rope_BT1H))
      if not write.fresh:  # a prefill attends to itself below, as without the latent cache
        out_BTNH = self._absorbed(q_BTNH[..., :c.nope_head_dim], q_rope_BTNH, cache, write)
        return project(out_BTNH.astype(dt), self.wo[...].astype(dt), contract=2), cache
    q_BTNH = jnp.concatenate([q_BTNH[..., :c.nope_head_dim], q_rope_BTNH], axis=-1)
    k_BTNH = jnp.concatenate([k_nope_BTNH, jnp.broadcast_to(k_rope_BT1H, (b, t, n, c.rope_head_dim)).astype(dt)],
                             axis=-1)
    # One width for the kernels: pad with zeros (no change to q.k or to the output); the kernels' scale is
    # width^-1/2, so q carries the rest of (nope + rope)^-1/2 x mscale^2.
    h = c.head_dim
    pad = lambda a: jnp.pad(a, [(0, 0)] * 3 + [(0, h - a.shape[-1])]) if a.shape[-1] < h else a
    q_BTNH = pad(q_BTNH) * jnp.asarray((h / c.qk_head_dim) ** 0.5 * c.softmax_mscale ** 2, dt)
    k_BTNH, v_BTNH = pad(k_BTNH).astype(dt), pad(v_BTNH)
    q_BTNH = self.parallel.constrain(q_BTNH, ("act_batch", "act_length", "act_heads", None))
    if cache is None:
      out_BTNH = self._attend(q_BTNH, k_BTNH, v_BTNH, segment_ids_BT, positions_BT)
    else:
      if c.latent_cache:  # the prefill: its own tokens only (the latents are written above)
        out_BTNH = self._attend(q_BTNH, k_BTNH, v_BTNH, segment_ids_BT, None)
      else:
        out_BTNH, cache = self._attend_cached(q_BTNH, k_BTNH, v_BTNH, segment_ids_BT, cache, write)
    return project(out_BTNH[..., :c.v_head_dim], self.wo[...].astype(dt), contract=2), cache
