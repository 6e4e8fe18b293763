"""flash_attention (and blocked_attention, the short-sequence kernel) against the einsum reference:
forward and gradients, fp32 and bf16, packed documents, GQA, ragged and tiny T, sharded on 8 fake
devices; and the lowered program's shape (no T x T array, nothing the Neuron compiler rejects, causal
blocks skipped statically).

Shape legend: B batch, T query length, S key length, N heads, K kv heads, H head dim.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxtrain.aot import hlo_lint
from maxtrain.models.attention import flash as fa
from maxtrain.models.attention.layer import BLOCKED_MAX_LEN, dot_product_attention, resolve_kernel
from maxtrain.models.attention.blocked import blocked_attention, default_block_q

# fp32 parity (STYLE.md 9) with the einsum reference computed in float64 (NumPy, below). atol only covers
# values near zero; inputs are unit-variance, so scores are O(1). Why float64: the fp32 einsum itself is
# not always within these bounds of the exact result (XLA:CPU of jaxlib 0.10.0: dv 1.1x the tolerance on
# one element of the T=200 case, where flash was at 0.7x), so an fp32-vs-fp32 comparison fails on
# whichever side XLA happens to round worse.
RTOL, ATOL = 1e-5, 1e-6


def _np_value_and_grads(q_BTNH, k_BSKH, v_BSKH, dout_BTNH, segment_ids_BT):
  """The einsum reference and its vjp in float64 NumPy: causal, same-document GQA attention ->
  (out, dq, dk, dv). A different formulation from the model's: K/V repeated per query head."""
  q, k, v, do = (np.asarray(x, np.float64) for x in (q_BTNH, k_BSKH, v_BSKH, dout_BTNH))
  seg_BT = np.asarray(segment_ids_BT)
  b, t, n, h = q.shape
  kv_heads = k.shape[2]
  g = n // kv_heads
  k_BSNH, v_BSNH = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # query head i reads kv head i // g
  scale = h ** -0.5
  visible_BTS = np.tril(np.ones((t, t), bool))[None] & (seg_BT[:, :, None] == seg_BT[:, None, :])
  s_BNTS = np.where(visible_BTS[:, None], np.einsum("btnh,bsnh->bnts", q, k_BSNH) * scale, -np.inf)
  p_BNTS = np.exp(s_BNTS - s_BNTS.max(-1, keepdims=True))
  p_BNTS /= p_BNTS.sum(-1, keepdims=True)
  dp_BNTS = np.einsum("btnh,bsnh->bnts", do, v_BSNH)
  ds_BNTS = p_BNTS * (dp_BNTS - (dp_BNTS * p_BNTS).sum(-1, keepdims=True))
  per_kv_head = lambda x_BSNH: x_BSNH.reshape(b, t, kv_heads, g, h).sum(3)
  return (np.einsum("bnts,bsnh->btnh", p_BNTS, v_BSNH), np.einsum("bnts,bsnh->btnh", ds_BNTS, k_BSNH) * scale,
          per_kv_head(np.einsum("bnts,btnh->bsnh", ds_BNTS, q) * scale),
          per_kv_head(np.einsum("bnts,btnh->bsnh", p_BNTS, do)))


def _inputs(seed: int, b: int, t: int, n: int, k: int, h: int, num_docs: int = 3):
  """Unit-variance q, k, v, a random cotangent and packed documents that differ per batch row."""
  rng = np.random.default_rng(seed)
  q_BTNH, k_BSKH, v_BSKH, dout_BTNH = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
                                       for shape in [(b, t, n, h), (b, t, k, h), (b, t, k, h), (b, t, n, h)])
  # Document starts differ per row; ids need not be contiguous or start at 0.
  segment_ids_BT = jnp.asarray(np.sort(rng.integers(0, num_docs, (b, t)), axis=1) * 7 + 3, jnp.int32)
  return q_BTNH, k_BSKH, v_BSKH, dout_BTNH, segment_ids_BT


def _value_and_grads(attention, q_BTNH, k_BSKH, v_BSKH, dout_BTNH, segment_ids_BT):
  out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, segment_ids_BT), q_BTNH, k_BSKH, v_BSKH)
  return [out, *vjp(dout_BTNH.astype(out.dtype))]


def _flash(block_q: int, block_kv: int):
  return lambda q, k, v, seg: fa.flash_attention(q, k, v, seg, block_q=block_q, block_kv=block_kv)


@pytest.mark.parametrize("b,t,n,k,h,block_q,block_kv", [
    (2, 128, 4, 2, 16, 64, 32),    # packed documents, GQA with G = 2, key blocks smaller than query blocks
    (2, 200, 4, 1, 16, 64, 64),    # T not a multiple of the block (padded keys and rows); one kv head
    (2, 96, 4, 4, 16, 32, 64),     # N == K; key blocks larger than query blocks
    (2, 48, 2, 1, 16, 128, 256),   # blocks larger than T are clamped
    (3, 1, 2, 1, 8, 512, 512),     # very short T
    (3, 2, 2, 1, 8, 512, 512),
    (3, 3, 2, 1, 8, 2, 2),
])
def test_matches_reference_fp32(b, t, n, k, h, block_q, block_kv):
  args = _inputs(t, b, t, n, k, h)
  expected = _np_value_and_grads(*args)
  got = jax.jit(lambda *a: _value_and_grads(_flash(block_q, block_kv), *a))(*args)
  for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
    assert g.dtype == jnp.float32, name
    assert np.isfinite(np.asarray(g)).all(), name
    np.testing.assert_allclose(g, e, rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("b,t,n,k,h,block_q", [
    (2, 128, 4, 2, 16, 32),     # packed documents, GQA with G = 2
    (2, 200, 4, 1, 16, 64),     # T not a multiple of the block: a shorter last block; one kv head
    (2, 96, 4, 4, 16, None),    # N == K; the default blocks
    (2, 256, 4, 2, 16, None),   # the default CPU config's T: 4 blocks of 64
    (2, 48, 2, 1, 16, 128),     # one block larger than T
    (3, 1, 2, 1, 8, None),      # very short T
    (3, 3, 2, 1, 8, 2),
])
def test_blocked_matches_reference_fp32(b, t, n, k, h, block_q):
  args = _inputs(t + 1, b, t, n, k, h)
  expected = _np_value_and_grads(*args)
  blocked = lambda q, kk, v, seg: blocked_attention(q, kk, v, seg, block_q=block_q)
  got = jax.jit(lambda *a: _value_and_grads(blocked, *a))(*args)
  for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
    assert g.dtype == jnp.float32, name
    assert np.isfinite(np.asarray(g)).all(), name
    np.testing.assert_allclose(g, e, rtol=RTOL, atol=ATOL, err_msg=name)


def test_blocked_skips_the_blocks_above_the_diagonal():
  """4 query blocks of 64 at T=256: block i's scores are [.., 64, .., 64 * (i + 1)], never the whole T x T."""
  assert default_block_q(256) == 64 and default_block_q(1024) == 256 and default_block_q(8) == 8
  text = jax.jit(lambda *a: _value_and_grads(blocked_attention, *a)).lower(*_inputs(0, 1, 256, 2, 1, 8)).as_text()
  # [B, K, q, G, s] arrays with s >= 64 (smaller last dims are q's head dim and row statistics).
  scores = {int(s) for s in re.findall(r"tensor<1x1x64x2x(\d+)xf32>", text)} - {1, 8}
  assert scores == {64, 128, 192, 256}, scores
  assert not re.findall(r"tensor<1x1x256x2x256xf32>", text)


def test_auto_picks_blocked_for_short_sequences_only():
  assert resolve_kernel("auto", BLOCKED_MAX_LEN) == "blocked"
  assert resolve_kernel("auto", BLOCKED_MAX_LEN + 1) == "flash"
  assert resolve_kernel("flash", 256) == "flash" and resolve_kernel("dot", 8192) == "dot"


@pytest.mark.parametrize("kernel", ["flash", "blocked"])
def test_bf16_no_worse_than_the_bf16_reference(kernel):
  """bf16 inputs: compared with the fp32 reference, flash and blocked (fp32 scores and accumulators)
  must be no less accurate than the reference computed in bf16, and within a few bf16 epsilons (2**-8)."""
  args = _inputs(0, 2, 256, 4, 2, 32)
  reference = jax.jit(lambda *a: _value_and_grads(dot_product_attention, *a))
  exact = reference(*args)
  as_bf16 = [x.astype(jnp.bfloat16) for x in args[:4]] + [args[4]]
  ref_bf16 = reference(*as_bf16)
  attention = _flash(64, 64) if kernel == "flash" else blocked_attention
  flash_bf16 = jax.jit(lambda *a: _value_and_grads(attention, *a))(*as_bf16)
  for name, e, r, f in zip(("out", "dq", "dk", "dv"), exact, ref_bf16, flash_bf16):
    assert f.dtype == jnp.bfloat16, name
    e, r, f = (np.asarray(x, np.float32) for x in (e, r, f))
    flash_error = np.linalg.norm(f - e) / np.linalg.norm(e)
    ref_error = np.linalg.norm(r - e) / np.linalg.norm(e)
    assert flash_error <= ref_error, (name, flash_error, ref_error)
    assert flash_error < 2.5 * 2**-8, (name, flash_error)


def test_separate_q_and_kv_ids_like_a_context_parallel_shard():
  """Queries of one shard (rows 64..127 and 192..255, as a load-balanced split would hold them)
  against all keys, with explicit positions: the reference's rows, forward and gradients."""
  b, t, n, k, h = 2, 256, 4, 2, 16
  q_BTNH, k_BSKH, v_BSKH, dout_BTNH, segment_ids_BT = _inputs(5, b, t, n, k, h)
  rows = np.r_[64:128, 192:256]
  positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

  def reference(q, k, v):
    return dot_product_attention(q, k, v, segment_ids_BT)[:, rows]

  def shard(q, k, v):
    return fa.flash_attention_qkv(q[:, rows], k, v, segment_ids_BT[:, rows], segment_ids_BT,
                                  positions_BT[:, rows], positions_BT, block_q=32, block_kv=64)

  def value_and_grads(f):
    out, vjp = jax.vjp(f, q_BTNH, k_BSKH, v_BSKH)
    return [out, *vjp(dout_BTNH[:, rows])]

  expected = jax.jit(value_and_grads, static_argnums=0)(reference)
  got = jax.jit(value_and_grads, static_argnums=0)(shard)
  for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
    np.testing.assert_allclose(g, e, rtol=RTOL, atol=ATOL, err_msg=name)


def test_sharded_batch_over_data_heads_over_tensor_equals_one_device():
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "tensor"))
  q_BTNH, k_BSKH, v_BSKH, dout_BTNH, segment_ids_BT = _inputs(1, 4, 96, 4, 2, 16)
  step = jax.jit(lambda *a: _value_and_grads(_flash(32, 32), *a))
  expected = step(q_BTNH, k_BSKH, v_BSKH, dout_BTNH, segment_ids_BT)
  heads, batch = NamedSharding(mesh, P("data", None, "tensor", None)), NamedSharding(mesh, P("data", None))
  sharded = [jax.device_put(x, s) for x, s in zip((q_BTNH, k_BSKH, v_BSKH, dout_BTNH, segment_ids_BT),
                                                  (heads, heads, heads, heads, batch))]
  got = step(*sharded)
  assert got[0].sharding.spec[0] == "data"  # partitioned, not gathered onto one device
  for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
    np.testing.assert_allclose(g, e, rtol=RTOL, atol=ATOL, err_msg=name)


def _lowered_fwd_bwd(attention, t: int, dialect: str = "stablehlo") -> str:
  x_BTNH = jax.ShapeDtypeStruct((1, t, 4, 32), jnp.float32)
  kv_BSKH = jax.ShapeDtypeStruct((1, t, 2, 32), jnp.float32)
  seg_BT = jax.ShapeDtypeStruct((1, t), jnp.int32)
  step = jax.jit(lambda q, k, v, dout, seg: _value_and_grads(attention, q, k, v, dout, seg))
  return step.lower(x_BTNH, kv_BSKH, kv_BSKH, x_BTNH, seg_BT).as_text(dialect=dialect)


def _largest_two_dims(text: str) -> int:
  """Over every array type in the StableHLO text, the largest second-largest dim."""
  shapes = [[int(d) for d in m.split("x")[:-1]] for m in re.findall(r"tensor<([0-9x]+[a-z]\w*)>", text)]
  return max(sorted(s)[-2] for s in shapes if len(s) >= 2)


def test_no_quadratic_array_in_forward_or_backward():
  t = 1024
  # The detector sees the reference's [B, K, G, T, S] scores...
  assert _largest_two_dims(_lowered_fwd_bwd(dot_product_attention, t)) >= t
  # ...and in flash nothing but blocks: no array has two dims of even 2 blocks.
  assert _largest_two_dims(_lowered_fwd_bwd(_flash(128, 128), t)) < 256


def test_no_per_pair_masks_under_a_differentiated_layer_scan():
  """Inside a scanned, differentiated model, JAX's partial evaluation once hoisted the id-only
  block masks out of the pair loop as a stacked pred[pairs, ...] residual (O(T^2) memory, 16 GiB
  per device for LLaMA 3 8B at T=32768); `_pair_mask`'s barrier keeps them in the loop."""
  b, t, n, k, h = 1, 1024, 4, 2, 16
  pairs = len(fa._block_pairs(t // 128, t // 128, 128, 128, t, True))

  def loss(w_LDF, x_BTD, seg_BT):
    def layer(x_BTD, w_DF):
      qkv = x_BTD @ w_DF
      q, kk, v = (qkv[..., a:a + m * h].reshape(b, t, m, h) for a, m in ((0, n), (n * h, k), ((n + k) * h, k)))
      return fa.flash_attention(q, kk, v, seg_BT).reshape(b, t, n * h)[..., :8] + x_BTD, None
    return jax.lax.scan(layer, x_BTD, w_LDF)[0].sum()

  text = jax.jit(jax.grad(loss)).lower(jnp.ones((2, 8, (n + 2 * k) * h)), jnp.ones((b, t, 8)),
                                       jnp.ones((b, t), jnp.int32)).as_text()
  assert not re.findall(rf"tensor<{pairs}x[0-9x]*xi1>", text)


def test_lowered_program_passes_the_neuron_lint():
  """No conditional, no host callback, only static-trip-count loops (the scans), no variadic reduce."""
  hlo = _lowered_fwd_bwd(_flash(128, 128), 1024, dialect="hlo")
  assert hlo_lint.neuron_problems(hlo) == []
  assert " while(" in hlo  # the scans
  for attention in (_flash(128, 128), blocked_attention):
    stablehlo = _lowered_fwd_bwd(attention, 1024)
    for banned in ("stablehlo.case", "stablehlo.if", "custom_call @xla_python", "callback"):
      assert banned not in stablehlo, banned
  assert hlo_lint.neuron_problems(_lowered_fwd_bwd(blocked_attention, 1024, dialect="hlo")) == []


@pytest.mark.parametrize("t,block_q,block_kv", [(256, 32, 32), (256, 64, 32), (256, 32, 64), (200, 64, 48)])
def test_pair_list_is_exactly_the_blocks_with_a_visible_key(t, block_q, block_kv):
  """Blocks wholly above the causal diagonal are skipped statically and no other block is."""
  num_q, num_kv = -(-t // block_q), -(-t // block_kv)
  pairs = set(fa._block_pairs(num_q, num_kv, block_q, block_kv, t, causal_skip=True))
  visible_TS = np.tril(np.ones((t, t), bool))
  for i in range(num_q):
    for j in range(num_kv):
      block = visible_TS[i * block_q:(i + 1) * block_q, j * block_kv:(j + 1) * block_kv]
      assert ((i, j) in pairs) == block.any(), (i, j)
  assert len(fa._block_pairs(8, 8, 128, 128, 1024, causal_skip=True)) == 36  # 8 * 9 / 2 of 64
