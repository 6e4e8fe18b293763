"""The range of every numeric config key, checked once at load (before anything compiles): a value
outside it is exit 2 naming the key, the value, the range and the key's meaning.

Each range says what the key can mean, not what is typical: `quant_margin=100` scales every operand
below the 8-bit format's smallest value (every quantized matmul becomes zero), a timeout of 0 or NaN
never waits. Sentinels (-1 = off or "the rest") are listed as `also`. Every numeric key of
`keys.base_config()` has an entry here (tests/test_trust_sides.py checks it), and a key a component
checks more closely (the mesh arithmetic, the wsd warmup) is still checked there.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_collections

from maxtrain.config.keys import base_config, flat_keys, key_docs
from maxtrain.errors import UserError

INF = math.inf
MAX_INT = 2**63 - 1  # a jax/NumPy int64


@dataclasses.dataclass(frozen=True)
class Range:
  lo: float = -INF
  hi: float = INF
  lo_open: bool = False  # lo itself excluded
  hi_open: bool = False
  also: tuple[float, ...] = ()  # sentinels outside [lo, hi] that mean something (-1 = off)

  def __contains__(self, value: float) -> bool:
    if value in self.also:
      return True
    if not math.isfinite(value):
      return False
    above = value > self.lo if self.lo_open else value >= self.lo
    below = value < self.hi if self.hi_open else value <= self.hi
    return above and below

  def describe(self, integer: bool = False) -> str:
    if self.hi == INF:
      text = f"{'>' if self.lo_open else '>='} {self.lo:g}"
    else:
      text = f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
    text = ("an integer " if integer else "a finite number ") + text
    return " or ".join([*(f"{a:g}" for a in self.also), text]) if self.also else text


def at_least(lo: float, *also: float) -> Range:
  return Range(lo, also=also)


def above(lo: float) -> Range:
  return Range(lo, lo_open=True)


def between(lo: float, hi: float, *, hi_open: bool = False) -> Range:
  return Range(lo, hi, hi_open=hi_open)


COUNT, COUNT0, STEP_OR_OFF = at_least(1), at_least(0), at_least(0, -1)
SECONDS = between(0.001, 7 * 86400)  # a timeout: a millisecond to a week (0 or NaN would never wait)
SECONDS0 = between(0, 7 * 86400)  # a duration where 0 = off
WEIGHT = at_least(0)  # a loss weight or coefficient; 0 = off
FRACTION = between(0, 1)
DECAY = between(0, 1, hi_open=True)  # a moment decay: 1 never forgets, > 1 diverges
MESH = at_least(1, -1)  # a mesh axis size; -1 = the remaining devices
PORT = between(0, 65535)

RANGES: dict[str, Range] = {
    "seed": between(0, 2**32 - 1),  # jax.random.key folds it into a 32-bit key pair
    "steps": COUNT,
    "log_every": COUNT,
    # model
    "model.num_layers": COUNT, "model.d_model": COUNT, "model.num_heads": COUNT, "model.num_kv_heads": COUNT,
    "model.d_ff": COUNT, "model.vocab_size": COUNT, "model.max_seq_len": COUNT,
    "model.head_dim": COUNT0, "model.sliding_window": COUNT0,  # 0 = d_model / num_heads; 0 = no window
    "model.query_pre_attn_scalar": at_least(0), "model.attn_logit_softcap": at_least(0),  # 0 = head_dim; 0 = off
    "model.final_logit_softcap": at_least(0),  # 0 = off
    "model.window_pattern": COUNT0, "model.rope_local_theta": at_least(0),  # 0 = the family's; 0 = rope_theta
    "fit.headroom": between(0, 1, hi_open=True),  # the share of device memory remat=auto leaves free
    "model.rope_beta_fast": above(0), "model.rope_beta_slow": above(0),
    "model.rope_attention_factor": at_least(0),  # 0 = YaRN's 0.1 ln(factor) + 1
    "model.moe.n_group": COUNT, "model.moe.topk_group": COUNT, "model.moe.routed_scaling_factor": above(0),
    "model.moe.swiglu_alpha": above(0), "model.moe.swiglu_limit": above(0),
    "model.mla.kv_lora_rank": COUNT0, "model.mla.q_lora_rank": COUNT0,  # 0 = off
    "model.mla.rope_head_dim": COUNT, "model.mla.nope_head_dim": COUNT, "model.mla.v_head_dim": COUNT,
    "model.mla.softmax_mscale": above(0),
    "model.rope_theta": above(1),  # a base <= 1 gives no rotation at all (1) or growing wavelengths
    "model.rope_scaling_factor": above(0), "model.rope_low_freq_factor": above(0),
    "model.rope_high_freq_factor": above(0), "model.rope_original_max_len": COUNT,
    "model.norm_eps": between(0, 1),
    "model.scan_unroll": COUNT, "model.attention_block_q": COUNT, "model.attention_block_kv": COUNT,
    "model.loss_chunk_tokens": at_least(0, -1),
    "model.quant_min_dim": COUNT,
    # The amax lands at the format's max x 2^-margin: int8's 127 keeps 3 bits of magnitude at 4 (127/16),
    # E4M3's 448 keeps its 3 mantissa bits over 4 fewer binades; beyond, small values round to 0 (at 100
    # everything does). -1 puts the amax above the max: the overflow drill with quant_saturate=false.
    "model.quant_margin": between(-1, 4),
    "model.moe.num_experts": COUNT0, "model.moe.experts_per_token": COUNT, "model.moe.num_shared_experts": COUNT0,
    "model.moe.expert_d_ff": COUNT, "model.moe.first_dense_layers": COUNT0,
    "model.moe.capacity_factor": above(0), "model.moe.aux_loss_weight": WEIGHT,
    "model.moe.router_z_loss_weight": WEIGHT, "model.moe.bias_update_rate": WEIGHT,
    "model.moe.collapse_entropy": FRACTION, "model.moe.collapse_steps": COUNT0,
    "model.mtp_layers": COUNT0, "model.mtp_loss_weight": WEIGHT,  # 0 = no multi-token prediction
    # mesh and pipeline
    **{f"mesh.{axis}": MESH for axis, size in base_config().mesh.items() if isinstance(size, int)},  # every axis
    "pipeline.microbatches": COUNT, "pipeline.repeats": COUNT,
    # data
    "data.seq_len": COUNT, "data.batch_size": COUNT, "data.max_epochs": at_least(0), "data.read_ahead": COUNT0,
    "data.read_threads": COUNT,
    # optimizer
    "optimizer.lr": above(0), "optimizer.adam_lr": above(0), "optimizer.warmup_steps": COUNT0,
    "optimizer.min_lr_ratio": FRACTION, "optimizer.decay_steps": COUNT0, "optimizer.decay_fraction": Range(0, 1, lo_open=True),
    "optimizer.weight_decay": WEIGHT, "optimizer.clip_norm": WEIGHT, "optimizer.z_loss": WEIGHT,
    "optimizer.grad_accum_steps": COUNT, "optimizer.microbatch_size": COUNT0, "optimizer.offload_groups": COUNT,
    "optimizer.b1": DECAY, "optimizer.b2": DECAY, "optimizer.eps": Range(0, 1, lo_open=True),
    "optimizer.muon_momentum": DECAY, "optimizer.muon_ns_steps": COUNT, "optimizer.muon_consistent_rms": WEIGHT,
    # checkpoint
    "checkpoint.every_steps": COUNT0, "checkpoint.max_to_keep": COUNT0, "checkpoint.keep_every": COUNT0,
    "checkpoint.s3_connect_timeout_s": SECONDS, "checkpoint.s3_read_timeout_s": SECONDS,
    "checkpoint.s3_max_attempts": between(1, 100),
    "checkpoint.local_every_steps": COUNT0, "checkpoint.local_max_to_keep": COUNT0,
    "checkpoint.every_minutes": between(0, 7 * 24 * 60), "checkpoint.mtbf_prior_minutes": above(0),
    "checkpoint.max_durable_lag": COUNT0, "checkpoint.preemption_grace_s": SECONDS0,
    # runtime
    "runtime.num_processes": COUNT0, "runtime.process_id": at_least(0, -1), "runtime.init_timeout_s": SECONDS,
    "runtime.heartbeat_timeout_s": SECONDS, "runtime.shutdown_timeout_s": SECONDS,
    "runtime.coordinator_port": PORT, "runtime.neuron_lnc": between(0, 2),
    # monitoring
    "mfu.peak_flops": at_least(0), "profile.start_step": STEP_OR_OFF, "profile.num_steps": COUNT,
    "monitor.prometheus_port": PORT,
    "tracking.otel_interval_s": between(0.1, 86400),  # below 0.1 s the exporter would be the busiest thread
    # faults (drills)
    **{f"faults.{k}": STEP_OR_OFF for k in ("sigterm_at_step", "kill_during_save_at_step", "corrupt_checkpoint_at_step",
                                             "crash_at_step", "hang_at_step", "nan_at_step", "spike_at_step",
                                             "kill_at_step", "process", "sigterm_process", "rollout_hang_at_step",
                                             "publish_stall_at_step", "rollout_die_at_step")},
    "faults.spike_factor": above(0), "faults.slow_step_s": SECONDS0, "faults.kill_every_steps": COUNT0,
    "faults.kill_times": COUNT0,
    # guards, watchdog, fleet
    "guards.max_consecutive_bad": COUNT, "guards.spike_window": COUNT, "guards.spike_warmup": COUNT0,
    "guards.spike_zscore": above(0), "guards.max_rollbacks": COUNT0,
    "watchdog.timeout_s": SECONDS0, "watchdog.startup_timeout_s": SECONDS0,
    "fleet.straggler_threshold": WEIGHT, "fleet.straggler_min_s": SECONDS0, "fleet.exchange_timeout_s": SECONDS,
    # post-training
    "post.eval_prompts": COUNT0, "post.max_new_tokens": COUNT, "post.prompts_per_step": COUNT,
    "post.group_size": COUNT, "post.ppo_epochs": COUNT, "post.minibatches": COUNT,
    # -1 = the algorithm's default (maxtrain/posttrain/algorithms), else the value itself
    "post.clip_eps": Range(0, 1, lo_open=True, hi_open=True, also=(-1,)),
    "post.clip_eps_high": Range(0, 1, lo_open=True, hi_open=True, also=(-1,)),
    "post.kl_coef": at_least(0, -1), "post.overlong_buffer": at_least(0, -1), "post.max_draws": at_least(1, -1),
    "post.gamma": between(0, 1), "post.lam": between(0, 1), "post.value_clip": above(0), "post.critic_lr": above(0),
    "post.temperature": above(0),
    "post.rollout_devices": COUNT0, "post.max_staleness": COUNT0, "post.is_cap": at_least(1),
    "post.sync_timeout_s": SECONDS, "post.continuous_batching": COUNT0,
    # eval
    "eval.every_steps": COUNT0, "eval.batches": COUNT,
}


def numeric_keys(cfg: ml_collections.ConfigDict) -> list[str]:
  """The dotted keys of `cfg` holding an int or a float (bools are flags, not numbers)."""
  return [k for k in flat_keys(cfg) if _is_number(_get(cfg, k))]


def check(cfg: ml_collections.ConfigDict) -> None:
  """UserError for the first numeric key outside its range (NaN and inf are outside every range)."""
  for key in numeric_keys(cfg):
    value, allowed = _get(cfg, key), RANGES.get(key)
    if allowed is not None and value not in allowed:
      meaning = key_docs().get(key, "")
      raise UserError(f"config.{key}={value!r}: out of range, must be {allowed.describe(isinstance(value, int))}"
                      + (f" ({key}: {meaning})" if meaning else ""))


def _get(cfg: ml_collections.ConfigDict, key: str) -> Any:
  node = cfg
  for part in key.split("."):
    node = node[part]
  return node


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)
