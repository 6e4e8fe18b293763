"""Vendor attention kernels behind the reference's signature (q, k, v, segment ids): `cudnn` (NVIDIA
GPUs) and `nki` (AWS Trainium). `cudnn` ran on one H200 (jax 0.11.2): its masking matches the einsum
kernel to bf16's own error there (`tools/gpu_attention_check.py`), and it is 3.5x the flash kernel's step rate
(BENCHMARKS.md). `nki` has never run: it is written against the documented API. The CPU tests check selection,
the refusals, and (for cudnn) the mask it passes, through JAX's XLA implementation of the same call.

Shape legend: B batch, T query length, S key length, N query heads, K kv heads, H head dim.

Packed documents (several per row, `segment_ids`) are masked, never attended across:
  cudnn  `jax.nn.dot_product_attention(..., implementation="cudnn", is_causal=True, mask=same_doc)`:
         cuDNN skips the causal upper triangle and applies the same-document mask, which JAX turns
         into an additive bias of B x 1 x T x S in the input dtype (128 MiB per 8192-token bf16
         sequence, shared by all heads; 2 GiB at 32768). A sliding window is cuDNN's own
         (`local_window_size`). The packed-sequence layout of cuDNN
         (segment offsets) is not public JAX API in jax 0.10, so it is not used.
  nki    the Neuron flash kernels `flash_fwd` / `flash_attn_bwd` (neuronxcc.nki.kernels.attention)
         take documents only as a logit bias of B x N x T x S: memory quadratic in T again. Use it to
         compare against `flash` on Trainium, not for long sequences.
Anything unavailable is a UserError (exit 2) naming what to install or choose instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtrain.errors import UserError
from maxtrain.models.attention import mask as mask_lib


def same_document(segment_ids_BT: jax.Array, kv_segment_ids_BS: jax.Array | None = None) -> jax.Array:
  """[B, 1, T, S] boolean: query t and key s are in the same document (causality is separate)."""
  kv = segment_ids_BT if kv_segment_ids_BS is None else kv_segment_ids_BS
  return mask_lib.visible(q_segment_ids_BT=segment_ids_BT, kv_segment_ids_BS=kv)[:, None]


def cudnn_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, segment_ids_BT: jax.Array, *,
                    window: int = 0, implementation: str = "cudnn") -> jax.Array:
  """Causal GQA attention with document masking through `jax.nn.dot_product_attention`.
  `window` > 0: each query sees itself and the window - 1 keys before it (mask.in_window), which is cuDNN's
  causal sliding window of length `window` (JAX's `local_window_size=(window - 1, 0)`): cuDNN skips the
  blocks outside it. `implementation="xla"` runs the same call on any backend (how the mask is checked in
  tests)."""
  if implementation == "cudnn" and jax.default_backend() != "gpu":
    raise UserError(f"config.model.attention=cudnn runs on NVIDIA GPUs only; this process's JAX backend is "
                    f"{jax.default_backend()!r} (ahead-of-time compiles run on XLA:CPU and cannot lower it either). "
                    "Use model.attention=flash (or auto).")
  return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=same_document(segment_ids_BT), is_causal=True,
                                      local_window_size=(window - 1, 0) if window else None,
                                      implementation=implementation)


def _nki_kernels():
  """(flash_fwd, flash_attn_bwd, FlashConfig) from the Neuron compiler's NKI library, or exit 2."""
  try:
    import jax_neuronx  # noqa: F401  registers the Neuron PJRT plugin and NKI custom calls with JAX
    from neuronxcc.nki.kernels.attention import FlashConfig, flash_attn_bwd, flash_fwd
  except ImportError as e:
    raise UserError(
        f"config.model.attention=nki needs AWS's Neuron packages ({e}): pip install jax-neuronx neuronx-cc "
        "--extra-index-url=https://pip.repos.neuron.amazonaws.com, on a Trainium instance with the Neuron "
        "driver. Or use model.attention=flash (pure JAX, runs on Neuron).") from None
  if jax.default_backend() != "neuron":
    raise UserError(f"config.model.attention=nki runs on Trainium only; this process's JAX backend is "
                    f"{jax.default_backend()!r}. Use model.attention=flash.")
  return flash_fwd, flash_attn_bwd, FlashConfig


def nki_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, segment_ids_BT: jax.Array) -> jax.Array:
  """Causal GQA attention through the NKI flash kernels (forward and backward), documents masked by a
  logit bias. The kernels want head-major layouts ([B, N, H, T] for q, k; [B, N, T, H] for v in the
  forward) and one SPMD launch per (batch row, head): `kernel[B, N](...)`."""
  flash_fwd, flash_attn_bwd, flash_config = _nki_kernels()
  b, t, n, h = q_BTNH.shape
  g = n // k_BSKH.shape[2]
  bias_B1TS = mask_lib.apply(jnp.zeros((), jnp.float32), same_document(segment_ids_BT))
  bias_BNTS = jnp.broadcast_to(bias_B1TS.astype(q_BTNH.dtype), (b, n, t, t))
  seed = jnp.zeros((1,), jnp.int32)

  @jax.custom_vjp
  def attend(q_BTNH, k_BSKH, v_BSKH):
    return forward(q_BTNH, k_BSKH, v_BSKH)[0]

  def forward(q_BTNH, k_BSKH, v_BSKH):
    out_BNTH, lse = flash_fwd[b, n](q_BTNH.transpose(0, 2, 3, 1), k_BSKH.transpose(0, 2, 3, 1),
                                    v_BSKH.transpose(0, 2, 1, 3), seed, logit_bias=bias_BNTS, use_causal_mask=True,
                                    mixed_precision=True, config=flash_config(training=True))
    out_BTNH = out_BNTH.transpose(0, 2, 1, 3)
    return out_BTNH, (q_BTNH, k_BSKH, v_BSKH, out_BTNH, lse)

  def backward(residuals, dout_BTNH):
    q_BTNH, k_BSKH, v_BSKH, out_BTNH, lse = residuals
    heads_first = lambda x_BTNH: x_BTNH.transpose(0, 2, 3, 1)  # [B, N, H, T]
    # The backward kernel takes as many K/V heads as query heads: repeat them, sum the groups after.
    k_BSNH, v_BSNH = jnp.repeat(k_BSKH, g, axis=2), jnp.repeat(v_BSKH, g, axis=2)
    dq_BNHT, dk_BNHS, dv_BNHS = flash_attn_bwd[b, n](
        heads_first(q_BTNH), heads_first(k_BSNH), heads_first(v_BSNH), heads_first(out_BTNH),
        heads_first(dout_BTNH.astype(q_BTNH.dtype)), lse, seed, logit_bias_ref=bias_BNTS, use_causal_mask=True,
        mixed_precision=True)
    back = lambda x_BNHT: x_BNHT.transpose(0, 3, 1, 2)  # -> [B, T, N, H]
    group_sum = lambda x_BSNH: x_BSNH.reshape(b, t, n // g, g, h).sum(axis=3)
    return back(dq_BNHT), group_sum(back(dk_BNHS)).astype(k_BSKH.dtype), group_sum(back(dv_BNHS)).astype(v_BSKH.dtype)

  attend.defvjp(forward, backward)
  return attend(q_BTNH, k_BSKH, v_BSKH)
