"""Mixture-of-experts feed-forward block (`model.moe.*`): a router sends each token to
`experts_per_token` of `num_experts` SwiGLU experts and mixes their outputs; optional shared experts
see every token. `models/decoder.py` uses it in place of the dense MLP in every layer after the first
`first_dense_layers`.

Shape legend: B batch, T length, D model, E routed experts, K experts per token, F expert hidden width,
L MoE layers.

Router (fp32 whatever the compute dtype: the top-k choice must not flip on bf16 rounding):
  logits = x @ router;  softmax router: scores = softmax(logits) (Mixtral);
                        sigmoid router: scores = sigmoid(logits) (DeepSeek-V3).
  The top-k experts by scores + bias (the bias only chooses, it never weighs); the weights are the
  chosen scores normalised to sum 1 (Mixtral's renormalised softmax; DeepSeek-V3's normalised sigmoid),
  or the chosen scores as they are with `norm_topk_prob=False` (Qwen-MoE's option).
Losses, per layer, over the layer's B x T tokens (reported apart from the LM loss, added to it with
their weights; the step averages them over MoE layers, `step.py`):
  aux    = E x sum_e f_e P_e (Switch/GShard): f_e = share of the B x T x K assignments routed to e (no
           gradient), P_e = mean over tokens of e's normalised score (scores / their sum). 1 when balanced.
  z-loss = mean over tokens of logsumexp(logits)^2 (ST-MoE): keeps router logits small.
Aux-loss-free balancing (DeepSeek-V3): `router_bias` is a non-gradient variable the step moves after
each update by `bias_update_rate` x sign(mean load - load_e) from the measured per-expert load
(`update_router_bias`); it is part of the model state, hence checkpointed and restored with it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.config.keys import check_known
from maxtrain.errors import choice, require
from maxtrain.models import moe_dispatch
from maxtrain.models.layers import MLP, param
from maxtrain.sharding import expert_dispatch, ragged_dispatch
from maxtrain.sharding.layout import param_name
from maxtrain.sharding.rules import NONE, Parallel

ROUTERS = ("softmax", "sigmoid")
ACTIVATIONS = ("swiglu", "clamped_swiglu")
DISPATCHES = ("capacity", "dropless")
# Per-layer statistics a MoE layer returns (each [L] or [L, E] once stacked over layers). All but aux
# and z are sums over tokens, so microbatches add them up; aux and z are the layer's means.
# capacity_needed: the capacity_factor capacity dispatch would need to drop nothing (a max, not a sum);
# a2a_bytes: what the layer's expert-parallel all-to-alls send between devices (ragged_dispatch.py).
STATS = ("aux", "z", "load", "dropped", "assignments", "capacity_needed", "a2a_bytes")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  num_experts: int = 0
  experts_per_token: int = 2
  num_shared_experts: int = 0
  expert_d_ff: int = 256
  first_dense_layers: int = 0
  router: str = "softmax"
  norm_topk_prob: bool = True  # the chosen scores renormalised to sum 1 (False: Qwen-MoE's raw softmax shares)
  dispatch: str = "capacity"
  capacity_factor: float = 1.25
  aux_loss_weight: float = 0.01
  router_z_loss_weight: float = 0.001
  bias_update_rate: float = 0.0
  collapse_entropy: float = 0.5
  collapse_steps: int = 100
  # GPT-OSS's experts: clamped_swiglu = (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit),
  # over one fused weight gate_up [E, D, 2F] whose columns interleave gate (even) and up (odd), as its checkpoints
  # hold it; expert_bias: a learned bias on the router's logits and on every expert's two matmuls.
  # DeepSeek-V3: experts in n_group groups, a token's top-k only from its topk_group best groups (a group's
  # score: the sum of its two best choice scores); the routed output's weights times routed_scaling_factor.
  n_group: int = 1
  topk_group: int = 1
  routed_scaling_factor: float = 1.0
  activation: str = "swiglu"
  expert_bias: bool = False
  swiglu_alpha: float = 1.702
  swiglu_limit: float = 7.0

  @property
  def enabled(self) -> bool:
    return self.num_experts > 0

  def num_moe_layers(self, num_layers: int) -> int:
    return num_layers - self.first_dense_layers if self.enabled else 0

  def capacity(self, seq_len: int) -> int:
    """Slots per expert per sequence: ceil(capacity_factor x T x K / E), at most T (a token takes an
    expert at most once)."""
    return min(seq_len, math.ceil(self.capacity_factor * seq_len * self.experts_per_token / self.num_experts))

  @classmethod
  def from_config(cls, moe_cfg: Any) -> "MoEConfig":
    check_known(moe_cfg, "model.moe")  # a UserError naming the key, not a TypeError
    return cls(**dict(moe_cfg.items()))


def validate(m: Any) -> None:
  """UserError naming the key for a bad `config.model.moe` (m: the `config.model` section)."""
  e = m.moe
  require(e.num_experts >= 0, f"config.model.moe.num_experts={e.num_experts}: must be >= 0 (0 = dense)")
  if not e.num_experts:
    return
  require(1 <= e.experts_per_token <= e.num_experts, f"config.model.moe.experts_per_token={e.experts_per_token}: "
          f"must be in 1..model.moe.num_experts={e.num_experts}")
  require(e.num_shared_experts >= 0, f"config.model.moe.num_shared_experts={e.num_shared_experts}: must be >= 0")
  require(e.expert_d_ff > 0, f"config.model.moe.expert_d_ff={e.expert_d_ff}: must be > 0")
  require(0 <= e.first_dense_layers < m.num_layers, f"config.model.moe.first_dense_layers={e.first_dense_layers}: "
          f"must be in 0..model.num_layers-1={m.num_layers - 1} (some layer must be a MoE layer)")
  choice("model.moe.router", e.router, ROUTERS)
  choice("model.moe.dispatch", e.dispatch, DISPATCHES)
  require(e.capacity_factor > 0, f"config.model.moe.capacity_factor={e.capacity_factor}: must be > 0")
  for key in ("aux_loss_weight", "router_z_loss_weight", "bias_update_rate", "collapse_entropy", "collapse_steps"):
    require(e[key] >= 0, f"config.model.moe.{key}={e[key]}: must be >= 0 (0 = off)")
  n_group, topk_group = e.get("n_group", 1), e.get("topk_group", 1)
  require(n_group >= 1 and e.num_experts % n_group == 0 and 1 <= topk_group <= n_group
          and (n_group == 1 or e.num_experts // n_group >= 2),
          f"config.model.moe.n_group={n_group}, topk_group={topk_group}: n_group must divide model.moe.num_experts="
          f"{e.num_experts} into groups of >= 2 experts, and 1 <= topk_group <= n_group")
  require(e.get("routed_scaling_factor", 1.0) > 0,
          f"config.model.moe.routed_scaling_factor={e.get('routed_scaling_factor')}: must be > 0")
  choice("model.moe.activation", e.get("activation", "swiglu"), ACTIVATIONS)
  fused = e.get("activation", "swiglu") == "clamped_swiglu"
  require(not e.get("expert_bias") or fused, "config.model.moe.expert_bias=True needs model.moe.activation="
          "clamped_swiglu (the fused gate_up layout that GPT-OSS's biased experts use)")
  require(not fused or e.dispatch == "dropless", f"config.model.moe.activation=clamped_swiglu runs with "
          f"model.moe.dispatch=dropless only (found {e.dispatch})")
  require(not fused or (e.swiglu_alpha > 0 and e.swiglu_limit > 0), f"config.model.moe.swiglu_alpha="
          f"{e.get('swiglu_alpha')}, swiglu_limit={e.get('swiglu_limit')}: both must be > 0")
  require(e.collapse_entropy <= 1, f"config.model.moe.collapse_entropy={e.collapse_entropy}: a share of the "
          "maximum entropy log(num_experts), in [0, 1]")


class RouterBias(nnx.Variable):
  """The aux-loss-free balancing bias [E]: model state the optimizer never touches (no gradient);
  the step sets it from the measured load."""


def route(x_BTD: jax.Array, router_DE: jax.Array, bias_E: jax.Array, cfg: MoEConfig,
          logit_bias_E: jax.Array | None = None) -> tuple[jax.Array, jax.Array, dict]:
  """(experts_BTK int32, weights_BTK fp32, {aux, z, load_E, assignments}) of the router, in fp32.
  `logit_bias_E`: a learned bias on the logits (GPT-OSS), unlike `bias_E`, which only chooses."""
  logits_BTE = jnp.einsum("btd,de->bte", x_BTD.astype(jnp.float32), router_DE.astype(jnp.float32),
                          preferred_element_type=jnp.float32)
  if logit_bias_E is not None:
    logits_BTE = logits_BTE + logit_bias_E.astype(jnp.float32)
  scores_BTE = jax.nn.softmax(logits_BTE, axis=-1) if cfg.router == "softmax" else jax.nn.sigmoid(logits_BTE)
  choice_BTE = scores_BTE + jax.lax.stop_gradient(bias_E)
  if cfg.n_group > 1:  # group-limited: only the experts of each token's topk_group best groups compete
    grouped_BTGe = choice_BTE.reshape(*choice_BTE.shape[:-1], cfg.n_group, -1)
    group_BTG = jnp.sum(jax.lax.top_k(grouped_BTGe, 2)[0], axis=-1)
    _, best_BTg = jax.lax.top_k(group_BTG, cfg.topk_group)
    keep_BTG = jnp.sum(jax.nn.one_hot(best_BTg, cfg.n_group, dtype=jnp.bool_), axis=-2) > 0
    choice_BTE = jnp.where(keep_BTG[..., None], grouped_BTGe, -jnp.inf).reshape(choice_BTE.shape)
  _, experts_BTK = jax.lax.top_k(choice_BTE, cfg.experts_per_token)
  chosen_BTK = jnp.take_along_axis(scores_BTE, experts_BTK, axis=-1)
  weights_BTK = chosen_BTK / jnp.sum(chosen_BTK, axis=-1, keepdims=True) if cfg.norm_topk_prob else chosen_BTK
  if cfg.routed_scaling_factor != 1.0:
    weights_BTK = weights_BTK * cfg.routed_scaling_factor
  load_E = jnp.sum(jax.nn.one_hot(experts_BTK, cfg.num_experts, dtype=jnp.float32), axis=(0, 1, 2))
  assignments = jnp.float32(experts_BTK.size)
  probs_BTE = scores_BTE / jnp.sum(scores_BTE, axis=-1, keepdims=True)  # the softmax's own for softmax
  aux = cfg.num_experts * jnp.sum(load_E / assignments * jnp.mean(probs_BTE, axis=(0, 1)))
  z = jnp.mean(jnp.square(jax.nn.logsumexp(logits_BTE, axis=-1)))
  # Capacity slots are per sequence (moe_dispatch.py): the fullest (sequence, expert) queue sets the capacity
  # that drops nothing, C = max load = capacity_factor x T x K / E.
  T, K = experts_BTK.shape[1:]
  seq_load_BE = jnp.sum(jax.nn.one_hot(experts_BTK, cfg.num_experts, dtype=jnp.float32), axis=(1, 2))
  needed = jnp.max(seq_load_BE) * cfg.num_experts / (T * K)
  return experts_BTK.astype(jnp.int32), weights_BTK, {"aux": aux, "z": z, "load": load_E, "assignments": assignments,
                                                      "capacity_needed": needed}


class MoE(nnx.Module):
  def __init__(self, d_model: int, cfg: MoEConfig, *, init_std: float, out_std: float, param_dtype, compute_dtype,
               rngs: nnx.Rngs, quant=None, shared_quant=None, balanced_standin: bool = False,
               parallel: Parallel = NONE):
    E, F = cfg.num_experts, cfg.expert_d_ff
    init, out_init = nnx.initializers.normal(init_std), nnx.initializers.normal(out_std)
    self.cfg, self.compute_dtype, self.parallel = cfg, compute_dtype, parallel
    # Dropless: lax.ragged_dot, or its memory stand-in for ahead-of-time compiles on XLA:CPU (program/fit.py).
    self.balanced_standin = balanced_standin
    self.quant = quant  # models/quant.py Quant of the routed experts' matmuls (capacity dispatch), or None
    self.router = param(rngs, init, (d_model, E), ("embed", "router_experts"), param_dtype)
    # fp32 whatever param_dtype: sign steps of 1e-3 would vanish in bf16 next to an O(1) bias.
    self.router_bias = RouterBias(jnp.zeros((E,), jnp.float32), out_sharding=("router_experts",))
    self.fused = cfg.activation == "clamped_swiglu"
    if self.fused:
      self.gate_up = param(rngs, init, (E, d_model, 2 * F), ("experts", "expert_embed", "expert_mlp"), param_dtype)
    else:
      self.gate = param(rngs, init, (E, d_model, F), ("experts", "expert_embed", "expert_mlp"), param_dtype)
      self.up = param(rngs, init, (E, d_model, F), ("experts", "expert_embed", "expert_mlp"), param_dtype)
    if cfg.expert_bias:
      zeros = nnx.initializers.zeros
      self.router_b = param(rngs, zeros, (E,), ("router_experts",), param_dtype)
      self.gate_up_b = param(rngs, zeros, (E, 2 * F), ("experts", "expert_mlp"), param_dtype)
      self.down_b = param(rngs, zeros, (E, d_model), ("experts", "expert_embed"), param_dtype)
    self.down = param(rngs, out_init, (E, F, d_model), ("experts", "expert_mlp", "expert_embed"), param_dtype)
    if cfg.num_shared_experts:
      self.shared = MLP(d_model, cfg.num_shared_experts * F, init_std=init_std, out_std=out_std,
                        param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs, quant=shared_quant,
                        parallel=parallel)

  def __call__(self, x_BTD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(output [B, T, D] in the compute dtype, this layer's STATS)."""
    cfg, dt = self.cfg, self.compute_dtype
    experts_BTK, weights_BTK, stats = route(x_BTD, self.router[...], self.router_bias[...], cfg,
                                            self.router_b[...] if cfg.expert_bias else None)
    x_BTD = x_BTD.astype(dt)
    if cfg.dispatch == "dropless":  # GPT-OSS's fused experts too (validate: dropless only)
      if self.fused:
        weights = tuple(w[...].astype(dt) for w in (self.gate_up, self.down))
        logical = ragged_dispatch.CLAMPED_LOGICAL
        if cfg.expert_bias:
          weights += (self.gate_up_b[...].astype(dt), self.down_b[...].astype(dt))
          logical += ragged_dispatch.CLAMPED_BIAS_LOGICAL
        ffn = _clamped_ffn(cfg.swiglu_alpha, cfg.swiglu_limit)
      else:
        weights = tuple(w[...].astype(dt) for w in (self.gate, self.up, self.down))
        logical, ffn = ragged_dispatch.SWIGLU_LOGICAL, moe_dispatch.grouped_swiglu
      if self.balanced_standin:
        ffn = _standin_ffn(ffn)
      stats["dropped"], stats["a2a_bytes"] = jnp.float32(0.0), jnp.float32(0.0)
      parallel = ragged_dispatch.for_rules(self.parallel.rules, ffn, cfg.num_experts, logical)
      if parallel is not None:  # experts split over devices: every assignment travels to its expert and back
        y_BTD, stats["a2a_bytes"] = parallel(x_BTD, experts_BTK, weights_BTK, *weights)
      else:
        y_BTD = moe_dispatch.dropless(x_BTD, experts_BTK, weights_BTK, weights, ffn)
    else:
      weights = tuple(w[...].astype(dt) for w in (self.gate, self.up, self.down))
      capacity = cfg.capacity(x_BTD.shape[1])
      slot_BTK, kept_BTK = moe_dispatch.capacity_slots(experts_BTK, cfg.num_experts, capacity)
      stats["dropped"] = jnp.sum(~kept_BTK).astype(jnp.float32)
      stats["a2a_bytes"] = jnp.float32(ragged_dispatch.capacity_bytes(self.parallel.rules, cfg.num_experts, capacity,
                                                                       x_BTD.shape, x_BTD.dtype.itemsize))
      local = moe_dispatch.local_experts(self.quant)
      parallel = expert_dispatch.for_rules(self.parallel.rules, local, cfg.num_experts, capacity)
      if parallel is not None:  # experts split over devices: tokens travel to them and back
        y_BTD = parallel(x_BTD, slot_BTK, weights_BTK, *weights)
      else:
        x_BECD = local.dispatch(x_BTD, slot_BTK, cfg.num_experts, capacity)
        y_BTD = local.combine(local.experts_ffn(x_BECD, *weights), slot_BTK, weights_BTK)
    if cfg.num_shared_experts:
      y_BTD = y_BTD + self.shared(x_BTD)
    return y_BTD.astype(dt), stats


@functools.lru_cache(maxsize=None)
def _clamped_ffn(alpha: float, limit: float) -> Callable:
  """GPT-OSS's grouped experts with their constants bound (one function per pair, so traces can share it)."""
  return functools.partial(moe_dispatch.grouped_clamped_swiglu, alpha=alpha, limit=limit)


@functools.lru_cache(maxsize=None)
def _standin_ffn(ffn: Callable) -> Callable:
  """`ffn` with its grouped matmuls through `moe_dispatch.balanced_ragged_dot` (one function per ffn)."""
  return functools.partial(ffn, matmul=moe_dispatch.balanced_ragged_dot)


def load_entropy(load_LE: jax.Array) -> jax.Array:
  """[L] entropy of each layer's load distribution over experts, divided by log(E): 1 = balanced,
  0 = every token to one expert."""
  p_LE = load_LE / jnp.maximum(jnp.sum(load_LE, axis=-1, keepdims=True), 1.0)
  entropy_L = -jnp.sum(jnp.where(p_LE > 0, p_LE * jnp.log(jnp.where(p_LE > 0, p_LE, 1.0)), 0.0), axis=-1)
  return entropy_L / math.log(load_LE.shape[-1]) if load_LE.shape[-1] > 1 else jnp.ones_like(entropy_L)


def is_router_bias(name: str) -> bool:
  return name.split("/")[-1] == "router_bias"


def update_router_bias(params: nnx.State, load_LE: jax.Array, rate: float) -> nnx.State:
  """DeepSeek-V3's aux-loss-free update: bias_e += rate x sign(mean load - load_e) in every MoE layer
  (underloaded experts become likelier picks). `load_LE` is in layer order: a stacked bias [L, E]
  takes it whole, unscanned layers' biases [E] (named moe_blocks/<i>/...) take row i."""
  step_LE = rate * jnp.sign(jnp.mean(load_LE, axis=-1, keepdims=True) - load_LE)

  def update(path, leaf):
    name = param_name(path)
    if not is_router_bias(name) or name.startswith("mtp/"):  # an MTP depth's MoE keeps its bias (load_LE has no row)
      return leaf
    if leaf.ndim == 2:
      return leaf + step_LE
    layer = int(name.split("/")[-3])
    return leaf + step_LE[layer]

  return jax.tree_util.tree_map_with_path(update, params)
