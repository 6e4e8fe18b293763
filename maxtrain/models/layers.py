"""Building blocks of a LLaMA-style decoder: RMSNorm, rotary embeddings, SwiGLU MLP.

Shape legend: B batch, T length, D model, N heads, K kv heads, H head dim, F ffn, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.models import quant as quant_lib
from maxtrain.sharding.rules import NONE, Parallel


def param(rngs: nnx.Rngs, init, shape: tuple[int, ...], names: tuple[str, ...], dtype) -> nnx.Param:
  """A parameter that carries its logical axis names."""
  assert len(shape) == len(names), (shape, names)
  return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape, dtype))


def project(x: jax.Array, w: jax.Array, contract: int = 1, preferred_element_type=None,
            quant: "quant_lib.Quant | None" = None) -> jax.Array:
  """`x [..., I...] @ w [I..., O...] -> [..., O...]`, contracting x's last `contract` dims with w's
  first, as one 2-D matmul over the flattened leading dims. Why not an einsum over [B, T, ...]: XLA:CPU
  emits its weight gradient (a contraction over both B and T) with a transposing copy of the output
  gradient, which doubled the SwiGLU MLP's forward+backward time (tools/bench.py; BENCHMARKS.md). The
  reshapes merge whole dims (B with T, heads with head_dim), which GSPMD shards without communication.
  `quant`: the matmul in FP8/int8 (models/quant.py) when its K and N reach `quant.min_dim`."""
  lead, inner = x.shape[:x.ndim - contract], w.shape[:contract]
  assert x.shape[x.ndim - contract:] == inner, (x.shape, w.shape, contract)
  k = math.prod(inner)
  x_MK, w_KN = x.reshape(-1, k), w.reshape(k, -1)
  if quant is not None and quant.applies(k, w_KN.shape[1]):
    y = quant_lib.matmul(x_MK, w_KN, quant, out_dtype=preferred_element_type)
  else:
    y = jnp.dot(x_MK, w_KN, preferred_element_type=preferred_element_type)
  return y.reshape(*lead, *w.shape[contract:])


class RMSNorm(nnx.Module):
  """x / rms(x) * scale, or with `one_plus` (Gemma: `model.norm_one_plus`) * (1 + scale), its scale stored as
  Gemma checkpoints hold it (zeros = identity)."""

  def __init__(self, dim: int, *, eps: float, param_dtype, rngs: nnx.Rngs, one_plus: bool = False):
    self.eps, self.one_plus = eps, one_plus
    init = nnx.initializers.zeros if one_plus else nnx.initializers.ones
    self.scale = param(rngs, init, (dim,), ("norm",), param_dtype)

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    # Statistics in fp32 whatever the compute dtype: bf16 variance underflows.
    x = x_BTD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    scale = self.scale[...].astype(jnp.float32)
    return (x * (1.0 + scale if self.one_plus else scale)).astype(x_BTD.dtype)


@dataclasses.dataclass(frozen=True)
class Rope:
  """Rotary frequencies: base `theta`, optionally rescaled for a longer context than the model was
  first trained on. `scaling="llama3"` is LLaMA 3.1's rule (`rope_type: llama3` in Hugging Face
  configs): wavelengths shorter than original_max_len / high_freq_factor keep their frequency,
  those longer than original_max_len / low_freq_factor are divided by `factor`, and the band in
  between interpolates smoothly. `scaling="yarn"` (YaRN, GPT-OSS and DeepSeek-V3; Hugging Face's
  `_compute_yarn_parameters`): dims rotating more than `beta_fast` times over original_max_len keep
  their frequency, those rotating less than `beta_slow` times are divided by `factor`, a linear ramp
  between (its ends floored / ceiled when `truncate`); sin and cos are multiplied by the attention factor
  (`attention_factor`, 0: 0.1 ln(factor) + 1), which scales every attention logit by its square.
  Set by the `model.rope_*` config keys."""
  theta: float = 10000.0
  scaling: str = "none"  # none | llama3 | linear (every frequency / factor) | yarn
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_len: int = 8192
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  truncate: bool = True
  attention_factor: float = 0.0  # yarn: 0 = 0.1 ln(factor) + 1

  @property
  def scale(self) -> float:
    """The factor sin and cos are multiplied by (1 but for yarn)."""
    if self.scaling != "yarn":
      return 1.0
    if self.attention_factor:
      return self.attention_factor
    return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

  def inv_freq(self, head_dim: int) -> jax.Array:
    """[H/2] fp32 angular frequencies, one per rotated pair."""
    inv_freq = 1.0 / (self.theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if self.scaling == "none":
      return inv_freq
    if self.scaling == "linear":  # position interpolation: every position divided by `factor`
      return inv_freq / self.factor
    if self.scaling == "yarn":
      def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times over original_max_len
        return head_dim * math.log(self.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))
      low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
      if self.truncate:
        low, high = math.floor(low), math.ceil(high)
      low, high = max(low, 0), min(high, head_dim - 1)
      high = high + 0.001 if low == high else high
      ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
      return inv_freq / self.factor * ramp + inv_freq * (1 - ramp)
    wavelen = 2 * math.pi / inv_freq
    ratio = self.original_max_len / wavelen  # how many wavelengths fit in the original context
    # 0 at the long-wavelength edge of the band, 1 at the short one (clipped outside it).
    smooth = jnp.clip((ratio - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor), 0.0, 1.0)
    return (1 - smooth) * inv_freq / self.factor + smooth * inv_freq


def _computed_once(x_2BTh: jax.Array) -> jax.Array:
  """x, written once to memory instead of fused into its consumers.

  Why: XLA:CPU counts sin and cos as cheap ops, so it fuses them into every consumer of the RoPE
  tables and evaluates them once per consumer element: per head, per half, in the forward and the
  backward pass. That was a tenth of the default CPU step. It does not duplicate a gather into a
  consumer that reads its elements repeatedly, so an identity gather (over the stacked [sin, cos]
  axis) makes the tables one small buffer. `optimization_barrier` cannot: XLA removes it before
  fusion. Exact: the gather only copies.
  """
  return jnp.take(x_2BTh, jnp.arange(x_2BTh.shape[0]), axis=0)


def apply_rope(x_BTNH: jax.Array, positions_BT: jax.Array, rope: "Rope | float") -> jax.Array:
  """Rotary position embedding, rotate-half convention (pairs dim i with i + H/2), the layout of
  Hugging Face LLaMA checkpoints. `rope`: a Rope, or a plain base frequency."""
  rope = rope if isinstance(rope, Rope) else Rope(theta=rope)
  head_dim = x_BTNH.shape[-1]
  angles_BTh = positions_BT.astype(jnp.float32)[..., None] * rope.inv_freq(head_dim)
  sin, cos = _computed_once(jnp.stack([jnp.sin(angles_BTh), jnp.cos(angles_BTh)]))[:, :, :, None, :]
  if rope.scale != 1.0:  # YaRN's attention factor
    sin, cos = sin * rope.scale, cos * rope.scale
  x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTNH.dtype)


# model.mlp_activation -> the gate's activation: SwiGLU (LLaMA) or GELU-tanh GLU (Gemma's gelu_pytorch_tanh)
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class MLP(nnx.Module):
  """A GLU: down(act(x @ gate) * (x @ up)); act silu (SwiGLU) or gelu_tanh (Gemma)."""

  def __init__(self, d_model: int, d_ff: int, *, init_std: float, out_std: float, param_dtype,
               compute_dtype, rngs: nnx.Rngs, quant: "quant_lib.Quant | None" = None, activation: str = "silu",
               parallel: Parallel = NONE):
    init, out_init = nnx.initializers.normal(init_std), nnx.initializers.normal(out_std)
    self.gate = param(rngs, init, (d_model, d_ff), ("embed", "mlp"), param_dtype)
    self.up = param(rngs, init, (d_model, d_ff), ("embed", "mlp"), param_dtype)
    self.down = param(rngs, out_init, (d_ff, d_model), ("mlp", "embed"), param_dtype)
    self.compute_dtype, self.quant, self.activation, self.parallel = compute_dtype, quant, activation, parallel

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    dt, q = self.compute_dtype, self.quant
    gate_BTF = project(x_BTD, self.gate[...].astype(dt), quant=q)
    up_BTF = project(x_BTD, self.up[...].astype(dt), quant=q)
    h_BTF = self.parallel.constrain(ACTIVATIONS[self.activation](gate_BTF) * up_BTF,
                                    ("act_batch", "act_length", "act_mlp"))
    return project(h_BTF, self.down[...].astype(dt), quant=q)
