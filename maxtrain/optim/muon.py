"""Muon's orthogonalised momentum, with the guard's skip inside the transform.

The same math and the same state tree as `optax.contrib.scale_by_muon` (Nesterov, Frobenius
preconditioning; `MuonState(count, mu, ns_coeffs)`, so checkpoints written with optax's transform
restore unchanged), written here for three things optax's cannot do:
  - the guard's skip selects old vs new momentum *before* the update is computed from it, so a
    skipped step leaves momentum and count bit-identical and no second copy of the momentum is
    kept (as `optim.scale_by_adam_guarded` does for Adam);
  - Newton-Schulz in a chosen dtype (`optimizer.muon_ns_dtype`: bfloat16 halves its matmul traffic);
  - on sharded, scanned weights, each device orthogonalises whole layers: the Muon input is
    resharded so the stacked `layers` dim is split over the devices that shard it (an all-to-all,
    logical name `opt_layers` in maxtrain/sharding/rules.py; under a pipeline each stage keeps its own
    layers), rather than every device all-gathering every matrix, and the result is resharded back to
    the parameter's layout.

Shape legend: L layers (a stacked weight's leading dim), M the matrices of a leaf (L, or 1),
I fan_in, O fan_out (the products of the reduction and output dims, optim.matrix_dimension_numbers).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers, MuonState

from maxtrain.optim.masking import keep_if
from maxtrain.sharding import rules as sharding_rules
from maxtrain.sharding.rules import NONE, Parallel
from maxtrain.sharding.layout import param_name

NS_DTYPES = ("float32", "bfloat16")
_EPS = 1e-8  # optax's: X / (|X|_F + eps) before the iteration


def _axes(a: int | tuple[int, ...], ndim: int) -> tuple[int, ...]:
  return tuple(x % ndim for x in ((a,) if isinstance(a, int) else a))


def _matrix_view(shape: tuple[int, ...], dims: MuonDimensionNumbers) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(transpose to batch + reduction + output dims, the [M, I, O] shape after it) of a weight."""
  reduction, output = _axes(dims.reduction_axis, len(shape)), _axes(dims.output_axis, len(shape))
  batch = tuple(a for a in range(len(shape)) if a not in reduction + output)
  size = lambda axes: math.prod(shape[a] for a in axes)
  return batch + reduction + output, (size(batch), size(reduction), size(output))


def newton_schulz(x: jax.Array, dims: MuonDimensionNumbers, coeffs: Any, steps: int,
                  dtype: jnp.dtype = jnp.float32) -> jax.Array:
  """Each [fan_in, fan_out] matrix of `x` (the dims not named in `dims` are batch dims) orthogonalised:
  X = M / (|M|_F + 1e-8), transposed to be wide, then `steps` times X <- aX + (bA + cA^2)X, A = XX^T,
  the iteration in `dtype` (the norm in float32). Returns x's shape and dtype."""
  order, (m, i, o) = _matrix_view(x.shape, dims)
  x_MIO = jnp.transpose(x, order).reshape(m, i, o).astype(jnp.float32)
  wide = x_MIO if i <= o else jnp.swapaxes(x_MIO, 1, 2)  # the Gram matrix is the smaller side's square
  wide = wide / (jnp.linalg.norm(wide, axis=(1, 2), keepdims=True) + _EPS)
  a, b, c = (jnp.asarray(coeffs, dtype)[k] for k in range(3))
  w = wide.astype(dtype)
  for _ in range(steps):
    gram = jnp.einsum("mij,mkj->mik", w, w)
    w = a * w + jnp.einsum("mik,mkj->mij", b * gram + c * jnp.einsum("mik,mkl->mil", gram, gram), w)
  y_MIO = (w if i <= o else jnp.swapaxes(w, 1, 2)).astype(x.dtype)
  inverse = sorted(range(x.ndim), key=lambda k: order[k])
  return y_MIO.reshape(tuple(x.shape[k] for k in order)).transpose(inverse)


def orthogonalize(x: jax.Array, dims: MuonDimensionNumbers, logical: tuple[str | None, ...] | None, coeffs: Any,
                  steps: int, dtype: jnp.dtype, parallel: Parallel = NONE) -> jax.Array:
  """`newton_schulz`, with whole layers per device when `x` is a stacked weight (its logical names
  start with `layers`) and `parallel`'s rules (the model's, passed to the update by program/update.py) split
  `opt_layers`: resharded to layers over the axes
  `sharding.rules.layer_split` picks (under a pipeline each stage orthogonalises its own layers; zero layers
  pad a stage's block only where that shortens the work per device), orthogonalised locally, resharded back
  to `logical`. Otherwise (an unstacked weight, one device) GSPMD partitions the iteration over the parameter's own
  layout, which all-gathers the matrix dims at every iteration."""
  split = parallel.layer_split(x.shape[0]) if logical is not None and logical[:1] == ("layers",) else None
  if split is None:
    return newton_schulz(x, dims, coeffs, steps, dtype)
  num_layers, out_dtype = x.shape[0], x.dtype
  per_group = num_layers // split.groups
  pad = split.per_group - per_group  # zero layers (they stay zero) at the end of each stage's own block
  if jnp.dtype(dtype).itemsize < x.dtype.itemsize:  # the all-to-alls move the iteration's narrower dtype
    x = x.astype(dtype)
  if pad:
    x = x.reshape(split.groups, per_group, *x.shape[1:])
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)).reshape(-1, *x.shape[2:])
  y = newton_schulz(sharding_rules.constrain_layers(x, split), dims, coeffs, steps, dtype)
  if pad:
    y = y.reshape(split.groups, split.per_group, *y.shape[1:])[:, :per_group].reshape(num_layers, *y.shape[1:])
  return parallel.constrain(y, logical).astype(out_dtype)


def nesterov_input(mu: Any, grads: Any, beta: float, count: jax.Array) -> Any:
  """What Newton-Schulz orthogonalises at step `count` (1, 2, ...): beta M_t / (1 - beta^(t+1)) +
  (1 - beta) G_t / (1 - beta^t), optax's bias-corrected Nesterov momentum."""
  return jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                      optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                      optax.tree.bias_correction(grads, beta, count))


def logical_names(tree: Any) -> dict[str, tuple[str | None, ...]]:
  """Parameter name -> its logical axis names, for the leaves that carry them (nnx Variables)."""
  is_var = lambda x: isinstance(x, nnx.Variable)
  return {param_name(path): tuple(v.get_metadata()["out_sharding"])
          for path, v in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_var)
          if is_var(v) and v.get_metadata().get("out_sharding")}


def scale_by_muon_guarded(*, ns_coeffs: tuple[float, float, float], ns_steps: int, beta: float, mu_dtype: Any,
                          ns_dtype: str, matrix_dims: Callable[[tuple], MuonDimensionNumbers]
                          ) -> optax.GradientTransformationExtraArgs:
  """Muon's orthogonalised update of each leaf (`matrix_dims(logical axes)`: how it is a matrix) from its
  Nesterov momentum; `skip` (a bool scalar) keeps momentum and count as they were."""
  dtype = jnp.dtype(ns_dtype)

  def init(params):
    return MuonState(count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params, dtype=mu_dtype),
                     ns_coeffs=jnp.asarray(ns_coeffs))

  def update(updates, state, params=None, *, skip=None, parallel: Parallel = NONE, **extra_args):
    del params, extra_args
    mu = optax.tree.update_moment(updates, state.mu, beta, 1)
    count = optax.safe_increment(state.count)
    kept_count = count
    if skip is not None:
      mu, kept_count = keep_if(skip, state.mu, mu), jnp.where(skip, state.count, count)
    names = logical_names(updates)
    ortho = jax.tree_util.tree_map_with_path(
        lambda path, x: orthogonalize(x, matrix_dims(names[param_name(path)]), names[param_name(path)],
                                      state.ns_coeffs, ns_steps, dtype, parallel),
        nesterov_input(mu, updates, beta, count))
    return ortho, MuonState(count=kept_count, mu=optax.tree.cast(mu, mu_dtype), ns_coeffs=state.ns_coeffs)

  return optax.GradientTransformationExtraArgs(init, update)
