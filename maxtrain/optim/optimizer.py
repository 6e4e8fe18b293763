"""Optimizers (AdamW, Muon), learning-rate schedules and weight-decay masks, on optax.

Routing is decided by one function, `param_labels`: every parameter leaf is labelled `muon` or
`adam`, and `optax.partition` applies one transformation per label. Muon (momentum orthogonalised
by Newton-Schulz, maxtrain/optim/muon.py: optax.contrib.scale_by_muon's math) is for hidden weight matrices only; embeddings,
the output head, norm scales and biases stay on AdamW. Parameters are classified by their logical axes
(`param_kind`), never by name, and a parameter no rule classifies is an error rather than a silent fallback
to Adam: with scanned layers every hidden matrix is 3-D or 4-D, and optax's default (Muon for 2-D
leaves only) would send all of them to Adam and the 2-D embedding and head to Muon.

The Muon update of one hidden matrix W, viewed as [fan_in, fan_out] (a scanned weight: each
layer's slice on its own), with gradient G_t at step t = 1, 2, ... (maxtrain/optim/muon.py, then
`_scale_by_shape`, decoupled weight decay and the learning rate):

  M_t = beta M_{t-1} + (1 - beta) G_t                                       momentum
  Mh  = beta M_t / (1 - beta^(t+1)) + (1 - beta) G_t / (1 - beta^t)          Nesterov, bias-corrected
  X   = Mh / (|Mh|_F + 1e-8), transposed to be wide; muon_ns_steps times: X <- aX + (bA + cA^2)X, A = XX^T
        (the iteration in muon_ns_dtype)
  W  <- W - lr_t (s X + weight_decay W),  s = sqrt(max(1, fan_out / fan_in))
        (or s = muon_consistent_rms * sqrt(max(fan_in, fan_out)) when that is > 0)

Shape legend: L layers (scanned models only), D model, N heads, K kv heads, H head dim, F ffn.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from maxtrain.config import schema
from maxtrain.errors import choice, require
from maxtrain.optim import offload as offload_lib
from maxtrain.optim.masking import keep_if
from maxtrain.optim.muon import NS_DTYPES, scale_by_muon_guarded
from maxtrain.sharding.layout import param_name

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd", "constant")
WSD_DECAYS = ("linear", "cosine")
STATE_DTYPES = ("float32", "bfloat16")
# What param_kind returns. `router`: a MoE router (AdamW: Muon's orthogonalisation would equalise the
# experts' logit scales, which is the router's whole job); `state`: a non-gradient variable the step
# sets itself (the MoE router bias), left alone by the optimizer (no moments, no decay).
PARAM_KINDS = ("embed", "head", "norm", "bias", "matrix", "router", "state")

# Routing follows each parameter's logical axes (its annotations in models/), never its name, so a new
# family or piece needs no edit here. Leading axes Muon treats as batch axes: each layer's (each expert's)
# matrix is orthogonalised on its own.
_BATCH_AXES = ("layers", "experts")
# the residual stream: a hidden matrix reads or writes it (and an MLA latent, which its up-projections read)
_EMBED_AXES = ("embed", "expert_embed", "lora_in")


def _core(axes: tuple[str | None, ...]) -> tuple[str | None, ...]:
  """The axes without the leading batch axes: ('layers', 'embed', 'heads', 'head_dim') -> the last three."""
  i = 0
  while i < len(axes) - 1 and axes[i] in _BATCH_AXES:
    i += 1
  return axes[i:]


def param_kind(name: str, axes: tuple[str | None, ...] | None, is_param: bool = True) -> str:
  """One of PARAM_KINDS for the parameter `name` from its logical axes: a variable that is not an
  nnx.Param is `state`; a `vocab` axis makes the embedding (first) or the head (last); `norm` a norm
  scale; `router_experts` a MoE router; a matrix reading or writing the residual stream (`embed` first
  or last, with other axes) a Muon `matrix`; anything else without `embed` (q/k/v biases) a `bias`."""
  if not is_param:
    return "state"
  if not axes:
    raise ValueError(f"parameter {name} has no logical axes (models/layers.param gives every parameter its "
                     "names): the optimizer routes by them")
  core = _core(axes)
  if "vocab" in core:
    return "embed" if core[0] == "vocab" else "head"
  if "norm" in core:
    return "norm"
  if "router_experts" in core:
    return "router"
  if len(core) >= 2 and (core[0] in _EMBED_AXES or core[-1] in _EMBED_AXES):
    return "matrix"
  if not any(a in _EMBED_AXES for a in core) or len(core) == 1:  # a vector along the residual: o's or an expert's bias
    return "bias"
  raise ValueError(f"parameter {name} has logical axes {axes}, which route to no optimizer group: a hidden "
                   "matrix has an embed axis first (it reads the residual stream) or last (it writes it)")


def matrix_dimension_numbers(axes: tuple[str | None, ...]) -> MuonDimensionNumbers:
  """How Muon sees a hidden matrix with these logical axes as [fan_in, fan_out]: the embed axis on one
  side, the rest of its non-batch axes on the other. Axes are negative, so the same numbers hold with and
  without the leading batch axes (`layers`, `experts`)."""
  if isinstance(axes, str):
    raise TypeError(f"matrix_dimension_numbers takes a parameter's logical axes, not a name ({axes!r})")
  n = len(_core(axes))
  rest = tuple(range(-n + 1, 0)) if _core(axes)[0] in _EMBED_AXES else tuple(range(-n, -1))
  rest = rest[0] if len(rest) == 1 else rest
  if _core(axes)[0] in _EMBED_AXES:
    return MuonDimensionNumbers(reduction_axis=-n, output_axis=rest)
  return MuonDimensionNumbers(reduction_axis=rest, output_axis=-1)


def _variables(tree: Any) -> dict[str, tuple[tuple[str | None, ...] | None, bool]]:
  """Parameter name -> (its logical axes, whether it is an nnx.Param), for the nnx Variables of `tree`."""
  is_var = lambda x: isinstance(x, nnx.Variable)
  return {param_name(path): (tuple(v.get_metadata().get("out_sharding") or ()) or None, isinstance(v, nnx.Param))
          for path, v in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_var) if is_var(v)}


def _map_named(fn: Callable[[str, Any], Any], tree: Any) -> Any:
  """Maps fn(name, leaf) over parameter leaves. Leaves another optax.partition group owns are
  MaskedNodes, which have no leaves, so they pass through untouched."""
  return jax.tree_util.tree_map_with_path(lambda path, leaf: fn(param_name(path), leaf), tree)


def _map_kinds(fn: Callable[[str, Any], Any], tree: Any) -> Any:
  """Maps fn(kind, leaf) over parameter leaves (param_kind from each leaf's Variable)."""
  variables = _variables(tree)
  return _map_named(lambda name, leaf: fn(param_kind(name, *variables.get(name, (None, True))), leaf), tree)


def param_labels(params: Any, optimizer_name: str) -> Any:
  """The routing: a tree like `params` of 'muon' (hidden matrices, when optimizer_name is muon),
  'none' (non-gradient state, never updated by the optimizer) or 'adam' (everything else)."""
  def label(kind: str, leaf) -> str:
    if kind == "state":
      return "none"
    return "muon" if optimizer_name == "muon" and kind == "matrix" else "adam"

  return _map_kinds(label, params)


def decay_mask(no_decay: str) -> Callable[[Any], Any]:
  """Weight decay on every parameter whose kind is not listed in `no_decay` ('embed,norm,bias')."""
  excluded = {kind.strip() for kind in no_decay.split(",") if kind.strip()}
  return lambda params: _map_kinds(lambda kind, leaf: kind not in excluded, params)


def lr_multiplier(opt_cfg: schema.Optimizer, total_steps: int) -> optax.Schedule:
  """Schedule shape in [0, 1], shared by every parameter group (each scales its own peak lr).

  Warmup: step / warmup_steps (optax's convention: 0 at step 0, the peak at step warmup_steps). Then
    cosine:   min + (1 - min) (1 + cos(pi p)) / 2, p = (step - warmup) / (total - warmup);
    wsd:      1 until the last `decay_fraction` of steps, then linear (1 - (1 - min) p) or cosine
              decay with p over those steps;
    constant: 1.
  `min` is min_lr_ratio; p is clipped to [0, 1].
  """
  warmup, floor = opt_cfg.warmup_steps, opt_cfg.min_lr_ratio
  decay_steps = max(round(opt_cfg.decay_fraction * total_steps), 1)
  decay_start = total_steps - decay_steps

  def cosine(p):
    return floor + (1.0 - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * p))

  def multiplier(step):
    step = jnp.asarray(step, jnp.float32)
    warm = step / max(warmup, 1)
    if opt_cfg.schedule == "cosine":
      after = cosine(jnp.clip((step - warmup) / max(total_steps - warmup, 1), 0.0, 1.0))
    elif opt_cfg.schedule == "wsd":
      p = jnp.clip((step - decay_start) / decay_steps, 0.0, 1.0)
      after = cosine(p) if opt_cfg.wsd_decay == "cosine" else 1.0 - (1.0 - floor) * p
    else:
      after = jnp.ones_like(step)
    return jnp.where(step < warmup, warm, after)

  return multiplier


def _scale_by_shape(consistent_rms: float) -> optax.GradientTransformation:
  """Muon's shape scaling of the orthogonalised update, per matrix (fan_in = product of the
  reduction dims, fan_out of the output dims): sqrt(max(1, fan_out / fan_in)) (Jordan's Muon), or
  consistent_rms * sqrt(max(fan_in, fan_out)) when consistent_rms > 0 (update RMS ~ AdamW's; Liu
  et al. 2025). Written here because optax exports scale_by_muon but not its scaling step."""
  def scale(dims: MuonDimensionNumbers, u: jax.Array) -> jax.Array:
    axes = lambda a: (a,) if isinstance(a, int) else a
    fan_in = math.prod(u.shape[a] for a in axes(dims.reduction_axis))
    fan_out = math.prod(u.shape[a] for a in axes(dims.output_axis))
    if consistent_rms > 0:
      return u * (consistent_rms * math.sqrt(max(fan_in, fan_out)))
    return u * math.sqrt(max(1.0, fan_out / fan_in))

  def update(updates, state, params=None):
    del params
    variables = _variables(updates)
    return _map_named(lambda name, u: scale(matrix_dimension_numbers(variables[name][0]), u), updates), state

  return optax.GradientTransformation(optax.init_empty_state, update)


def _partition_used(transforms: dict[str, optax.GradientTransformation], labels: Callable) -> optax.GradientTransformationExtraArgs:
  """optax.partition without the `none` group when no parameter has that label. Why: partition keeps
  a (masked, empty) state for every group, and that extra node changed a dense model's optimizer-state
  tree, so checkpoints saved before MoE existed no longer restored."""
  def partition(tree: Any) -> optax.GradientTransformationExtraArgs:
    used = set(jax.tree.leaves(labels(tree)))
    return optax.partition({k: t for k, t in transforms.items() if k != "none" or k in used}, labels)

  def update(updates, state, params=None, **extra):
    return partition(updates).update(updates, state, params, **extra)

  return optax.GradientTransformationExtraArgs(lambda params: partition(params).init(params), update)


def _init_state_in(tx: optax.GradientTransformationExtraArgs, dtype) -> optax.GradientTransformationExtraArgs:
  """Creates the optimizer state from params cast to `dtype`: Adam's second moment takes the
  params' dtype (optax has no nu_dtype), and both moments then keep it across updates."""
  return optax.GradientTransformationExtraArgs(lambda params: tx.init(optax.tree.cast(params, dtype)), tx.update)


# The guard (maxtrain/program/guards.py) skips an update by passing `skip` (a bool scalar) to `tx.update`:
# every stateful transform keeps its state exactly as it was, so a skipped step leaves the optimizer
# bit-identical. The select sits inside each transform rather than after the whole update because
# Adam's update is computed from its new moments: selecting afterwards keeps old and new moments
# alive together (one more copy of the moments per device); computing the update from the selected
# moments lets XLA update them in place.


def guarded(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """`tx` whose state stays as it was when `skip` is true (its update is then discarded)."""
  def update(updates, state, params=None, *, skip=None, **extra_args):
    del extra_args
    updates, new_state = tx.update(updates, state, params)
    return updates, new_state if skip is None else keep_if(skip, state, new_state)

  return optax.GradientTransformationExtraArgs(tx.init, update)


def scale_by_adam_guarded(b1: float, b2: float, eps: float, mu_dtype: Any = None) -> optax.GradientTransformationExtraArgs:
  """`optax.scale_by_adam` (same state tree, same formulas; XLA may round differently in a different
  program, tests/test_optim.py) with the guard's select applied to the new moments before the
  update is computed from them (see above)."""
  adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps, mu_dtype=mu_dtype)

  def update(updates, state, params=None, *, skip=None, **extra_args):
    del extra_args
    if skip is None:
      return adam.update(updates, state, params)
    mu = keep_if(skip, state.mu, optax.tree.update_moment(updates, state.mu, b1, 1))
    nu = keep_if(skip, state.nu, optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2))
    count = jnp.where(skip, state.count, optax.safe_increment(state.count))
    mu_hat, nu_hat = optax.tree.bias_correction(mu, b1, count), optax.tree.bias_correction(nu, b2, count)
    updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + 0.0) + eps), mu_hat, nu_hat)  # + optax's eps_root=0
    return updates, optax.ScaleByAdamState(count=count, mu=optax.tree.cast(mu, mu_dtype),
                                           nu=optax.tree.cast_like(nu, state.nu))

  return optax.GradientTransformationExtraArgs(adam.init, update)


@dataclasses.dataclass(frozen=True)
class Optimizer:
  tx: optax.GradientTransformation
  learning_rates: dict[str, optax.Schedule]  # metric name ('lr', 'adam_lr') -> lr at a step
  labels: Callable[[Any], Any]  # params -> tree of 'muon' / 'adam'


def validate(o: schema.Optimizer) -> None:
  """UserError naming the key for a bad `config.optimizer` (the warmup against the schedule: config/sections.py,
  at load)."""
  choice("optimizer.name", o.name, OPTIMIZERS)
  choice("optimizer.schedule", o.schedule, SCHEDULES)
  choice("optimizer.wsd_decay", o.wsd_decay, WSD_DECAYS)
  choice("optimizer.state_dtype", o.state_dtype, STATE_DTYPES)
  offload_lib.validate(o)
  for key in ("lr", "adam_lr"):
    require(o[key] > 0, f"config.optimizer.{key}={o[key]}: a learning rate must be > 0 (the peak of the schedule)")
  require(o.warmup_steps >= 0, f"config.optimizer.warmup_steps={o.warmup_steps}: must be >= 0")
  for key in ("b1", "b2"):
    require(0 <= o[key] < 1, f"config.optimizer.{key}={o[key]}: an Adam moment decay must be in [0, 1) "
            "(1 never forgets the first gradient; >= 1 diverges)")
  require(o.eps > 0, f"config.optimizer.eps={o.eps}: must be > 0 (Adam divides by sqrt(nu) + eps)")
  require(0 <= o.min_lr_ratio <= 1, f"config.optimizer.min_lr_ratio={o.min_lr_ratio}: must be in [0, 1]")
  require(0 < o.decay_fraction <= 1, f"config.optimizer.decay_fraction={o.decay_fraction}: must be in (0, 1]")
  for key in ("weight_decay", "clip_norm", "z_loss"):
    require(o[key] >= 0, f"config.optimizer.{key}={o[key]}: must be >= 0 (0 disables)")
  unknown = [k for k in (k.strip() for k in o.no_decay.split(",")) if k and k not in PARAM_KINDS]
  require(not unknown, f"config.optimizer.no_decay={o.no_decay!r}: {', '.join(map(repr, unknown))} is not a "
          f"parameter kind; list some of {', '.join(PARAM_KINDS)}, comma-separated (empty: decay everything)")
  require(0 <= o.muon_momentum < 1, f"config.optimizer.muon_momentum={o.muon_momentum}: must be in [0, 1)")
  require(o.muon_ns_steps >= 1, f"config.optimizer.muon_ns_steps={o.muon_ns_steps}: must be >= 1")
  try:
    three_numbers = len([float(c) for c in o.muon_ns_coeffs.split(",")]) == 3
  except ValueError:
    three_numbers = False
  require(three_numbers, f"config.optimizer.muon_ns_coeffs={o.muon_ns_coeffs!r}: expected three numbers 'a,b,c', "
           "e.g. '3.4445,-4.7750,2.0315'")
  choice("optimizer.muon_ns_dtype", o.muon_ns_dtype, NS_DTYPES)
  require(o.muon_consistent_rms >= 0,
           f"config.optimizer.muon_consistent_rms={o.muon_consistent_rms}: must be >= 0 (0: width scaling)")


def make(opt_cfg: schema.Optimizer, total_steps: int) -> Optimizer:
  """The optimizer of a validated `config.optimizer` for a run of `total_steps`."""
  multiplier = lr_multiplier(opt_cfg, total_steps)
  lr = lambda step: opt_cfg.lr * multiplier(step)
  state_dtype = jnp.dtype(opt_cfg.state_dtype)
  mask = decay_mask(opt_cfg.no_decay)
  labels = lambda params: param_labels(params, opt_cfg.name)
  learning_rates = {"lr": lr}
  transforms = {}
  if opt_cfg.name == "muon":
    adam_lr = lambda step: opt_cfg.adam_lr * multiplier(step)
    learning_rates["adam_lr"] = adam_lr
    # optax.contrib.scale_by_muon's math and state tree, with the guard's select inside (maxtrain/optim/muon.py).
    transforms["muon"] = optax.chain(
        scale_by_muon_guarded(ns_coeffs=parse_ns_coeffs(opt_cfg.muon_ns_coeffs), ns_steps=opt_cfg.muon_ns_steps,
                              beta=opt_cfg.muon_momentum, mu_dtype=state_dtype, ns_dtype=opt_cfg.muon_ns_dtype,
                              matrix_dims=matrix_dimension_numbers),
        _scale_by_shape(opt_cfg.muon_consistent_rms),
        optax.add_decayed_weights(opt_cfg.weight_decay, mask),
        guarded(optax.scale_by_learning_rate(lr)),
    )
  else:
    adam_lr = lr
  # optax.adamw's chain, with the guard inside its stateful parts (same state tree as optax.adamw).
  transforms["adam"] = optax.chain(
      scale_by_adam_guarded(b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps, mu_dtype=state_dtype),
      optax.add_decayed_weights(opt_cfg.weight_decay, mask),  # stateless
      guarded(optax.scale_by_learning_rate(adam_lr)),  # its count is the schedule's step
  )
  transforms["none"] = optax.set_to_zero()  # non-gradient state (MoE router bias): never moved by the optimizer
  parts = [optax.clip_by_global_norm(opt_cfg.clip_norm)] if opt_cfg.clip_norm > 0 else []
  tx = _init_state_in(optax.chain(*parts, _partition_used(transforms, labels)), state_dtype)
  if offload_lib.enabled(opt_cfg):  # the moments live in host memory; on the device for the update only
    tx = offload_lib.streamed(tx, opt_cfg.offload_groups)
  return Optimizer(tx=tx, learning_rates=learning_rates, labels=labels)


def parse_ns_coeffs(text: str) -> tuple[float, float, float]:
  """'a,b,c' -> (a, b, c) of the quintic Newton-Schulz step X <- a X + (b A + c A^2) X, A = X X^T."""
  a, b, c = (float(x) for x in text.split(","))
  return a, b, c


def update_norms(updates: Any, labels: Any) -> dict[str, jax.Array]:
  """Global norm of the applied update per group: {'update_norm/muon': ..., 'update_norm/adam': ...}."""
  squares: dict[str, jax.Array] = {}
  for u, label in zip(jax.tree.leaves(updates), jax.tree.leaves(labels)):
    if label == "none":  # always zero
      continue
    squares[label] = squares.get(label, 0.0) + jnp.sum(jnp.square(u.astype(jnp.float32)))
  return {f"update_norm/{label}": jnp.sqrt(sq) for label, sq in sorted(squares.items())}


def describe_groups(params: Any, labels: Any) -> str:
  """'muon: 7 tensors, 3.15M params; adam: 5 tensors, 0.20M params' for the start-up log."""
  counts: dict[str, list[int]] = {}
  for p, label in zip(jax.tree.leaves(params), jax.tree.leaves(labels)):
    tensors_size = counts.setdefault(label, [0, 0])
    tensors_size[0] += 1
    tensors_size[1] += p.size
  return "; ".join(f"{label}: {n} tensors, {size / 1e6:.2f}M params" for label, (n, size) in sorted(counts.items()))
