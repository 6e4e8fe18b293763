"""Gradient accumulation: one global batch as k microbatches, scanned inside the jitted step.

Only one microbatch's activations are alive at a time, so peak activation memory is that of
batch / k sequences. The accumulated quantities are sums (of token losses, of their gradients,
of token counts), so dividing once at the end gives exactly the un-accumulated mean, however the
loss tokens fall across microbatches.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp


def split(x_B: jax.Array, num_microbatches: int) -> jax.Array:
  """[B, ...] -> [k, B/k, ...] with microbatch i = rows i, i + k, i + 2k, ...

  Strided rather than contiguous so that every batch shard (a contiguous block of rows on one
  device) contributes B / (k * shards) rows to each microbatch: no data moves between devices.
  Needs k * shards to divide B (checked in config.validate).
  """
  b = x_B.shape[0]
  return jnp.swapaxes(x_B.reshape(b // num_microbatches, num_microbatches, *x_B.shape[1:]), 0, 1)


def accumulate(sums_and_grads: Callable[[Any, Any], tuple[Any, Any]], params: Any, batch: Any,
               num_microbatches: int) -> tuple[Any, Any]:
  """`sums_and_grads(params, batch) -> (sums, grads)`, both additive over examples, summed over
  `num_microbatches` microbatches of `batch` (a `sums` dict entry named `*_max`: its maximum, >= 0).
  Gradients accumulate in fp32 and come back in the parameters' dtype."""
  if num_microbatches == 1:
    return sums_and_grads(params, batch)
  micro = jax.tree.map(lambda x: split(x, num_microbatches), batch)
  first = jax.tree.map(lambda x: x[0], micro)
  sums_shape, grads_shape = jax.eval_shape(sums_and_grads, params, first)
  zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), tree)

  def add(path, acc, x):  # a sum, or a maximum for a dict key ending in `_max` (MoE's capacity_needed)
    key = getattr(path[-1], "key", None) if path else None
    x = x.astype(jnp.float32)
    return jnp.maximum(acc, x) if isinstance(key, str) and key.endswith("_max") else acc + x

  def body(carry, microbatch):
    sums, grads = sums_and_grads(params, microbatch)
    return (jax.tree_util.tree_map_with_path(add, carry[0], sums),
            jax.tree.map(lambda acc, x: acc + x.astype(jnp.float32), carry[1], grads)), None

  (sums, grads), _ = jax.lax.scan(body, (zeros(sums_shape), zeros(grads_shape)), micro)
  grads = jax.tree.map(lambda g, s: g.astype(s.dtype), grads, grads_shape)
  return sums, grads
