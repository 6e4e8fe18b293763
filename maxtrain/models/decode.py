"""The model with a key/value cache: prefill a prompt, then one token at a time.

Shape legend: B batch, T new tokens, S cache length, L layers, D model, N heads, K kv heads, H head dim,
V vocab.

Prompts of different lengths are left-padded to one length: slot s of row b holds a real token iff
`valid_BS[b, s]`, and a token's RoPE position counts only the real tokens before it, so every row
computes what it would alone. Checked against the full forward pass (`Llama.__call__`) at every
position (tests/test_generate.py). Layers are scanned with their cache slices like training's scan.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.models.layers import apply_rope
from maxtrain.models.llama import Llama
from maxtrain.sharding import rules as sharding_rules


class KVCache(NamedTuple):
  k_LBSKH: jax.Array
  v_LBSKH: jax.Array
  valid_BS: jax.Array  # bool: the slot holds a real (not padding) token


def init_cache(model: Llama, batch: int, length: int) -> KVCache:
  cfg = model.cfg
  shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
  zeros = jnp.zeros(shape, cfg.compute_dtype)
  return KVCache(zeros, zeros, jnp.zeros((batch, length), jnp.bool_))


def cached_attention(q_BTNH, k_BSKH, v_BSKH, valid_BS, start) -> jax.Array:
  """Query t (cache slot start + t) sees the valid slots s <= start + t."""
  b, t, n, h = q_BTNH.shape
  s, k = k_BSKH.shape[1], k_BSKH.shape[2]
  q_BTKGH = q_BTNH.reshape(b, t, k, n // k, h)
  scores_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH).astype(jnp.float32) * h**-0.5
  causal_TS = (start + jnp.arange(t))[:, None] >= jnp.arange(s)[None, :]
  mask_B11TS = (causal_TS[None] & valid_BS[:, None, :])[:, None, None]
  scores_BKGTS = jnp.where(mask_B11TS, scores_BKGTS, jnp.finfo(jnp.float32).min)
  probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(v_BSKH.dtype)
  return jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS, v_BSKH).reshape(b, t, n, h)


def _block(block, x_BTD, positions_BT, k_BSKH, v_BSKH, valid_BS, start, rope):
  attn, dt = block.attn, block.attn.compute_dtype
  h_BTD = block.attn_norm(x_BTD)
  q_BTNH = apply_rope(jnp.einsum("btd,dnh->btnh", h_BTD, attn.wq[...].astype(dt)), positions_BT, rope)
  k_BTKH = apply_rope(jnp.einsum("btd,dkh->btkh", h_BTD, attn.wk[...].astype(dt)), positions_BT, rope)
  v_BTKH = jnp.einsum("btd,dkh->btkh", h_BTD, attn.wv[...].astype(dt))
  k_BSKH = jax.lax.dynamic_update_slice_in_dim(k_BSKH, k_BTKH.astype(k_BSKH.dtype), start, axis=1)
  v_BSKH = jax.lax.dynamic_update_slice_in_dim(v_BSKH, v_BTKH.astype(v_BSKH.dtype), start, axis=1)
  k_BSKH = sharding_rules.constrain(k_BSKH, ("act_batch", None, "act_kv_heads", None))
  v_BSKH = sharding_rules.constrain(v_BSKH, ("act_batch", None, "act_kv_heads", None))
  out_BTNH = cached_attention(q_BTNH, k_BSKH, v_BSKH, valid_BS, start)
  x_BTD = x_BTD + jnp.einsum("btnh,nhd->btd", out_BTNH, attn.wo[...].astype(dt))
  x_BTD = x_BTD + block.mlp(block.mlp_norm(x_BTD))
  return x_BTD, k_BSKH, v_BSKH


def forward(model: Llama, tokens_BT: jax.Array, valid_BT: jax.Array, cache: KVCache,
            start: jax.Array) -> tuple[jax.Array, KVCache]:
  """fp32 logits [B, T, V] of `tokens_BT` written at cache slots start..start+T-1, and the new cache."""
  cfg = model.cfg
  valid_BS = jax.lax.dynamic_update_slice_in_dim(cache.valid_BS, valid_BT, start, axis=1)
  # Position = real tokens before this one (left padding does not count).
  positions_BT = jnp.cumsum(valid_BS, axis=1)[:, :] - 1
  positions_BT = jax.lax.dynamic_slice_in_dim(positions_BT, start, tokens_BT.shape[1], axis=1)
  x_BTD = model.embed[...].astype(cfg.compute_dtype)[tokens_BT]
  args = (positions_BT, valid_BS, start, cfg.rope)
  if cfg.scan_layers:
    graphdef, stacked = nnx.split(model.blocks)

    def layer(x_BTD, xs):
      block_state, k_BSKH, v_BSKH = xs
      x_BTD, k_BSKH, v_BSKH = _block(nnx.merge(graphdef, block_state), x_BTD, args[0], k_BSKH, v_BSKH, *args[1:])
      return x_BTD, (k_BSKH, v_BSKH)

    x_BTD, (k_LBSKH, v_LBSKH) = jax.lax.scan(layer, x_BTD, (stacked, cache.k_LBSKH, cache.v_LBSKH))
  else:
    ks, vs = [], []
    for i, block in enumerate(model.blocks):
      x_BTD, k_BSKH, v_BSKH = _block(block, x_BTD, args[0], cache.k_LBSKH[i], cache.v_LBSKH[i], *args[1:])
      ks, vs = ks + [k_BSKH], vs + [v_BSKH]
    k_LBSKH, v_LBSKH = jnp.stack(ks), jnp.stack(vs)
  x_BTD = model.final_norm(x_BTD)
  logits_BTV = jnp.einsum("btd,dv->btv", x_BTD, model.head_weights().astype(cfg.compute_dtype),
                          preferred_element_type=jnp.float32)
  return logits_BTV, KVCache(k_LBSKH, v_LBSKH, valid_BS)
