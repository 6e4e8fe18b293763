"""Low-precision matmuls (models/quant.py): the quantized operands, forward and gradients against a NumPy
quantize-dequantize reference (ml_dtypes' float8 types), the settings' validation, and the lowered
LLaMA 3 8B step's StableHLO (f8 dots in the chosen kinds only)."""

import math
import re
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from maxtrain import config as config_lib
from maxtrain.aot import hlo_lint
from maxtrain.errors import UserError
from maxtrain.models import quant
from maxtrain.program import plan as plan_lib
from maxtrain.program.build import program_for

NP = {quant.E4M3: ml_dtypes.float8_e4m3fn, quant.E5M2: ml_dtypes.float8_e5m2, jnp.int8: np.int8}


def np_quantize(x, dtype, margin=0, saturate=True):
  """The reference: scale 2^k, k the largest with amax x 2^k <= max x 2^-margin (found by search over
  k, not by the implementation's exponent arithmetic), then NumPy's cast."""
  top = quant.format_max(dtype)
  amax = float(np.max(np.abs(x.astype(np.float64))))
  k = 127 if amax == 0 else max(k for k in range(-126, 128) if amax * 2.0**k <= top * 2.0**-margin)
  k = min(k, 127)
  y = x.astype(np.float64) * 2.0**k
  if dtype == jnp.int8:
    y = np.clip(np.round(y), -top, top)  # np.round: half to even
  elif saturate:
    y = np.clip(y, -top, top)
  return y.astype(np.float32).astype(NP[dtype]), 2.0**-k


def operands(seed, m=16, k=64, n=32):
  rng = np.random.default_rng(seed)
  # Wide dynamic range: the smallest values fall into E4M3's subnormals, the largest near the scaled max.
  x = (rng.standard_normal((m, k)) * np.exp(rng.uniform(-6, 3, (m, k)))).astype(np.float32)
  w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
  return x, w


@pytest.mark.parametrize("dtype", [quant.E4M3, quant.E5M2, jnp.int8])
@pytest.mark.parametrize("margin", [0, 2, -3])
def test_quantized_operands_equal_the_numpy_reference_bitwise(dtype, margin):
  x, _ = operands(0)
  q, inv = jax.jit(lambda x: quant.quantize(x, dtype, margin))(x)
  ref, ref_inv = np_quantize(x, dtype, margin)
  assert float(inv) == ref_inv
  assert np.asarray(q).tobytes() == ref.tobytes()
  top = quant.format_max(dtype)
  if margin < 0:  # saturation: the largest values clip to the format's max
    assert np.sum(np.abs(ref.astype(np.float32)) == top) > 1
  assert np.max(np.abs(np.asarray(q).astype(np.float32))) <= top


def test_unsaturated_overflow_is_nan_in_e4m3_and_inf_in_e5m2():
  x, _ = operands(1)
  q4, _ = quant.quantize(jnp.asarray(x), quant.E4M3, margin=-3, saturate=False)
  q5, _ = quant.quantize(jnp.asarray(x), quant.E5M2, margin=-3, saturate=False)
  assert np.isnan(np.asarray(q4).astype(np.float32)).any()
  assert np.isinf(np.asarray(q5).astype(np.float32)).any()


def test_zero_tensor_quantizes_to_zeros():
  q, inv = quant.quantize(jnp.zeros((4, 4)), quant.E4M3)
  assert not np.asarray(q).astype(np.float32).any() and np.isfinite(float(inv))


def assert_product(y, a, b):
  """y equals a @ b (float64, exact for 8-bit operands) up to the f32 accumulation's error bound
  K x 2^-24 x (|a| @ |b|) per element, plus the final rounding to f32."""
  ref = a @ b
  bound = a.shape[1] * 2.0**-24 * (np.abs(a) @ np.abs(b)) + 2.0**-24 * np.abs(ref)
  err = np.abs(np.asarray(y, np.float64) - ref)
  assert np.all(err <= bound), float(np.max(err / np.maximum(bound, 1e-300)))


def dq(x, dtype, margin=0):
  q, inv = np_quantize(x, dtype, margin)
  return q.astype(np.float64) * inv


@pytest.mark.parametrize("margin", [0, -2])
def test_fp8_matmul_forward_and_gradients_equal_quantize_dequantize(margin):
  x, w = operands(2)
  g = np.random.default_rng(3).standard_normal((x.shape[0], w.shape[1])).astype(np.float32) * 1e-3
  q = quant.Quant("fp8", min_dim=1, margin=margin)
  y, vjp = jax.vjp(lambda x, w: quant.matmul(x, w, q), x, w)
  dx, dw = vjp(g)
  # Reference: E4M3 operands forward; the output gradient in E5M2 against the same E4M3 operands.
  xd, wd, gd = dq(x, quant.E4M3, margin), dq(w, quant.E4M3, margin), dq(g, quant.E5M2, margin)
  assert_product(y, xd, wd)
  assert_product(dx, gd, wd.T)
  assert_product(dw, xd.T, gd)
  # And it is a quantization: not the plain product.
  assert not np.allclose(np.asarray(y), x.astype(np.float64) @ w, rtol=1e-3)


def test_int8_matmul_forward_exact_and_straight_through_gradients():
  x, w = operands(4)
  g = np.random.default_rng(5).standard_normal((x.shape[0], w.shape[1])).astype(np.float32)
  y, vjp = jax.vjp(lambda x, w: quant.matmul(x, w, quant.Quant("int8", min_dim=1)), x, w)
  dx, dw = vjp(g)
  (xq, xi), (wq, wi) = np_quantize(x, jnp.int8), np_quantize(w, jnp.int8)
  # int32 accumulation is exact: the forward equals the integer product, rescaled.
  exact = (xq.astype(np.int64) @ wq.astype(np.int64)).astype(np.float32).astype(np.float64) * xi * wi
  np.testing.assert_array_equal(np.asarray(y), exact.astype(np.float32))
  assert_product(dx, g.astype(np.float64), (wq.astype(np.float64) * wi).T)
  assert_product(dw, (xq.astype(np.float64) * xi).T, g.astype(np.float64))


def test_batched_matmul_scales_each_expert_alone():
  x, w = operands(6)
  xs, ws = np.stack([x, x * 1e-3]), np.stack([w, w * 1e3])
  y = quant.batched_matmul(jnp.asarray(xs), jnp.asarray(ws), quant.Quant("fp8", min_dim=1))
  for e in range(2):
    assert_product(y[e], dq(xs[e], quant.E4M3), dq(ws[e], quant.E4M3))


def config(*args):
  return config_lib.load(["--config.model.quantization=fp8", *args])


@pytest.mark.parametrize("args, message", [
    (["--config.model.quantization=fp4"], "model.quantization"),
    (["--config.model.quant_kinds=attention,embed"], "unknown kind 'embed'"),
    (["--config.model.quant_min_dim=0"], "quant_min_dim"),
    (["--config.model.quant_kinds=head", "--config.model.vocab_size=8192"], "loss_chunk_tokens"),
    (["--config.model.moe.num_experts=4", "--config.model.moe.dispatch=dropless"], "dropless"),
])
def test_bad_settings_are_user_errors(args, message):
  with pytest.raises(UserError, match=message):
    plan_lib.validate(config(*args), 8)


def device(platform, kind, capability=None):
  return types.SimpleNamespace(platform=platform, device_kind=kind, compute_capability=capability)


def test_fp8_needs_fp8_hardware(caplog):
  cfg = config()
  quant.check_devices(cfg.model, [device("gpu", "NVIDIA H100 80GB HBM3", "9.0")])
  for bad in (device("gpu", "NVIDIA A100-SXM4-80GB", "8.0"), device("neuron", "NC_v3d"), device("tpu", "TPU v5")):
    with pytest.raises(UserError, match="fp8"):
      quant.check_devices(cfg.model, [bad])
  with caplog.at_level("WARNING"):
    quant.check_devices(cfg.model, [device("cpu", "cpu")])
  assert "emulated" in caplog.text
  quant.check_devices(config("--config.model.quantization=none").model, [device("neuron", "NC_v3d")])


# LLaMA 3 8B widths (D 4096, K x H 1024, F 14336, V 128256) in bf16 on the H100 preset's 8-GPU mesh, two
# layers: lowered only (StableHLO, global shapes), on the CPU devices.
H100_8B = ["--config=configs/llama3_8b.py", "--config.hardware=h100x8", "--config.model.num_layers=2",
           "--config.data.seq_len=512", "--config.data.batch_size=8", "--config.optimizer.microbatch_size=0",
           "--config.optimizer.grad_accum_steps=1", "--config.model.loss_chunk_tokens=0"]
DOT = re.compile(r"stablehlo\.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)")


def lowered(*args):
  return program_for(config_lib.load([*H100_8B, *args]), jax.devices(), require_data=False).lower()


def dots(lowered_step):
  return [m.groups() for m in DOT.finditer(lowered_step.as_text())]


def has(dot, dim):
  return any(re.search(rf"[<x]{dim}x", t) for t in dot)


@pytest.fixture(scope="module")
def attention_only():
  return lowered("--config.model.quantization=fp8", "--config.model.quant_kinds=attention")


def test_lowered_h100_step_has_f8_dots_in_the_chosen_kinds_only(attention_only):
  dots_attention_only = dots(attention_only)
  f8 = [d for d in dots_attention_only if "f8E4M3FN" in d[0] + d[1] or "f8E5M2" in d[0] + d[1]]
  # Attention: q, k, v, o forward (4), their recomputation in the backward (the preset's remat=full: 4),
  # and per projection a dx and a dw dot (8), in the scanned layer body.
  assert len(f8) == 16, f8
  assert any("f8E5M2" in d[0] + d[1] for d in f8)  # the backward's gradients
  assert not any(has(d, 14336) or has(d, 128256) for d in f8)  # MLP and head stay in bf16
  assert any(has(d, 14336) and "bf16" in d[0] for d in dots_attention_only)
  assert any(has(d, 128256) for d in dots_attention_only)


def test_neuron_lint_names_the_fp8_operands_and_the_fix(attention_only):
  problems = hlo_lint.neuron_problems(attention_only.as_text(dialect="hlo"), check_prng=False)
  fp8 = [p for p in problems if p.kind == "f8e4m3fn"]
  assert fp8 and all("model.quantization=fp8" in p.why for p in fp8)
