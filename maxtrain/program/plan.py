"""Validation of a loaded config, once, before data is touched or anything compiles. Each component
checks its own section (`models/registry.py`, `optim.py`, `guards.py`; the checkpoint and monitor sections
in `config/sections.py`, pure functions beside the keys, so validating imports neither Orbax nor a server);
the mesh and the batch are laid out here, as values, and returned as a `Plan` (the config is never changed).

Errors are UserErrors (exit 2) that name the key, the values, the arithmetic and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any

from maxtrain.config import schema, sections
from maxtrain.data import mixture
from maxtrain.program import guards
from maxtrain.optim import optimizer as optim
from maxtrain.program.batch import BatchLayout
from maxtrain.errors import UserError, choice, require
from maxtrain.models import registry
from maxtrain.sharding import mesh as mesh_lib
from maxtrain.sharding import pipeline as pipeline_lib
from maxtrain.sharding import rules as rules_lib
from maxtrain.sharding.layout import Layout


@dataclasses.dataclass(frozen=True)
class Plan:
  """What a validated config resolves to on the devices at hand."""
  mesh: mesh_lib.MeshLayout
  layout: Layout  # the mesh sizes and the rule set: how logical dims are split
  batch: BatchLayout
  pipeline: pipeline_lib.Schedule | None = None  # None: no pipeline (one stage)
  mode: str = ""  # "" pretraining | "sft" | "rl" (post.mode, its alias grpo resolved)
  updates_per_step: int = 1  # optimizer updates a step makes (an RL round's): the LR schedule's unit
  critic: bool = False  # the RL algorithm learns a value function: the state carries a critic (program/critic.py)
  fleet: sections.Fleet | None = None  # config.fleet, typed and checked (the straggler monitor's; set by validate)


CRITIC_ALGORITHMS = ("ppo",)  # post.algorithm values whose state carries a critic (posttrain/algorithms: critic=True)
MODES = {"": "", "sft": "sft", "rl": "rl", "grpo": "rl"}  # post.mode -> the plan's mode (grpo: rl with post.algorithm=grpo)


def canonical_mode(mode: str) -> str:
  """The plan's mode of a `post.mode` value (an unknown value is returned as is)."""
  return MODES.get(mode, mode)


def describe_mode(mode: str) -> str:
  return {"": "pretraining (post.mode='')", "sft": "SFT (post.mode='sft')", "rl": "RL (post.mode='rl')"}.get(
      mode, f"post.mode={mode!r}")


def _floats(cfg: schema.Config, prefix: str = "") -> list[tuple[str, float]]:
  out = []
  for key, value in cfg.items():
    if hasattr(value, "items"):  # a section
      out += _floats(value, f"{prefix}{key}.")
    elif isinstance(value, float):
      out.append((prefix + key, value))
  return out


def validate(cfg: schema.Config, num_devices: int, num_processes: int = 1, *,
             require_data: bool = True) -> Plan:
  """Checks everything that can be checked before touching data or compiling (`require_data=False`:
  everything but the data source, for ahead-of-time compiles)."""
  bad = [f"config.{k}={v}" for k, v in _floats(cfg) if not math.isfinite(v)]
  require(not bad, f"{', '.join(bad)}: must be a finite number")
  for key in ("steps", "log_every"):
    require(cfg[key] > 0, f"config.{key}={cfg[key]}: must be > 0")
  registry.validate(cfg.model)
  for kernel, platform in (("cudnn", "gpu"), ("nki", "neuron")):
    require(cfg.model.attention != kernel or cfg.runtime.platform in (platform, "auto"),
            f"config.model.attention={kernel} runs only on runtime.platform={platform}, not "
            f"runtime.platform={cfg.runtime.platform}: use model.attention=flash (or auto)")
  d = cfg.data
  require(bool(d.corpus) or bool(d.path) or bool(d.sources) or not require_data,
          "config.data.corpus and config.data.path are both empty: set data.path to a token store "
          "prefix (tools/index_data.py) or data.corpus to 'python-stdlib'")
  require(d.max_epochs >= 0, f"config.data.max_epochs={d.max_epochs}: must be >= 0 (0 = no limit)")
  require(d.read_ahead >= 0 and d.read_threads >= 1, f"config.data.read_ahead={d.read_ahead}, data.read_threads="
          f"{d.read_threads}: need read_ahead >= 0 (0 = no read-ahead) and read_threads >= 1")
  require(0 < d.seq_len <= cfg.model.max_seq_len,
          f"config.data.seq_len={d.seq_len} must be in 1..model.max_seq_len={cfg.model.max_seq_len}")
  require(cfg.optimizer.decay_steps >= 0,
          f"config.optimizer.decay_steps={cfg.optimizer.decay_steps}: must be >= 0 (0 = steps)")
  optim.validate(cfg.optimizer)
  guards.validate(cfg.guards)
  sections.checkpoint(cfg.checkpoint)
  sections.monitor(cfg.monitor)
  fleet = sections.typed(sections.Fleet, cfg.fleet, "fleet")
  _validate_fleet(cfg, num_processes)
  require(cfg.eval.every_steps >= 0, f"config.eval.every_steps={cfg.eval.every_steps}: must be >= 0")
  require(cfg.eval.batches > 0, f"config.eval.batches={cfg.eval.batches}: must be > 0")

  choice("mesh.rules", cfg.mesh.rules, tuple(rules_lib.RULE_SETS))
  rollout_devices, rollout_processes = _validate_rollout_devices(cfg, num_devices, num_processes)
  num_devices -= rollout_devices  # the trainer's mesh: the rest (across hosts: its processes only)
  num_processes -= rollout_processes
  mesh_layout = mesh_lib.from_config(cfg.mesh, num_devices)
  layout = Layout(mesh_layout.sizes, rules_lib.get(cfg.mesh.rules))
  unused = layout.unused_axes()
  require(not unused, f"mesh {mesh_layout.describe()}: rule set mesh.rules={cfg.mesh.rules!r} maps nothing to mesh "
          f"axis {', '.join(unused)}, so its devices would duplicate each other's work. Set "
          f"{', '.join(f'mesh.{a}=1' for a in unused)}, or choose a rule set that uses it (maxtrain/sharding/rules.py).")
  _validate_expert_parallel(cfg.model.moe, layout, mesh_layout)
  batch = BatchLayout.plan(d, cfg.optimizer, layout, f"mesh {mesh_layout.describe()}", num_processes)
  _validate_stages(cfg, layout, f"mesh {mesh_layout.describe()}", num_processes)
  # Each process loads whole rows of its own batch shards (data/pipeline.py): a sequence split over
  # devices must not be split over processes too.
  per_process, split = num_devices // num_processes, layout.shards("act_length") * layout.shards("act_heads")
  require(layout.shards("act_length") == 1 or per_process % split == 0,
          f"mesh {mesh_layout.describe()}: a sequence is split over {layout.describe('act_length')} (x the tensor "
          f"axis = {split} devices), more than or not dividing each process's {per_process} devices. Run one process "
          "per node, or a smaller mesh.context.")
  # Context-parallel attention is the flash core on each shard (sharding/context_attention.py): any
  # other kernel would be silently replaced.
  require(layout.shards("act_length") == 1 or cfg.model.attention in ("auto", "flash"),
          f"config.model.attention={cfg.model.attention} with a sequence split over {layout.describe('act_length')}: "
          "context-parallel attention runs the flash kernel on each shard. Set model.attention=flash (or auto), "
          "or mesh.context=1.")
  schedule = _validate_pipeline(cfg, layout, batch, f"mesh {mesh_layout.describe()}")
  mode, updates = _validate_post(cfg, layout, batch, schedule, mesh_layout)
  return Plan(mesh=mesh_layout, layout=layout, batch=batch, pipeline=schedule, mode=mode, updates_per_step=updates,
              critic=mode == "rl" and cfg.post.algorithm in CRITIC_ALGORITHMS, fleet=fleet)


def _validate_post(cfg: schema.Config, layout: Layout, batch: BatchLayout,
                   schedule: pipeline_lib.Schedule | None,
                   mesh_layout: mesh_lib.MeshLayout) -> tuple[str, int]:
  """post.*: the mode, and for RL the round's arithmetic and what its step supports (the algorithm's own
  keys are resolved by the registry, `posttrain/algorithms`). Returns (mode, optimizer updates per step)."""
  p, b = cfg.post, cfg.data.batch_size
  choice("post.mode", p.mode, tuple(MODES))
  mode = MODES[p.mode]
  require(p.eval_prompts >= 0, f"config.post.eval_prompts={p.eval_prompts}: must be >= 0 (0 = off)")
  require(1 <= p.max_new_tokens <= cfg.model.max_seq_len, f"config.post.max_new_tokens={p.max_new_tokens}: must be "
          f"in 1..model.max_seq_len={cfg.model.max_seq_len}")
  if mode != "rl":
    return mode, 1
  require(p.mode != "grpo" or p.algorithm == "grpo", f"config.post.mode='grpo' is post.mode=rl with post.algorithm="
          f"grpo, but post.algorithm={p.algorithm!r}: set post.mode=rl to run {p.algorithm!r}")
  for key in ("prompts_per_step", "group_size", "ppo_epochs", "minibatches"):
    require(p[key] >= 1, f"config.post.{key}={p[key]}: must be >= 1")
  require(p.group_size >= 2, f"config.post.group_size={p.group_size}: group baselines need >= 2 completions per prompt")
  rows = p.prompts_per_step * p.group_size
  require(rows % p.minibatches == 0 and b == rows // p.minibatches,
          f"config.data.batch_size={b} must be post.prompts_per_step x post.group_size / post.minibatches = "
          f"{p.prompts_per_step} x {p.group_size} / {p.minibatches}: the optimizer step's batch")
  require(p.temperature > 0, f"config.post.temperature={p.temperature}: RL samples, it must be > 0")
  require(0 < p.gamma <= 1 and 0 <= p.lam <= 1, f"config.post.gamma={p.gamma}, post.lam={p.lam}: need 0 < gamma <= 1 "
          "and 0 <= lam <= 1")
  require(p.value_clip > 0 and p.critic_lr > 0, f"config.post.value_clip={p.value_clip}, post.critic_lr={p.critic_lr}: "
          "both must be > 0")
  # The critic's parameters ride in the optimizer state (program/critic.py), which offload keeps in host memory:
  # the value head would run on host arrays. Not built yet.
  require(p.algorithm not in CRITIC_ALGORITHMS or cfg.optimizer.offload == "none",
          f"config.post.algorithm={p.algorithm} with optimizer.offload={cfg.optimizer.offload}: the critic lives in "
          "the optimizer state and cannot run from host memory; set optimizer.offload=none for PPO")
  require(batch.num_microbatches == 1, f"config.optimizer.grad_accum_steps={cfg.optimizer.grad_accum_steps}, "
          f"optimizer.microbatch_size={cfg.optimizer.microbatch_size}: {batch.num_microbatches} microbatches, but an RL "
          "update is one pass over its minibatch; use post.minibatches to split a round's rows into updates")
  # The RL step's forward pass and the generator run the layer stack whole: with the layers split into
  # pipeline stages they would silently not pipeline (each device would need every layer).
  require(schedule is None, f"config.post.mode={p.mode!r} with mesh {mesh_layout.describe()}: a pipeline of "
          f"{layout.describe('layers')} stages. The RL step and its rollouts do not run through the pipeline; set "
          "mesh.pipeline=1 (and mesh.dcn_pipeline=1) and shard the model with mesh.fsdp / mesh.tensor instead")
  _validate_async(cfg)
  return mode, p.ppo_epochs * p.minibatches


CORRECTIONS = ("none", "tis", "mis", "decoupled")  # post.correction (posttrain/correction.py)
DYNAMIC_SAMPLING_ALGORITHMS = ("dapo",)  # post.algorithm values that draw a variable number of prompt batches a round
ROW_LEVEL_ALGORITHMS = ("dr_grpo", "gspo", "ppo")  # losses that read whole rows (a per-row sum, the row count, a critic)


def _validate_rollout_devices(cfg: schema.Config, num_devices: int,
                              num_processes: int) -> tuple[int, int]:
  """post.rollout_devices: how many of the run's devices generate rollouts only (the last ones), checked
  before the trainer's mesh is laid out over the rest. Returns (rollout devices, rollout processes): on
  one host a part of its devices; across hosts whole processes (posttrain/remote_rollout.py), the last ones."""
  n = cfg.post.rollout_devices
  if not n:
    return 0, 0
  require(MODES.get(cfg.post.mode) == "rl", f"config.post.rollout_devices={n} with post.mode={cfg.post.mode!r}: "
          "a rollout mesh is for RL only; set post.rollout_devices=0")
  require(0 < n < num_devices, f"config.post.rollout_devices={n} leaves {num_devices} - {n} = {num_devices - n} "
          f"devices for the trainer: it must be in 0..{num_devices - 1} (0 = rollouts on the trainer's mesh)")
  if num_processes == 1:
    return n, 0
  per_process = num_devices // num_processes
  require(n % per_process == 0, f"config.post.rollout_devices={n} with {num_processes} processes of {per_process} "
          f"devices: across hosts the rollout side is whole processes (the last ones), so it must be a multiple of "
          f"{per_process}; set post.rollout_devices to one of "
          f"{', '.join(str(per_process * k) for k in range(1, num_processes))}")
  return n, n // per_process


def _validate_async(cfg: schema.Config) -> None:
  """The asynchronous rollout keys (posttrain/async_rollout.py) and the correction (posttrain/correction.py)."""
  p = cfg.post
  require(p.max_staleness >= 0, f"config.post.max_staleness={p.max_staleness}: policy versions a rollout may lag "
          "must be >= 0 (0 = synchronous)")
  require(p.max_staleness <= 64, f"config.post.max_staleness={p.max_staleness}: at most 64 versions are kept in "
          "flight; lower it")
  choice("post.correction", p.correction, CORRECTIONS)
  require(p.is_cap >= 1, f"config.post.is_cap={p.is_cap}: the importance-weight cap must be >= 1")
  require(p.sync_timeout_s > 0, f"config.post.sync_timeout_s={p.sync_timeout_s}: must be > 0 (seconds)")
  choice("post.rollout_dtype", p.rollout_dtype, ("", "float32", "bfloat16"))
  require(not p.rollout_dtype or p.rollout_devices, f"config.post.rollout_dtype={p.rollout_dtype} without "
          "post.rollout_devices: the dtype is the rollout mesh's; set post.rollout_devices > 0 or post.rollout_dtype=''")
  if p.rollout_devices or p.max_staleness:
    require(p.algorithm not in DYNAMIC_SAMPLING_ALGORITHMS, f"config.post.algorithm={p.algorithm} with "
            f"post.rollout_devices={p.rollout_devices}, post.max_staleness={p.max_staleness}: dynamic sampling draws a "
            "variable number of prompt batches a round, which the asynchronous rollout queue does not; set "
            "post.rollout_devices=0 and post.max_staleness=0, or choose another algorithm")
  require(not p.pack_updates or p.algorithm not in ROW_LEVEL_ALGORITHMS, f"config.post.pack_updates=True with "
          f"post.algorithm={p.algorithm}: its loss reads whole rows (a per-row sum, the row count or a critic's "
          "prefix), which packing several completions into a row would change; set post.pack_updates=False or "
          "choose a token-level algorithm (grpo, rloo, reinforce_pp, dapo)")
  # The generator records each token's log-probability under the model's own (temperature 1)
  # distribution: at another temperature the rollout policy's log-probs are not recorded, and a weight
  # pi_trainer / pi_rollout would compare two different distributions.
  require(p.correction == "none" or p.temperature == 1.0, f"config.post.correction={p.correction} with "
          f"post.temperature={p.temperature}: the rollout's log-probs are recorded at temperature 1 only, so there are "
          "no rollout log-probs to correct by; set post.temperature=1 or post.correction=none")


def _validate_pipeline(cfg: schema.Config, layout: Layout, batch: BatchLayout,
                       mesh_text: str) -> pipeline_lib.Schedule | None:
  """The circular pipeline's arithmetic, and what it does not support (docs/sharding.md), before compiling.
  None when the mesh has one stage."""
  p, m = cfg.pipeline, cfg.model
  choice("pipeline.schedule", p.schedule, pipeline_lib.SCHEDULES)
  require(p.microbatches >= 1 and p.repeats >= 1, f"config.pipeline.microbatches={p.microbatches}, pipeline.repeats="
          f"{p.repeats}: both must be >= 1")
  stages = layout.shards("layers")
  if stages == 1:
    require(p.repeats == 1 and p.microbatches == 1, f"config.pipeline.microbatches={p.microbatches}, pipeline.repeats="
            f"{p.repeats} without a pipeline ({mesh_text}): set mesh.pipeline (or mesh.dcn_pipeline) > 1, or leave both at 1")
    require(p.schedule in ("gpipe", "auto"), f"config.pipeline.schedule={p.schedule!r} without a pipeline ({mesh_text}): "
            "set mesh.pipeline (or mesh.dcn_pipeline) > 1, or leave pipeline.schedule=gpipe")
    return None
  where = f"{mesh_text}: a pipeline of {layout.describe('layers')} stages"
  moe = m.moe
  if moe.num_experts > 0 and moe.first_dense_layers:  # they run before the pipeline (models/decoder.py Decoder._forward)
    piped = m.num_layers - moe.first_dense_layers
    require(piped % (stages * p.repeats) == 0,
            f"{where}: the {piped} MoE layers (config.model.num_layers={m.num_layers} - model.moe.first_dense_layers="
            f"{moe.first_dense_layers}, which run before the pipeline on every stage) are not divisible by stages x "
            f"pipeline.repeats = {stages} x {p.repeats} = {stages * p.repeats}; each stage holds (num_layers - "
            "first_dense_layers) / (stages x repeats) MoE layers per repeat.")
  else:
    require(m.num_layers % (stages * p.repeats) == 0,
            f"{where}: config.model.num_layers={m.num_layers} is not divisible by stages x pipeline.repeats = {stages} x "
            f"{p.repeats} = {stages * p.repeats}; each stage holds num_layers / (stages x repeats) layers per repeat.")
  require(p.microbatches >= stages, f"{where}: config.pipeline.microbatches={p.microbatches} is fewer than the "
          f"{stages} stages; a circular pipeline needs microbatches >= stages (bubble (S-1)/(R*M+S-1)).")
  rows = batch.per_microbatch
  require(rows % p.microbatches == 0,
          f"{where}: config.pipeline.microbatches={p.microbatches} does not divide the {rows} sequences per batch shard"
          f" (data.batch_size={batch.global_size} / {batch.shards} batch shards / {batch.num_microbatches} gradient "
          f"accumulation steps). Use a batch_size that is a multiple of {p.microbatches} x {batch.shards} x "
          f"{batch.num_microbatches} = {p.microbatches * batch.shards * batch.num_microbatches}.")
  unsupported = [(layout.shards("act_length") > 1, "context parallelism (mesh.context > 1)")]
  bad = [text for hit, text in unsupported if hit]
  require(not bad, f"{where}: the pipeline does not support {', '.join(bad)}. Set mesh.pipeline=1 (and "
          "mesh.dcn_pipeline=1), or change those settings (docs/sharding.md lists what the pipeline supports).")
  # The balance loss is a product of two batch means (models/moe.py): its gradient for microbatch 1 needs the expert
  # loads of microbatch M, which these schedules have not run when they run microbatch 1's backward (gpipe's
  # autodiff has; the router z-loss is linear in its sums: step._moe_cotangent). Its value is reported regardless.
  require(p.schedule in ("gpipe", "auto") or not (moe.num_experts > 0 and moe.aux_loss_weight),
          f"{where}: config.pipeline.schedule={p.schedule!r} with model.moe.aux_loss_weight={moe.aux_loss_weight}: "
          "the MoE balance loss of a batch is E x sum_e f_e P_e over the whole batch, whose gradient for the first "
          "microbatch needs every microbatch's expert loads f_e, which this schedule has not computed when it runs "
          "the first backward. Use pipeline.schedule=gpipe, or set model.moe.aux_loss_weight=0 (balance the experts "
          "by model.moe.bias_update_rate, DeepSeek-V3's aux-loss-free bias)")
  # auto: planned as gpipe here; build.program_for compiles the candidates and plans the chosen one
  # (program/schedule_fit.py).
  require(p.schedule not in ("1f1b", "zb") or p.repeats == 1, f"{where}: config.pipeline.schedule={p.schedule!r} with "
          f"pipeline.repeats={p.repeats}: {p.schedule} runs one layer group per stage; set pipeline.repeats=1, or "
          "pipeline.schedule=interleaved_1f1b (or gpipe) for repeats")
  require(p.schedule != "interleaved_1f1b" or (p.repeats > 1 and p.microbatches % stages == 0),
          f"{where}: config.pipeline.schedule='interleaved_1f1b' with pipeline.repeats={p.repeats}, "
          f"pipeline.microbatches={p.microbatches}: it interleaves repeats > 1 layer groups per stage over groups of "
          f"S = {stages} microbatches; set pipeline.repeats >= 2 and microbatches a multiple of {stages} (or "
          "pipeline.schedule=1f1b for repeats=1)")
  return pipeline_lib.Schedule(stages=stages, microbatches=p.microbatches, repeats=p.repeats,
                               stage_remat=p.stage_remat, kind="gpipe" if p.schedule == "auto" else p.schedule,
                               branchless=cfg.runtime.platform == "neuron")


def _validate_stages(cfg: schema.Config, layout: Layout, mesh_text: str, num_processes: int) -> None:
  """data.sources and data.stages parse (names, weights, increasing steps), and every stage's batch (a batch
  ramp changes it) divides over the processes, batch shards and microbatches, before anything compiles."""
  _, stages = mixture.from_config(cfg.data)
  for stage in stages[1:]:
    where = f"config.data.stages at step {stage.step}"
    require(0 < stage.seq_len <= cfg.model.max_seq_len,
            f"{where}: seq_len={stage.seq_len} must be in 1..model.max_seq_len={cfg.model.max_seq_len}")
    shape = types.SimpleNamespace(batch_size=stage.batch_size, seq_len=stage.seq_len)
    try:
      BatchLayout.plan(shape, cfg.optimizer, layout, mesh_text, num_processes)
    except UserError as e:  # name the stage: the message's data.batch_size is the stage's
      raise UserError(f"{where} (batch_size={stage.batch_size}, seq_len={stage.seq_len}): {e}") from None


def stage_shapes(cfg: schema.Config) -> list[tuple[int, int]]:
  """The distinct (batch_size, seq_len) of the config's data stages, the first stage's first."""
  shapes = [(s.batch_size, s.seq_len) for s in mixture.from_config(cfg.data)[1]]
  return list(dict.fromkeys(shapes))


def stage_config(cfg: schema.Config, batch_size: int, seq_len: int) -> schema.Config:
  """`cfg` with the data shape of a stage (a batch ramp or a seq_len stage): what its step is built from.
  The LR schedule is in steps, so nothing else changes."""
  return schema.with_values(schema.Config.of(cfg), {"data.batch_size": batch_size, "data.seq_len": seq_len})


def _validate_expert_parallel(moe: Any, layout: Layout, mesh_layout: mesh_lib.MeshLayout) -> None:
  """Expert parallelism needs routed experts that divide over the expert shards and whole sequences per device."""
  shards = layout.shards("experts")
  if shards == 1:
    return
  where = f"mesh {mesh_layout.describe()} splits experts over {layout.describe('experts')}"
  require(moe.num_experts > 0, f"{where}, but config.model.moe.num_experts=0 (a dense model): set model.moe.num_experts "
          "or make that mesh axis 1")
  require(moe.num_experts % shards == 0, f"{where} ({shards} shards), which does not divide "
          f"config.model.moe.num_experts={moe.num_experts}: make the expert shards a divisor of it")
  require(layout.shards("act_length") == 1, f"{where} and sequences over {layout.describe('act_length')}: expert "
          "parallelism routes whole sequences per device (capacity slots are per sequence). Use one of the two.")


def _validate_fleet(cfg: schema.Config, num_processes: int) -> None:
  faults = cfg.faults  # (config.fleet: sections.Fleet checks itself)
  for key in ("process", "sigterm_process"):
    require(-1 <= faults[key] < num_processes, f"config.faults.{key}={faults[key]}: must be -1 or a process "
            f"index 0..{num_processes - 1} of this job's {num_processes} process(es)")
  require(faults.slow_step_s >= 0, f"config.faults.slow_step_s={faults.slow_step_s}: must be >= 0 (0 = off)")


total_steps = sections.schedule_steps  # the LR schedule's length in the run's steps (RL: rounds)


def schedule_config(cfg: Any, updates_per_step: int) -> tuple[Any, int]:
  """(optimizer config, schedule length), both in optimizer updates: the schedule's keys are written in
  the run's steps (warmup_steps, decay_steps, steps), and a step of an RL round makes `updates_per_step`
  updates, each of which advances the schedule one tick (a cosine over 40 rounds of 4 updates decays
  over 160 updates). One update a step: the config itself."""
  if updates_per_step == 1:
    return cfg.optimizer, total_steps(cfg)
  warmup = cfg.optimizer.warmup_steps * updates_per_step
  opt = schema.with_values(schema.Config.of(cfg).optimizer, {"warmup_steps": warmup})
  return opt, total_steps(cfg) * updates_per_step
