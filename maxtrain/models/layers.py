"""Building blocks of a LLaMA-style decoder: RMSNorm, rotary embeddings, SwiGLU MLP.

Shape legend: B batch, T length, D model, N heads, K kv heads, H head dim, F ffn, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.sharding import rules as sharding_rules


def param(rngs: nnx.Rngs, init, shape: tuple[int, ...], names: tuple[str, ...], dtype) -> nnx.Param:
  """A parameter that carries its logical axis names."""
  assert len(shape) == len(names), (shape, names)
  return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape, dtype))


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, *, eps: float, param_dtype, rngs: nnx.Rngs):
    self.eps = eps
    self.scale = param(rngs, nnx.initializers.ones, (dim,), ("norm",), param_dtype)

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    # Statistics in fp32 whatever the compute dtype: bf16 variance underflows.
    x = x_BTD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * self.scale[...].astype(jnp.float32)).astype(x_BTD.dtype)


def apply_rope(x_BTNH: jax.Array, positions_BT: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding, rotate-half convention (pairs dim i with i + H/2)."""
  head_dim = x_BTNH.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles_BTh = positions_BT.astype(jnp.float32)[..., None] * inv_freq
  sin = jnp.sin(angles_BTh)[:, :, None, :]
  cos = jnp.cos(angles_BTh)[:, :, None, :]
  x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTNH.dtype)


class MLP(nnx.Module):
  """SwiGLU: down(silu(x @ gate) * (x @ up))."""

  def __init__(self, d_model: int, d_ff: int, *, init_std: float, out_std: float, param_dtype,
               compute_dtype, rngs: nnx.Rngs):
    init, out_init = nnx.initializers.normal(init_std), nnx.initializers.normal(out_std)
    self.gate = param(rngs, init, (d_model, d_ff), ("embed", "mlp"), param_dtype)
    self.up = param(rngs, init, (d_model, d_ff), ("embed", "mlp"), param_dtype)
    self.down = param(rngs, out_init, (d_ff, d_model), ("mlp", "embed"), param_dtype)
    self.compute_dtype = compute_dtype

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    dt = self.compute_dtype
    gate_BTF = jnp.einsum("btd,df->btf", x_BTD, self.gate[...].astype(dt))
    up_BTF = jnp.einsum("btd,df->btf", x_BTD, self.up[...].astype(dt))
    h_BTF = sharding_rules.constrain(jax.nn.silu(gate_BTF) * up_BTF, ("act_batch", "act_length", "act_mlp"))
    return jnp.einsum("btf,fd->btd", h_BTF, self.down[...].astype(dt))
