"""Will it fit? Parameters, FLOPs and per-device memory of a config, by arithmetic: no compile, no devices.

Each parameter's per-device size comes from its logical axis names (the model's annotations) and the
run's layout (`sharding/layout.py`: the rule set and the mesh shape from `validate`): a dim mapped to
mesh axes is split over their product, rounded up as XLA pads uneven shards. The state terms
(weights, optimizer moments) are therefore exact. The temporaries are a model of what the compiled
step keeps alive at its peak; `python -m maxtrain.compile` measures the real thing (docs/fitting.md
gives the agreement).

Shape legend (per device): b sequences per microbatch, T length, D model, V_t vocab / its shards,
H_t heads / their shards, F_t ffn / its shards, L layers.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.config import schema
from maxtrain.errors import UserError
from maxtrain.optim import offload
from maxtrain.optim import optimizer as optim
from maxtrain.models.attention.layer import resolve_kernel
from maxtrain.models.attention.blocked import default_block_q
from maxtrain.models import registry
from maxtrain.models.decoder import ModelConfig
from maxtrain.monitor import memory
from maxtrain.program.build import loss_chunk_tokens
from maxtrain.sharding import schedules
from maxtrain.sharding.layout import Layout, named_leaves
from maxtrain.program.plan import validate

GiB = 2**30
# XLA:CPU's attention working set per score element while one layer runs: three fp32 B x H x T x T
# buffers (masked scores, the broadcast fill value of the mask, exp/softmax) and the mask itself as
# one byte per head (measured on the compiled step's peak, LLaMA 3 8B/70B shapes).
ATTENTION_BYTES_PER_SCORE = 3 * 4 + 1
# fp32 logits-sized buffers alive at the loss phase's peak: the logits' gradient (the logits are dead by then).
LOGIT_BUFFERS = 1


@dataclasses.dataclass(frozen=True)
class Param:
  name: str  # 'blocks/attn/wq'
  shape: tuple[int, ...]
  dtype: Any
  local_shape: tuple[int, ...]  # on one device
  label: str  # optimizer group: 'adam' or 'muon'

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def local_size(self) -> int:
    return math.prod(self.local_shape)


def param_table(model_cfg: ModelConfig, layout: Layout, optimizer_name: str) -> list[Param]:
  """Every parameter with its per-device shape and optimizer group, from the abstract model."""
  _, params = registry.abstract(model_cfg)
  labels = jax.tree.leaves(optim.param_labels(params, optimizer_name))
  return [Param(name, tuple(leaf.shape), leaf.dtype, layout.local_shape(tuple(leaf.shape), logical), label)
          for (name, leaf, logical), label in zip(named_leaves(params), labels, strict=True)]


@dataclasses.dataclass(frozen=True)
class Estimate:
  num_devices: int
  mesh_shape: dict[str, int]
  params: dict[str, int]  # total, embedding, head, per_layer, layers (all L), other, active (per token)
  flops_per_token: float
  microbatch: int  # sequences per device per microbatch
  memory: dict[str, int]  # bytes per device, by component (see COMPONENTS)
  notes: list[str]
  pipeline: dict[str, Any] | None = None  # sharding/pipeline.py Schedule.to_json + boundary bytes; None: no pipeline

  @property
  def arguments(self) -> int:
    """What the compiled step takes as arguments in device memory: the train state (and the batch)."""
    return sum(self.memory[k] for k in ARGUMENTS)

  @property
  def temporaries(self) -> int:
    return sum(v for k, v in self.memory.items() if k not in ARGUMENTS and k not in HOST)

  @property
  def host(self) -> int:
    """Host memory per device: the optimizer state under optimizer.offload=host, the activations offloaded by
    model.remat=offload."""
    return sum(self.memory.get(k, 0) for k in HOST)

  @property
  def peak(self) -> int:
    return self.arguments + self.temporaries

  def to_json(self) -> dict[str, Any]:
    return {"num_devices": self.num_devices, "mesh": self.mesh_shape, "params": self.params,
            "flops_per_token": self.flops_per_token, "microbatch_sequences_per_device": self.microbatch,
            "memory_bytes_per_device": {**self.memory, "arguments": self.arguments, "temporaries": self.temporaries,
                                        "peak": self.peak, "host": self.host}, "notes": self.notes, "pipeline_schedule": self.pipeline}

  def table(self) -> str:
    p = self.params
    mesh = " x ".join(f"{a}={s}" for a, s in self.mesh_shape.items())
    lines = [f"devices: {self.num_devices} (mesh {mesh}); {self.microbatch} sequence(s) per device per microbatch",
             "parameters:",
             f"  total           {p['total']:>16,}",
             f"  embedding       {p['embedding']:>16,}",
             f"  head            {p['head']:>16,}",
             f"  per layer       {p['per_layer']:>16,}  (x {p['num_layers']} layers = {p['layers']:,})",
             f"  other (norms)   {p['other']:>16,}",
             f"  active/token    {p['active']:>16,}  (MoE: routed experts count experts_per_token of num_experts)",
             f"FLOPs per token:  {self.flops_per_token:>16.4g}  (train: 6 x matmul params + causal attention)",
             "memory per device:"]
    if self.pipeline:
      q = self.pipeline
      lines.insert(1, f"pipeline: {q['stages']} stages x {q['repeats']} repeat(s), {q['microbatches']} microbatches, "
                   f"{q['iterations']} iterations: bubble {q['bubble_fraction']:.4f}; "
                   f"{q['boundary_bytes'] / 2**20:.2f} MiB per device to the next stage per step")
      lines.insert(2, "per stage (one SPMD program: each stage's devices allocate the same; the first holds its "
                   "activations longest):")
      for i, x in enumerate(q["per_stage"]):
        lines.insert(3 + i, f"  stage {x['stage']}: {x['layers']} layers, {x['live_passes']} passes live at its peak, "
                     f"saved activations {x['saved_bytes'] / GiB:.3f} GiB (useful {x['useful_saved_bytes'] / GiB:.3f}), "
                     f"held {x['held_iterations']} iterations")
      lines.insert(3 + len(q["per_stage"]), f"  max over stages: {q['max_stage_saved_bytes'] / GiB:.3f} GiB saved "
                   f"activations, peak {self.peak / GiB:.3f} GiB")
    for key, (label, _) in COMPONENTS.items():
      if self.memory.get(key) and key not in HOST:
        lines.append(f"  {label:<34s} {self.memory[key] / GiB:9.3f} GiB")
    lines += [f"  {'= arguments (train state + batch)':<34s} {self.arguments / GiB:9.3f} GiB",
              f"  {'+ temporaries':<34s} {self.temporaries / GiB:9.3f} GiB",
              f"  {'= peak':<34s} {self.peak / GiB:9.3f} GiB"]
    if self.host:
      lines.append("host memory per device (pinned_host):")
      lines += [f"  {COMPONENTS[k][0]:<34s} {self.memory[k] / GiB:9.3f} GiB" for k in HOST if self.memory.get(k)]
    lines += [f"note: {n}" for n in self.notes]
    return "\n".join(lines)


# key -> (label, what it is). The first group are the step's arguments; the rest its temporaries.
COMPONENTS: dict[str, tuple[str, str]] = {
    "weights": ("weights", "parameters at model.param_dtype, sharded"),
    "optimizer_state": ("optimizer state", "Adam mu + nu, or Muon momentum, at optimizer.state_dtype"),
    "other_state": ("step, guards, batch", "step counters, the loss-spike window, the token batch"),
    "state_copy": ("state copy (guarded update)", "the old parameters stay alive until the guarded update has "
                   "written the new ones; the optimizer's moments are updated in place"),
    "gradients": ("gradients", "one per parameter at param_dtype, sharded like it"),
    "grad_accumulators": ("grad accumulators (fp32)", "grad_accum_steps > 1: fp32 sums; XLA leaves the "
                          "embedding's and head's whole (not FSDP-sharded)"),
    "saved_activations": ("saved activations", "what the backward pass keeps from the forward, per remat"),
    "working_set": ("working set (peak phase)", "the larger of: the loss phase (gathered head, its full "
                    "gradient, fp32 logits) and one layer's recompute + backward (attention scores, "
                    "gathered layer weights and their full gradients)"),
    "pipeline_extra": ("pipeline extra (calibrated)", "under a pipeline: what the compiled pipelined step holds "
                       "beyond the other terms, sized as 2 (3 without gradient accumulation) copies of the pipelined "
                       "stack's weights: calibrated on the pipelined GPU presets' compiles (docs/fitting.md)"),
    "offload_update": ("offloaded state on device (update)", "optimizer.offload=host: the largest streamed group's "
                       "moments on the device for the update, beyond the activations the backward pass freed "
                       "before it"),
    "host_optimizer_state": ("optimizer state (host)", "optimizer.offload=host: the moments in host memory, on "
                             "the device only for the update"),
    "host_activations": ("offloaded activations (host)", "model.remat=offload: the named activations each layer "
                         "saves to host memory for the backward pass"),
}
ARGUMENTS = ("weights", "optimizer_state", "other_state")
HOST = ("host_optimizer_state", "host_activations")


def _itemsize(dtype: Any) -> int:
  return jnp.dtype(dtype).itemsize


def _attention_bytes(m: ModelConfig, b: int, seq: int, h_t: int, kv_t: int, c_bytes: int,
                     context: int = 1) -> tuple[int, int]:
  """(kept for the backward pass without remat, working set of one layer's attention) per device, by
  kernel: `dot` holds B x H x T x T scores; `blocked` the probabilities of its computed blocks (5/8 of
  T x T with 4 blocks) and one block's scores; `flash` only per-row statistics, fp32 gradient
  accumulators and one block of scores (linear in T). With `context` shards (always flash,
  `sharding/context_attention.py`) a device holds T / context queries and all T keys and values."""
  kernel = resolve_kernel(m.attention, seq)
  if kernel == "dot" and context == 1:
    return b * h_t * seq * seq * (4 + c_bytes), b * h_t * seq * seq * ATTENTION_BYTES_PER_SCORE
  if kernel == "blocked" and context == 1:  # each query block keeps P over its keys (from the window's start)
    bq, w = default_block_q(seq), m.sliding_window
    keys = [min(r0 + bq, seq) - (max(0, r0 - w + 1) if w else 0) for r0 in range(0, seq, bq)]
    kept = b * h_t * sum(k * (min(r0 + bq, seq) - r0) for k, r0 in zip(keys, range(0, seq, bq))) * 4
    return kept, b * h_t * bq * max(keys) * ATTENTION_BYTES_PER_SCORE
  local = seq // context
  rows = b * (local * h_t + seq * 2 * kv_t) * m.head_dim  # q, gathered k, v (and their gradients)
  block_scores = 3 * b * h_t * min(m.attention_block_q, local) * min(m.attention_block_kv, seq) * 4
  return b * h_t * local * 4, rows * (4 + c_bytes) + block_scores


def _param_counts(table: list[Param], m: ModelConfig) -> dict[str, int]:
  by_name = {p.name: p for p in table}
  embedding, head = by_name["embed"].size, by_name["head"].size if "head" in by_name else 0
  layers = sum(p.size for p in table if p.name.startswith(("blocks/", "moe_blocks/")))
  total = sum(p.size for p in table)
  return {"total": total, "embedding": embedding, "head": head, "per_layer": layers // m.num_layers,
          "num_layers": m.num_layers, "layers": layers, "other": total - embedding - head - layers,
          "active": total - _inactive_experts(table, m)}


def _is_routed_expert(name: str) -> bool:
  """'moe_blocks/moe/gate' (or .../<i>/moe/up ...): a stacked routed-expert weight, not a shared expert's."""
  parts = name.split("/")
  return len(parts) >= 2 and parts[-2] == "moe" and parts[-1] in ("gate", "up", "down", "gate_up")


def _inactive_experts(table: list[Param], m: ModelConfig) -> int:
  """Routed-expert parameters a token does not use: all but experts_per_token of num_experts."""
  routed = sum(p.size for p in table if _is_routed_expert(p.name))
  return 0 if not m.moe.enabled else routed - routed * m.moe.experts_per_token // m.moe.num_experts


def _mean_ffn_width(m: ModelConfig, expert_shards: int = 1) -> int:
  """The feed-forward hidden width per token, averaged over layers: d_ff for a dense layer; for a MoE
  layer the expert slots a token fills (x capacity_factor with capacity dispatch) plus shared experts.
  Dropless over X > 1 expert shards sizes each device's receive buffer for the worst case
  (sharding/ragged_dispatch.py): X x min(k, E / X) rows per local token."""
  moe, num_moe = m.moe, m.moe.num_moe_layers(m.num_layers)
  if not num_moe:
    return m.d_ff
  slots = moe.experts_per_token * (moe.capacity_factor if moe.dispatch == "capacity" else 1.0)
  if moe.dispatch == "dropless" and expert_shards > 1:
    slots = expert_shards * min(moe.experts_per_token, moe.num_experts // expert_shards)
  moe_width = round((slots + moe.num_shared_experts) * moe.expert_d_ff)
  return ((m.num_layers - num_moe) * m.d_ff + num_moe * moe_width) // m.num_layers


def _largest_layer_gathered(table: list[Param], m: ModelConfig, layout: Layout) -> int:
  """Elements of the largest layer's weights on one device once gathered over the FSDP axes: each
  stack's per-layer size split over the tensor axis (and a MoE layer's experts over the expert axis)."""
  largest = 0
  for stack, num in (("blocks/", m.num_layers - m.moe.num_moe_layers(m.num_layers)),
                     ("moe_blocks/", m.moe.num_moe_layers(m.num_layers))):
    if num:
      experts = sum(p.size for p in table if p.name.startswith(stack) and _is_routed_expert(p.name))
      rest = sum(p.size for p in table if p.name.startswith(stack)) - experts
      local = rest // layout.shards("mlp") + experts // (layout.shards("experts") * layout.shards("expert_mlp"))
      largest = max(largest, local // num)
  return largest


def boundary_bytes(cfg: schema.Config, plan: Any) -> int:
  """Bytes one device sends to the next stage per step: every iteration of every accumulation step
  passes one microbatch's activations [b/M, T, D] forward (ppermute) and its gradient back."""
  schedule = plan.pipeline
  seq_local = cfg.data.seq_len // plan.layout.shards("act_length")
  rows = plan.batch.per_shard // schedule.microbatches
  return 2 * schedule.iterations * rows * seq_local * cfg.model.d_model * _itemsize(cfg.model.compute_dtype)


def _pipeline(plan: Any, m: Any, saved: int, microbatch_bytes: int,
              shard_bytes: int) -> tuple[int, dict[str, Any] | None]:
  """(saved activations per device, the schedule's figures) under the pipeline (sharding/pipeline.py).

  `saved` is what all L layers would save for the b sequences of one accumulation step. Each iteration
  of the circular scan runs L/(R S) layers on one microbatch (b/M sequences) and autodiff saves their
  inputs for every iteration, the S-1 of the bubble included; a stage also holds the microbatches it
  returns to the ring and its outputs (2 x b sequences). It is one SPMD program, so every stage
  allocates the same and the max over stages is that figure. What differs is how long (GPipe order:
  forward iteration t at time t, its backward at time 2 I - 1 - t): stage s saves its first pass at
  time s and frees it at 2 I - 1 - s, so the first stage holds its activations the longest.

  With `pipeline.stage_remat` an iteration saves only its stage input (one microbatch's [b/M, T, D]);
  the backward of one iteration then holds what its L/(R S) layers save, once."""
  schedule = plan.pipeline
  if schedule is None:
    return saved, None
  # A MoE model's dense first layers run before the pipeline on the whole batch (models/decoder.py): their share of
  # the saved activations is not divided over stages and microbatches.
  first_dense = m.moe.first_dense_layers if m.moe.enabled else 0
  outside = saved * first_dense // m.num_layers
  num_layers, saved = m.num_layers - first_dense, saved - outside
  s_, r_, m_, its = schedule.stages, schedule.repeats, schedule.microbatches, schedule.iterations
  per_iteration = saved // (s_ * r_ * m_)
  allocated = per_iteration * its + 2 * microbatch_bytes
  if schedule.stage_remat:
    per_iteration, recompute = microbatch_bytes // m_, per_iteration
    allocated = per_iteration * its + 2 * microbatch_bytes + recompute
  live = [r_ * m_] * s_
  if schedule.kind != "gpipe":  # stage inputs and incoming gradients in slots; a backward recomputes one pass
    live = [int(x) for x in schedules.held(schedules.table(schedule))]
    prog = schedules.program(schedule)
    per_iteration, recompute = microbatch_bytes // m_, per_iteration
    allocated = per_iteration * (prog.x_slots + prog.g_slots) + 2 * microbatch_bytes + recompute
  stages = [{"stage": s, "layers": num_layers // s_, "live_passes": live[s],
             "useful_saved_bytes": per_iteration * r_ * m_, "saved_bytes": allocated,
             "held_iterations": 2 * its - 1 - 2 * s} for s in range(s_)]
  figures = {**schedule.to_json(), "boundary_bytes": 2 * its * shard_bytes // m_,
             "saved_bytes_per_iteration": per_iteration, "per_stage": stages,
             "max_stage_saved_bytes": max(x["saved_bytes"] for x in stages)}
  return allocated + outside, figures


def _largest_streamed_group(table: list[Param], moments: dict[str, int], state_bytes: int, max_groups: int) -> int:
  """Per device, the moments of the largest group the offloaded update streams through the device at once
  (`offload.stream_groups` over the parameters in leaf order: their names sorted, as jax flattens dicts)."""
  ordered = sorted(table, key=lambda p: p.name)
  groups = offload.stream_groups([p.size for p in ordered], max_groups)
  return max((sum(moments[ordered[i].label] * ordered[i].local_size * state_bytes for i in g) for g in groups),
             default=0)


def _pipeline_extra(table: list[Param], m: ModelConfig, plan: Any) -> int:
  """Bytes per device a pipelined step's compile holds beyond the other terms, sized as copies of the pipelined
  stack's per-device weights (`moe_blocks` of a MoE model, whose dense first layers run before the pipeline;
  `blocks` otherwise): 2 with gradient accumulation, 3 without. Calibrated on the compiles of the two pipelined GPU
  presets (deepseek_v3_671b 93.00 GiB, llama3_405b 114.68), not derived buffer by buffer: what the live ranges at
  their peaks (`--xla_dump_to`, docs/fitting.md) show beyond the estimate's own terms is, on XLA:CPU, the stage
  loop's copy of the stage weights (the loop's operand) and its fp32 gradient accumulators, both allocated at the
  start of the step, next to deepseek_v3_671b's dense first layers' whole-batch attention buffers and
  llama3_405b's stage inputs saved in fp32 and its fp32 stage-boundary sends, which the terms above undercount."""
  if plan.pipeline is None:
    return 0
  stack = "moe_blocks/" if m.moe.enabled and m.moe.num_moe_layers(m.num_layers) else "blocks/"
  stage_weights = sum(p.local_size * _itemsize(p.dtype) for p in table if p.name.startswith(stack))
  return stage_weights * (2 if plan.batch.num_microbatches > 1 else 3)


def _grad_accumulators(table: list[Param], m: ModelConfig, layout: Layout) -> int:
  """fp32 gradient sums of gradient accumulation. XLA's sharding propagation leaves the embedding's and
  head's accumulators whole (over fsdp) when their gradients arrive in another dtype (bf16 compute, fp32
  params); with fp32 compute it shards them."""
  # [V, D] split over the vocab's shards only, not over the embed dim's (FSDP)
  vocab_whole = {p.name: p.size // layout.shards("vocab") for p in table if p.name in ("embed", "head")}
  whole = m.compute_dtype != m.param_dtype
  return 4 * sum(vocab_whole[p.name] if whole and p.name in vocab_whole else p.local_size for p in table)


def _saved_activations(m: ModelConfig, tokens: int, dots_per_token: int, f_t: int, attention_saved: int,
                       c_bytes: int) -> tuple[int, int]:
  """(device bytes, host bytes) the backward pass keeps from the forward, per `model.remat`."""
  d = m.d_model
  host_activations = 0
  if m.remat in ("full", "offload", "auto"):
    # Each layer's input; the rest is recomputed. offload: + the residual and MLP input of every layer in host
    # memory (program/fit.py offloaded_activation_bytes). auto: the candidate with the least device memory
    # (the compile chooses, program/fit.py), so that a model that fits some policy passes the memory check.
    saved = m.num_layers * tokens * d * c_bytes
    if m.remat == "offload":
      host_activations = 2 * m.num_layers * tokens * d * c_bytes
  elif m.remat == "dots":
    saved = m.num_layers * tokens * dots_per_token * c_bytes
  else:  # everything: the matmul outputs, the norms' and SwiGLU's elementwise results, the attention's
    saved = m.num_layers * (tokens * (dots_per_token + 3 * d + 2 * f_t) * c_bytes + attention_saved)
  return saved, host_activations


def estimate(cfg: schema.Config, num_devices: int, num_processes: int = 1) -> Estimate:
  """Per-device memory and FLOPs of `cfg`'s train step on `num_devices` devices (over `num_processes`)."""
  plan = validate(cfg, num_devices, num_processes, require_data=False)
  layout = plan.layout
  model_cfg = registry.model_config(cfg.model)
  o, m = cfg.optimizer, model_cfg
  table = param_table(model_cfg, layout, o.name)

  params = _param_counts(table, m)
  head = params["head"]

  # The train state: exact, from the per-device shapes.
  state_bytes = _itemsize(o.state_dtype)
  moments = {"adam": 2, "muon": 1, "none": 0}
  weights = sum(p.local_size * _itemsize(p.dtype) for p in table)
  optimizer_state = sum(moments[p.label] * p.local_size * state_bytes for p in table)
  k, b = plan.batch.num_microbatches, plan.batch.per_microbatch
  seq, d, context = cfg.data.seq_len, m.d_model, layout.shards("act_length")
  seq_local = seq // context  # tokens of each sequence on one device
  batch_rows = plan.batch.per_shard
  other_state = (5 * batch_rows * seq_local * 4 + 2 * 4  # inputs, targets, segment_ids, positions, loss_mask; fault
                 + cfg.guards.spike_window * 4 + 4 * 4 + 4 * len(moments))  # guard window + counters + counts

  # Temporaries: a model of the live set at the step's peak (see COMPONENTS).
  c_bytes = _itemsize(m.compute_dtype)
  gradients = sum(p.local_size * _itemsize(p.dtype) for p in table)
  grad_accumulators = _grad_accumulators(table, m, layout) if k > 1 else 0

  v_t, h_t = m.vocab_size // layout.shards("act_vocab"), m.num_heads // layout.shards("act_heads")
  kv_t, f_t = m.num_kv_heads // layout.shards("act_kv_heads"), _mean_ffn_width(m, layout.shards("experts")) // layout.shards("act_mlp")
  tokens = b * seq_local
  attention_saved = _attention_bytes(m, b, seq, h_t, kv_t, c_bytes, context)[0]
  # One layer's weights when all-gathered over the embed dim's shards (FSDP): split over the others only
  # (a MoE layer gathers only its own device's experts).
  layer_weights = _largest_layer_gathered(table, m, layout)
  # Per token of one layer: the matmul outputs (q, k, v, attention output, its projection, gate, up,
  # down) and the layer input.
  dots_per_token = h_t * m.head_dim * 2 + kv_t * m.head_dim * 2 + 2 * d + 2 * f_t + d
  saved, host_activations = _saved_activations(m, tokens, dots_per_token, f_t, attention_saved, c_bytes)
  saved, pipeline = _pipeline(plan, m, saved, tokens * d * c_bytes, batch_rows * seq_local * d * c_bytes)
  # With FSDP a weight is all-gathered (in the compute dtype) where it is used, and its gradient is
  # whole (fp32) until it is reduce-scattered.
  gathered = layout.shards("embed") > 1
  head_gathered = d * v_t * c_bytes if gathered and head else 0
  chunk = loss_chunk_tokens(cfg.model)  # the chunked loss holds one chunk's logits, not all of them
  loss_phase = head_gathered + d * v_t * 4 + LOGIT_BUFFERS * (min(tokens, chunk) if chunk else tokens) * v_t * 4
  # Under the pipeline a layer runs on one pipeline microbatch (b/M sequences) at a time.
  per_call = plan.pipeline.microbatches if plan.pipeline else 1
  attention_work = _attention_bytes(m, b // per_call, seq, h_t, kv_t, c_bytes, context)[1]
  layer_phase = ((layer_weights * c_bytes if gathered else 0) + layer_weights * 4
                 + attention_work + tokens // per_call * dots_per_token * 4)
  # The new parameters are written while the old ones are still being read (the guard selects between
  # them). The moments are updated in place: the guard's select sits inside Adam's and Muon's updates
  # (maxtrain.optim.scale_by_adam_guarded, maxtrain.muon).
  state_copy = weights
  # optimizer.offload=host: the moments are arguments in host memory (optim/offload.py). The device holds them
  # only while the update runs, after the backward pass has freed the activations: not at the peak.
  host_optimizer_state = streamed_group = 0
  if offload.enabled(o):
    host_optimizer_state, optimizer_state = optimizer_state, 0
    streamed_group = _largest_streamed_group(table, moments, state_bytes, o.offload_groups)
  memory = {
      "weights": weights, "optimizer_state": optimizer_state, "other_state": other_state,
      "host_optimizer_state": host_optimizer_state, "host_activations": host_activations, "state_copy": state_copy,
      "gradients": gradients, "grad_accumulators": grad_accumulators, "saved_activations": saved,
      "working_set": max(loss_phase, layer_phase), "pipeline_extra": _pipeline_extra(table, m, plan),
      # The update phase brings one group's moments to the device after the backward pass freed the activations:
      # it raises the peak only by what they exceed them by.
      "offload_update": max(0, streamed_group - saved - max(loss_phase, layer_phase)),
  }
  notes = [] if m.remat != "auto" else [
      "model.remat=auto: the activations of the policy with the least device memory (full, or offload with "
      "its host bytes elsewhere); the compile picks the fastest that fits (python -m maxtrain.compile)"]
  notes += [] if m.compute_dtype == jnp.float32 else [
      "compute dtype is not fp32: XLA:CPU (maxtrain.compile) keeps some matmul outputs and saved activations in "
      f"fp32 where a GPU/Neuron compiler keeps them in {jnp.dtype(m.compute_dtype).name}, so its figures can exceed "
      "this estimate"]
  return Estimate(num_devices=num_devices, mesh_shape=dict(plan.mesh.sizes), params=params,
                  flops_per_token=registry.flops_per_token(model_cfg, seq), microbatch=b, memory=memory, notes=notes,
                  pipeline=pipeline)


def available_memory(devices: Any) -> tuple[int, str] | None:
  """(bytes one device may use, where that figure comes from): the allocator's limit of an accelerator
  (`memory_stats`), else the host's available RAM shared by the process's CPU devices; None if unknown."""
  device = memory.device_memory(devices)  # the accelerator's allocator, as the metrics read it
  if device["source"] == "device" and device["bytes_limit"]:
    return int(device["bytes_limit"]), f"{devices[0].device_kind} memory limit (memory_stats)"
  try:
    with open("/proc/meminfo") as f:
      info = dict(line.split(":", 1) for line in f)
    host = int(info["MemAvailable"].split()[0]) * 1024
  except (OSError, KeyError, ValueError):
    try:
      host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
      return None
  return host // max(len(devices), 1), f"available host RAM / {max(len(devices), 1)} local CPU device(s)"


def check_fits(cfg: schema.Config, num_devices: int, devices: Any, num_processes: int = 1) -> None:
  """UserError (exit 2) with the estimate when the step's estimated peak per device exceeds what a
  device has: by arithmetic, before anything is allocated or compiled (a model far too large would
  otherwise hang in the host allocator or abort inside XLA). `runtime.check_memory=false` skips it."""
  if not cfg.runtime.check_memory:
    return
  found = available_memory(devices)
  if found is None:
    return
  limit, source = found
  est = estimate(cfg, num_devices, num_processes)
  if est.peak > limit:
    m = cfg.model
    raise UserError(
        f"the model does not fit: estimated peak {est.peak / GiB:,.1f} GiB per device (weights "
        f"{est.memory['weights'] / GiB:,.1f} + optimizer state {est.memory['optimizer_state'] / GiB:,.1f} + "
        f"activations and the rest {(est.peak - est.arguments + est.memory['other_state']) / GiB:,.1f} GiB; "
        f"{est.params['total']:,} parameters at model.d_model={m.d_model}, num_layers={m.num_layers}) > "
        f"{limit / GiB:,.1f} GiB ({source}). Use a smaller model, more devices (mesh.fsdp), "
        "remat or microbatches (tools/estimate.py shows the breakdown); runtime.check_memory=false to try anyway.")
