"""Ahead-of-time compile of the train step (the entry point is `maxtrain/cli/compile.py`, whose docstring
is the user's guide): lowers and compiles the real train step (`program.build.program_for`) for a mesh
of N fake CPU devices from abstract inputs, reads XLA:CPU's memory figures, checks them against a
device's memory, and lints the lowered step for Neuron (`hlo_lint.py`)."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

import jax

from maxtrain.config import schema
from maxtrain.errors import UserError
from maxtrain.models import registry
from maxtrain.program import fit
from maxtrain.program.fit import Memory, entry_buffers  # noqa: F401 (Memory: this module's figures)
from maxtrain.sharding import schedules
from maxtrain.sharding.mesh import AXES
from maxtrain.program.plan import Plan
from maxtrain.aot.estimate import boundary_bytes
from maxtrain.aot.hlo_lint import neuron_problems
from maxtrain.posttrain import rl_step
from maxtrain.program import build as program_lib

GiB = 2**30

CPU_CAVEAT = ("These are XLA:CPU's figures for the same sharded program: the GPU and Neuron compilers fuse and "
              "schedule differently, so treat the memory as an estimate and keep a margin.")


# On an NVIDIA GPU, XLA's RaggedDotRewriter expands lax.ragged_dot into a dense dot over every group too, unless
# its cuDNN ragged-dot fusion takes it (off by default; cuDNN >= 9.22): checked by tools/gpu_ragged_dot_memory.py.
GPU_RAGGED_CAVEAT = ("the stand-in's figures are those of a grouped-matmul kernel: XLA on an NVIDIA GPU expands "
                     "lax.ragged_dot into a dense dot over every expert as XLA:CPU does (RaggedDotRewriter) unless "
                     "--xla_gpu_experimental_use_ragged_dot_fusion=true with cuDNN >= 9.22 "
                     "(tools/gpu_ragged_dot_memory.py shows which on the device)")


def standin_wanted(cfg: schema.Config) -> bool:
  """Whether an ahead-of-time compile of `cfg` on XLA:CPU measures the model's memory stand-in
  (`program/fit.py` memory_standin): for a GPU or Trainium target, when the model has a part XLA:CPU lowers
  far from its memory there. A CPU target's own figures are XLA:CPU's."""
  return cfg.runtime.platform != "cpu" and bool(fit.cpu_far_parts(registry.model_config(cfg.model)))


def cpu_caveats(cfg: schema.Config, standin: bool = False) -> list[str]:
  """Where XLA:CPU's memory for this config is known to differ from a GPU's by far (beyond CPU_CAVEAT), or, for a
  compile of the memory stand-in (`standin`), what the stand-in changed."""
  # one line per part of fit.cpu_far_parts, the predicate the stand-in asks too
  model = registry.model_config(cfg.model)
  parts = fit.cpu_far_parts(model)
  if standin:
    return [f"memory stand-in (--standin=off: the model as it is): {line}" for line in fit.standin_changes(model)] + (
        [GPU_RAGGED_CAVEAT] if fit.DROPLESS in parts else [])
  lines = {
      fit.DROPLESS: "model.moe.dispatch=dropless: XLA:CPU lowers lax.ragged_dot densely (every token times every "
                    "expert), so the MoE layers' temporaries here are far above a grouped-matmul kernel's "
                    "(gpt_oss_20b: ~431 GiB per device on one node whatever the remat): for a GPU or Trainium target "
                    "(runtime.platform, e.g. --config.hardware=h100x8) maxtrain.compile measures a memory stand-in "
                    "instead (--standin=auto).",
      fit.UNSCANNED_REMAT: f"unscanned layers with model.remat={model.remat}: XLA:CPU keeps no remat in an unscanned "
                           "stack (it merges each layer's recompute back into its forward: tools/remat_unscanned.py), "
                           "so the temporaries here are those of remat=none; for a GPU or Trainium target "
                           "maxtrain.compile measures a scanned stand-in of the same parameters instead "
                           "(--standin=auto)."}
  return [lines[part] for part in parts]


def backend_initialized() -> bool:
  from jax._src import xla_bridge  # no public API says whether the backends exist yet

  return xla_bridge.backends_are_initialized()


def use_cpu_devices(num_devices: int) -> None:
  """Makes the JAX backend N fake CPU devices. Works only before the backend starts (the first
  `jax.devices()`): XLA reads its flags, and jax its platform list, once per process."""
  if num_devices < 1:
    raise UserError(f"--devices={num_devices}: must be >= 1")
  if backend_initialized():
    platform, count = jax.default_backend(), jax.device_count()
    if platform != "cpu" or count != num_devices:
      raise UserError(
          f"the JAX backend is already running with {count} {platform} device(s); an ahead-of-time compile for "
          f"{num_devices} devices needs {num_devices} CPU devices, set before JAX starts. Run "
          "`python -m maxtrain.compile` in a fresh process (or call compile_train_step with the running count).")
    return
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={num_devices}"])
  os.environ["JAX_PLATFORMS"] = "cpu"
  jax.config.update("jax_platforms", "cpu")  # jax read JAX_PLATFORMS when it was imported


def default_devices(cfg: schema.Config) -> int:
  """One granule (node) of the config's mesh when its per-node sizes are all fixed (a hardware preset)."""
  sizes = [cfg.mesh[a] for a in AXES]
  if -1 in sizes:
    raise UserError(f"mesh {' x '.join(f'{a}={s}' for a, s in zip(AXES, sizes))} fills the devices it is given (-1): "
                    "pass --devices N (e.g. 8 for one 8-GPU node, 64 for one trn2.48xlarge)")
  return math.prod(sizes)


def xla_flops(compiled: Any) -> float | None:
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older jax: one dict per program
  return float(cost["flops"]) if cost and "flops" in cost else None


@dataclasses.dataclass(frozen=True)
class CompileReport:
  cfg: schema.Config
  num_devices: int
  plan: Plan
  lowered: Any  # jax.stages.Lowered: .as_text() is the StableHLO the compiler was given
  compiled: Any  # jax.stages.Compiled: .as_text() is the optimized, partitioned HLO of one device
  memory: Memory
  num_params: int
  model_flops: float  # per device per step: ModelConfig.train_flops_per_token x tokens / devices
  xla_flops: float | None  # per device per step, from XLA's cost analysis (loop bodies counted once)
  lower_seconds: float
  compile_seconds: float
  remat_table: str = ""  # model.remat=auto: the candidates and the chosen policy (program/fit.py); cfg has it
  schedule_table: str = ""  # pipeline.schedule=auto: the schedules compiled and the one chosen (program/schedule_fit.py)
  standin: bool = False  # compiled the model's memory stand-in (program/fit.py memory_standin), not the model

  @property
  def loops(self) -> list[str]:
    """The loops whose bodies XLA's cost analysis counts once."""
    loops = []  # the family's pieces decide whether the layers are scanned (some families' are not)
    model = registry.model_config(self.cfg.model)
    if self.standin:
      model = fit.memory_standin(model)
    if model.scan_layers and self.cfg.model.num_layers > 1:
      loops.append(f"the {self.cfg.model.num_layers} scanned layers (model.scan_layers=True)")
    if self.plan.batch.num_microbatches > 1:
      loops.append(f"the {self.plan.batch.num_microbatches} microbatches (optimizer.grad_accum_steps)")
    if self.plan.pipeline:
      loops.append(f"the {self.plan.pipeline.iterations} pipeline iterations")
    return loops

  def stage_lines(self) -> list[str]:
    """Per-stage memory under the pipeline. The step is one SPMD program: every device of every stage runs
    it with the same buffers, so each stage's peak is the compiled peak and so is their max (the estimate,
    tools/estimate.py, splits a stage's saved activations into useful and bubble iterations)."""
    schedule = self.plan.pipeline
    if not schedule:
      return []
    layers = self.cfg.model.num_layers // schedule.stages
    held = [int(x) for x in schedules.held(schedules.table(schedule))]
    return [f"  per stage       {self.memory.peak / GiB:9.3f} GiB  on each of the {schedule.stages} stages ({layers} "
            f"layers each; one SPMD program, the same buffers on every stage): max {self.memory.peak / GiB:.3f} GiB",
            f"  activations     {self.memory.temporaries / GiB:9.3f} GiB  per stage (temporaries); {schedule.kind} holds "
            f"{held} microbatches' activations per stage (schedule table, bubble {schedules.bubble(schedules.table(schedule)):.4f})"]

  def describe(self) -> str:
    cfg, m, mem = self.cfg, self.cfg.model, self.memory
    k, micro = self.plan.batch.num_microbatches, self.plan.batch.per_microbatch
    lines = [
        f"compiled on {self.num_devices} fake CPU devices (XLA:CPU), not on runtime.platform={cfg.runtime.platform}",
        f"mesh: {self.plan.mesh.describe()}",
        *([f"pipeline: {self.plan.pipeline.describe()}; {boundary_bytes(cfg, self.plan) / 2**20:.2f} MiB per device "
           "to the next stage per step"] if self.plan.pipeline else []),
        f"model: {self.num_params / 1e9:.3f}B parameters ({m.num_layers} layers, d_model {m.d_model}, "
        f"{m.num_heads}/{m.num_kv_heads} heads, d_ff {m.d_ff}, vocab {m.vocab_size}); params {m.param_dtype}, "
        f"compute {m.compute_dtype}, remat {m.remat}",
        f"batch: {cfg.data.batch_size} x {cfg.data.seq_len} tokens, grad_accum_steps {k} "
        f"({micro} sequence(s) per device per microbatch); optimizer {cfg.optimizer.name}, state "
        f"{cfg.optimizer.state_dtype}, offload {cfg.optimizer.offload}",
        *([f"step: RL ({cfg.post.algorithm}), one optimizer update on a minibatch of {cfg.data.batch_size} rollout rows "
           f"(a round makes {self.plan.updates_per_step})"] if self.plan.mode == "rl" else []),
        "per-device memory (Compiled.memory_analysis): device, and host (pinned_host) beside it",
        f"  arguments       {mem.arguments / GiB:9.3f} GiB  host {mem.host_arguments / GiB:9.3f} GiB  "
        f"(train state + batch{'; the optimizer state on the host' if mem.host_arguments else ''})",
        f"  outputs         {mem.outputs / GiB:9.3f} GiB  host {mem.host_outputs / GiB:9.3f} GiB",
        f"  aliased         {mem.aliased / GiB:9.3f} GiB  host {mem.host_aliased / GiB:9.3f} GiB  (donated state "
        "reused for the new state)",
        f"  temporaries     {mem.temporaries / GiB:9.3f} GiB  host {mem.host_temporaries / GiB:9.3f} GiB  "
        "(activations, gradients, gathered weights ...)",
        f"  generated code  {mem.generated_code / GiB:9.3f} GiB",
        f"  peak            {mem.peak / GiB:9.3f} GiB  host {mem.host / GiB:9.3f} GiB  = arguments + outputs - "
        "aliased + temporaries",
        *self.stage_lines(),
        f"  {CPU_CAVEAT}",
        *(f"  caveat: {line}" for line in cpu_caveats(cfg, self.standin)),
        "FLOPs per device per step:",
        f"  model (analytic)  {self.model_flops / 1e12:12.3f} TFLOP  = train_flops_per_token x "
        f"{cfg.data.batch_size * cfg.data.seq_len} tokens / {self.num_devices} devices",
    ]
    if self.xla_flops is None:
      lines.append("  XLA cost analysis: unavailable")
    elif self.loops:
      lines.append(f"  XLA cost analysis {self.xla_flops / 1e12:12.3f} TFLOP  NOT the step total: XLA:CPU counts each "
                   f"loop body once, here {' and '.join(self.loops)}")
    else:
      lines.append(f"  XLA cost analysis {self.xla_flops / 1e12:12.3f} TFLOP  ({self.xla_flops / self.model_flops:.2f} x "
                   "model: includes remat recompute, elementwise work and the optimizer)")
    if self.remat_table:
      lines.append(self.remat_table)
    if self.schedule_table:
      lines.append(self.schedule_table)
    lines.append(f"time: lower {self.lower_seconds:.1f} s, compile {self.compile_seconds:.1f} s"
                 + (" (model.remat=auto compiled its candidates within the lower)" if self.remat_table else ""))
    return "\n".join(lines)


def compile_train_step(cfg: schema.Config, num_devices: int, standin: bool | None = None) -> CompileReport:
  """Compiles `cfg`'s train step for `num_devices` fake CPU devices (set up here when the backend has
  not started; otherwise it must already be that many CPU devices). `standin`: compile the model's memory
  stand-in (`program/fit.py` memory_standin); None: when `standin_wanted`."""
  use_cpu_devices(num_devices)
  standin = standin_wanted(cfg) if standin is None else standin
  t0 = time.perf_counter()
  program = program_lib.program_for(cfg, jax.devices(), require_data=False, memory_standin=standin)
  plan = program.plan
  if plan.mode == "rl":  # the step an RL run compiles: its algorithm's objective on a minibatch (posttrain/rl_step.py)
    lowered = rl_step.for_config(program).lower()
  else:
    lowered = program.lower()
  t1 = time.perf_counter()
  with jax.set_mesh(program.mesh):
    compiled = lowered.compile()
  t2 = time.perf_counter()
  return CompileReport(
      cfg=program.cfg, num_devices=num_devices, plan=plan, remat_table=program.remat_table,
      schedule_table=program.schedule_table, lowered=lowered, compiled=compiled, memory=Memory.of(compiled),
      num_params=sum(x.size for x in jax.tree.leaves(program.state.abstract.params)),
      model_flops=program.flops_per_token * plan.batch.tokens / num_devices, xla_flops=xla_flops(compiled),
      lower_seconds=t1 - t0, compile_seconds=t2 - t1, standin=standin)


def check_fits(report: CompileReport, device_memory_gib: float) -> str:
  """A line saying how the peak compares with the device memory; raises UserError when over it."""
  mem, limit = report.memory, device_memory_gib * GiB
  if mem.peak <= limit:
    return (f"fits: peak {mem.peak / GiB:.2f} GiB of {device_memory_gib:g} GiB per device "
            f"({1 - mem.peak / limit:.0%} headroom)")
  cfg, layout = report.cfg, report.plan.layout
  k, micro = report.plan.batch.num_microbatches, report.plan.batch.per_microbatch
  state_fixes = [f"shard the state over more devices ({layout.describe('embed')}, or the axes of the other "
                 "parameter dims: maxtrain/sharding/rules.py)"]
  if cfg.optimizer.state_dtype != "bfloat16":
    state_fixes.append("optimizer.state_dtype=bfloat16 (halves the moments)")
  activation_fixes = []
  if cfg.model.remat != "full":
    activation_fixes.append(f"model.remat=full (now {cfg.model.remat})")
  if micro > 1:
    activation_fixes.append(f"more optimizer.grad_accum_steps (now {k}: {micro} sequences per device per microbatch)")
    activation_fixes.append(f"a smaller data.batch_size (now {cfg.data.batch_size})")
  activation_fixes.append(f"a shorter data.seq_len (now {cfg.data.seq_len}; each sequence's attention scores grow "
                          "with its square)")
  arguments = mem.arguments
  fixes = state_fixes + activation_fixes if arguments > mem.temporaries else activation_fixes + state_fixes
  raise UserError(
      f"the train step needs {mem.peak / GiB:.2f} GiB per device (XLA:CPU peak: arguments {arguments / GiB:.2f} GiB "
      f"for the train state, + temporaries {mem.temporaries / GiB:.2f} GiB for activations and gradients), over "
      f"--device-memory-gb={device_memory_gib:g}. To fit, try: {'; '.join(fixes)}."
      + "".join(f" Caveat: {line}" for line in cpu_caveats(cfg, report.standin)))


def neuron_lint(report: CompileReport) -> str:
  """The lowered step (what the Neuron plugin would be given) checked for what neuronx-cc rejects;
  raises UserError listing the problems. The step draws no random numbers, so the PRNG is not checked."""
  problems = neuron_problems(report.lowered.as_text(dialect="hlo"), check_prng=False)
  if problems:
    raise UserError("the train step would not compile on Neuron: " + "; ".join(map(str, problems[:10])))
  return "Neuron lint of the lowered train step: clean (no conditional, host callback, dynamic loop, variadic " \
         "reduce, integer matmul or f8e4m3fn)"
