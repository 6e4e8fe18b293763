"""Low-precision matmuls (`model.quantization`): FP8 (E4M3 forward operands, E5M2 output gradients) or
int8 (forward only), with current per-tensor power-of-two scaling. docs/low_precision.md is the guide.

Scaling: each operand's scale is computed from its own amax in the same step ("current" scaling), as
the largest power of two s with amax x s <= the format's max x 2^-margin. Why current, not delayed
(an amax history): there is no scaling state, so a checkpoint holds nothing new, a resume is exact by
construction, a bf16 checkpoint starts an fp8 run (and back) unchanged, and a step the guards skip
cannot move a scale. The cost is one amax reduction per operand per matmul (an all-reduce when the
operand is sharded). Why powers of two: multiplying by the scale and by its inverse is exact, so the
only rounding is the cast to the 8-bit format (and the matmul's f32 accumulation): the NumPy
reference (tests/test_quant.py) reproduces the quantized operands bit for bit.

Why written here rather than through Qwix: the whole recipe is one `jax.custom_vjp` around
`jnp.dot` with float8 operands (what XLA:GPU rewrites to a cuBLASLt FP8 GEMM), about a hundred lines;
the step's StableHLO then shows the f8 dots directly (tests check it), with no interception layer
between the model's `project` and the dot.

Shape legend: M rows (tokens), K contraction, N output columns, E experts.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from maxtrain.config.keys import check_known
from maxtrain.errors import UserError, choice, require

RECIPES = ("none", "fp8", "int8")
# Which matmuls a kind covers: attention projections (wq wk wv wo), the dense SwiGLU MLP (and MoE shared
# experts), the routed experts' SwiGLU (capacity dispatch), the output head.
KINDS = ("attention", "mlp", "experts", "head")
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# GPU compute capabilities with FP8 tensor cores (Ada 8.9, Hopper 9.0, Blackwell 10.x/12.x).
FP8_MIN_CAPABILITY = (8, 9)
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Quant:
  """How one kind's matmuls run: `recipe` fp8 | int8; matmuls with K or N below `min_dim` stay in the
  compute dtype; `margin` powers of two of headroom under the format's max; `saturate` clips scaled
  values to the format's range (False: E4M3 overflow is NaN, E5M2's Inf, and the guards see it)."""
  recipe: str
  min_dim: int = 128
  margin: int = 0
  saturate: bool = True

  def applies(self, k: int, n: int) -> bool:
    return min(k, n) >= self.min_dim


@dataclasses.dataclass(frozen=True)
class QuantConfig:
  recipe: str = "none"
  kinds: tuple[str, ...] = ()
  min_dim: int = 128
  margin: int = 0
  saturate: bool = True

  def for_kind(self, kind: str) -> Quant | None:
    assert kind in KINDS, kind
    if self.recipe == "none" or kind not in self.kinds:
      return None
    return Quant(self.recipe, self.min_dim, self.margin, self.saturate)

  @classmethod
  def from_config(cls, m: Any) -> "QuantConfig":
    """From `config.model` (its typed section, or a dict of its keys: a migrated saved config, an HF import, which
    may lack the quant keys: their defaults); an undeclared key is a UserError naming it, never dropped."""
    check_known(m, "model")
    base = cls()
    return cls(recipe=m.get("quantization", base.recipe), kinds=parse_kinds(m.get("quant_kinds", "")),
               min_dim=m.get("quant_min_dim", base.min_dim), margin=m.get("quant_margin", base.margin),
               saturate=m.get("quant_saturate", base.saturate))


def parse_kinds(text: str) -> tuple[str, ...]:
  return tuple(k.strip() for k in text.split(",") if k.strip())


def validate(m: Any, chunk_tokens: int) -> None:
  """UserError naming the key for bad `config.model.quant*` (m: the model section; chunk_tokens: the
  resolved loss chunk, 0 = the head is one matmul)."""
  choice("model.quantization", m.quantization, RECIPES)
  kinds = parse_kinds(m.quant_kinds)
  for kind in kinds:
    require(kind in KINDS, f"config.model.quant_kinds={m.quant_kinds!r}: unknown kind {kind!r}; "
            f"use a comma-separated subset of {', '.join(KINDS)}")
  require(m.quant_min_dim >= 1, f"config.model.quant_min_dim={m.quant_min_dim}: must be >= 1")
  if m.quantization == "none":
    return
  if "experts" in kinds and m.moe.num_experts and m.moe.dispatch == "dropless":
    raise UserError(f"config.model.quant_kinds={m.quant_kinds!r} quantizes experts, which "
                    "model.moe.dispatch=dropless (lax.ragged_dot) cannot: use dispatch=capacity or drop 'experts'")
  if "head" in kinds and chunk_tokens:
    raise UserError(f"config.model.quant_kinds={m.quant_kinds!r} quantizes the head, which the chunked loss "
                    f"(model.loss_chunk_tokens -> {chunk_tokens}) computes with its own backward: set "
                    "model.loss_chunk_tokens=0 or drop 'head'")


def resume_note(saved_model: dict, model: Any) -> str | None:
  """What a resume from a checkpoint saved under `saved_model` (its config.model) changes in the
  quantization of this run's `model` section; None when nothing."""
  def setting(m: Any) -> str:
    recipe = m.get("quantization", "none")
    return recipe if recipe == "none" else f"{recipe} on {m.get('quant_kinds', '')}"

  before, after = setting(saved_model), setting(model)
  if before == after:
    return None
  return (f"quantization changes at this resume: the checkpoint trained with {before}, this run uses {after} "
          "(current scaling keeps no scaling state: nothing to initialise or drop, parameters and optimizer "
          "state carry over as saved)")


def check_devices(m: Any, devices: Sequence[Any]) -> None:
  """UserError before compiling when the devices have no matmul for `model.quantization`; CPU runs it
  as an emulation (XLA:CPU upcasts the 8-bit operands), which the log says."""
  if m.quantization == "none" or not devices:
    return
  device = devices[0]
  platform, kind = device.platform, getattr(device, "device_kind", "?")
  if platform == "cpu":
    log.warning("model.quantization=%s on CPU: emulated (8-bit operands, rounding and scales exact; "
                "XLA:CPU computes the dots in f32), for tests, not speed", m.quantization)
    return
  if platform in ("gpu", "cuda", "rocm"):
    capability = getattr(device, "compute_capability", None)
    major_minor = tuple(int(x) for x in str(capability).split(".")[:2]) if capability else None
    if m.quantization == "int8" or (major_minor is not None and major_minor >= FP8_MIN_CAPABILITY):
      return
    raise UserError(f"config.model.quantization=fp8: the GPUs are {kind} (compute capability {capability}), "
                    "without FP8 tensor cores (Ada/Hopper/Blackwell: >= 8.9); use model.quantization=none")
  if platform == "tpu" and m.quantization == "int8":
    return
  # Neuron: its compiler rejects integer matmuls and the f8e4m3fn type (aot/hlo_lint.py); TPUs before v7 have no FP8.
  raise UserError(f"config.model.quantization={m.quantization}: not available on {platform} devices ({kind}); "
                  "use model.quantization=none")


# The largest finite value of each format (OCP FP8: E4M3FN has no Inf, its top code is NaN).
FORMAT_MAX = {jnp.dtype(E4M3): 448.0, jnp.dtype(E5M2): 57344.0, jnp.dtype(jnp.int8): 127.0}


def format_max(dtype: Any) -> float:
  return FORMAT_MAX[jnp.dtype(dtype)]


def _pow2(k: jax.Array) -> jax.Array:
  """2^k as f32, exactly (k int32, clipped to the normal range)."""
  k = jnp.clip(k, -126, 127)
  return jax.lax.bitcast_convert_type(((k + 127) << 23).astype(jnp.int32), jnp.float32)


def scale_exponent(amax: jax.Array, dtype: Any, margin: int) -> jax.Array:
  """int32 k: the largest 2^k with amax x 2^k <= max(dtype) x 2^-margin (exact integer arithmetic on the
  binary exponents; amax = 0 gives the format's own exponent)."""
  fm, fe = math.frexp(format_max(dtype))  # max = fm x 2^fe, fm in [0.5, 1)
  m, e = jnp.frexp(amax.astype(jnp.float32))
  return (fe - e - (m > fm).astype(jnp.int32) - margin).astype(jnp.int32)


def quantize(x: jax.Array, dtype: Any, margin: int = 0, saturate: bool = True) -> tuple[jax.Array, jax.Array]:
  """(x x 2^k cast to `dtype`, 2^-k as f32): current per-tensor scaling. Casts round to nearest even;
  int8 rounds then clips to +-127 always; floats clip to +-max when `saturate`."""
  x32 = x.astype(jnp.float32)
  k = scale_exponent(jnp.max(jnp.abs(x32)), dtype, margin)
  y = x32 * _pow2(k)
  top = format_max(dtype)
  if jnp.dtype(dtype) == jnp.int8:
    y = jnp.clip(jnp.round(y), -top, top)
  elif saturate:
    y = jnp.clip(y, -top, top)
  return y.astype(dtype), _pow2(-k)


@dataclasses.dataclass(frozen=True)
class _Spec:
  quant: Quant
  x_dtype: Any
  w_dtype: Any
  out_dtype: Any


def _scaled_dot(a: jax.Array, b: jax.Array, inv_a: jax.Array, inv_b: jax.Array, out_dtype: Any) -> jax.Array:
  acc = jnp.int32 if a.dtype == jnp.int8 else jnp.float32
  y = jnp.dot(a, b, preferred_element_type=acc).astype(jnp.float32)
  return (y * inv_a * inv_b).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x_MK: jax.Array, w_KN: jax.Array, spec: _Spec) -> jax.Array:
  return _matmul_fwd(x_MK, w_KN, spec)[0]


def _matmul_fwd(x_MK, w_KN, spec):
  q = spec.quant
  fwd = jnp.int8 if q.recipe == "int8" else E4M3
  xq, x_inv = quantize(x_MK, fwd, q.margin, q.saturate)
  wq, w_inv = quantize(w_KN, fwd, q.margin, q.saturate)
  return _scaled_dot(xq, wq, x_inv, w_inv, spec.out_dtype), (xq, x_inv, wq, w_inv)


def _matmul_bwd(spec, residuals, g_MN):
  xq, x_inv, wq, w_inv = residuals
  q = spec.quant
  if q.recipe == "int8":
    # int8 quantizes the forward only: the gradients use the dequantized operands (straight-through).
    x, w = xq.astype(jnp.float32) * x_inv, wq.astype(jnp.float32) * w_inv
    g = g_MN.astype(jnp.float32)
    return (g @ w.T).astype(spec.x_dtype), (x.T @ g).astype(spec.w_dtype)
  gq, g_inv = quantize(g_MN, E5M2, q.margin, q.saturate)
  return _scaled_dot(gq, wq.T, g_inv, w_inv, spec.x_dtype), _scaled_dot(xq.T, gq, x_inv, g_inv, spec.w_dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(x_MK: jax.Array, w_KN: jax.Array, quant: Quant, out_dtype: Any = None) -> jax.Array:
  """`x @ w` with both operands quantized (forward: E4M3 or int8; backward: the output gradient in E5M2
  against the saved E4M3 operands), rescaled in f32, returned in `out_dtype` (default: x's and w's)."""
  out_dtype = jnp.result_type(x_MK, w_KN) if out_dtype is None else out_dtype
  return _matmul(x_MK, w_KN, _Spec(quant, x_MK.dtype, w_KN.dtype, jnp.dtype(out_dtype)))


def batched_matmul(x_EMK: jax.Array, w_EKN: jax.Array, quant: Quant) -> jax.Array:
  """Per-expert `matmul` (each expert's operands scaled on their own) over the leading dim."""
  return jax.vmap(lambda x, w: matmul(x, w, quant))(x_EMK, w_EKN)
