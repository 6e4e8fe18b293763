"""The one builder of what runs: model spec, optimizer, state spec, batch spec and the jitted train and
eval steps, from a config and the devices it runs on (`program_for`). The trainer, `python -m
maxtrain.compile`, generation's loader and the tools all build here, so none can drift from the program
the trainer runs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxtrain.config import schema
from maxtrain.program import batch as batch_lib, critic
from maxtrain.program import drills
from maxtrain.program import fit
from maxtrain.program import loss
from maxtrain.optim import offload
from maxtrain.optim import optimizer as optim
from maxtrain.program import state as state_lib
from maxtrain.program import step as step_lib
from maxtrain.models import quant
from maxtrain.models import registry
from maxtrain.models.decoder import ModelConfig
from maxtrain.sharding.layout import with_shardings
from maxtrain.sharding.mesh import make_mesh
from maxtrain.program.plan import Plan, schedule_config, validate
from maxtrain.program import schedule_fit

log = logging.getLogger("maxtrain")


@dataclasses.dataclass(frozen=True)
class Program:
  cfg: schema.Config
  plan: Plan
  mesh: Mesh
  model_cfg: ModelConfig
  optimizer: optim.Optimizer
  state: state_lib.StateSpec
  batch_shardings: dict[str, NamedSharding]
  train_step: Callable  # jitted: (state, batch) -> (state, metrics); the state is donated
  eval_step: Callable  # jitted: (params, batch) -> (loss sum, loss tokens)
  remat_table: str = ""  # model.remat=auto: the candidates compiled and the one chosen (program/fit.py)
  schedule_table: str = ""  # pipeline.schedule=auto: the schedules compiled and the one chosen (program/schedule_fit.py)

  @property
  def flops_per_token(self) -> float:
    return registry.flops_per_token(self.model_cfg, self.plan.batch.seq_len)

  def abstract_state(self) -> state_lib.TrainState:
    """ShapeDtypeStructs carrying their shardings: inputs of an ahead-of-time lowering or a restore."""
    return with_shardings(self.state.abstract, self.state.shardings)

  def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
    return drills.abstract_batch(self.batch_shardings, batch_lib.abstract(self.plan.batch, self.batch_shardings))

  def lower(self) -> Any:
    """The train step lowered from abstract inputs, as the trainer compiles it (no array allocated)."""
    with jax.set_mesh(self.mesh):
      return self.train_step.lower(self.abstract_state(), self.abstract_batch())


def loss_chunk_tokens(model_cfg: schema.Model) -> int:
  """`model.loss_chunk_tokens`, with -1 resolved by the vocabulary size."""
  n = model_cfg.loss_chunk_tokens
  return loss.default_chunk_tokens(model_cfg.vocab_size) if n < 0 else n


def build(cfg: schema.Config, plan: Plan, mesh: Mesh | None = None, *,
          memory_standin: bool = False) -> Program:
  """Everything but the state's values and the data. Raises UserError for a layout that does not
  divide the model or would replicate most of it. `memory_standin`: the model `fit.memory_standin` makes of
  it, for an ahead-of-time compile's memory only (never run)."""
  cfg = schema.Config.of(cfg)  # typed once (a tool or test may hand the ConfigDict)
  mesh = make_mesh(plan.mesh) if mesh is None else mesh
  rules = plan.layout.rules
  model_cfg = registry.model_config(cfg.model)
  if memory_standin:
    model_cfg = fit.memory_standin(model_cfg)
  optimizer = optim.make(*schedule_config(cfg, plan.updates_per_step))  # the schedule in optimizer updates
  if plan.critic:  # PPO: a value head and its own optimizer state ride in the optimizer state
    optimizer = critic.with_critic(optimizer, model_cfg.d_model, cfg.post.critic_lr)
  # The model as every step runs it: laid out by the plan's rules, its stacks through the plan's pipeline.
  state_spec = state_lib.spec(model_cfg, optimizer.tx, mesh, cfg.seed, rules, guard_window=cfg.guards.spike_window,
                              offload_optimizer=offload.enabled(cfg.optimizer), pipeline=plan.pipeline)
  row_shardings = batch_lib.shardings(mesh, plan.layout)
  batch_shardings = drills.batch_shardings(cfg.faults, mesh, row_shardings)  # + the fault input only when drilled
  replicated = NamedSharding(mesh, P())
  # Each batch shard keeps its own partial head gradient across loss chunks (maxtrain/program/loss.py).
  chunking = dict(chunk_tokens=loss_chunk_tokens(cfg.model), batch_shards=plan.layout.shards("act_batch"),
                  length_shards=plan.layout.shards("act_length"))
  make_step = functools.partial(step_lib.make_train_step, state_spec.graphdef, optimizer, z_loss=cfg.optimizer.z_loss,
                                moe=model_cfg.moe, grad_accum_steps=plan.batch.num_microbatches,
                                spike_zscore=cfg.guards.spike_zscore, spike_warmup=cfg.guards.spike_warmup, **chunking)
  step = drills.wrap_step(cfg.faults, make_step)  # a fault input and its injection only when config.faults sets one
  train_step = jax.jit(step, in_shardings=(state_spec.shardings, batch_shardings),
                       out_shardings=(state_spec.shardings, replicated), donate_argnums=0)
  eval_step = jax.jit(step_lib.make_eval_step(state_spec.graphdef, **chunking),
                      in_shardings=(state_spec.shardings.params, row_shardings), out_shardings=replicated)
  return Program(cfg=cfg, plan=plan, mesh=mesh, model_cfg=model_cfg, optimizer=optimizer, state=state_spec,
                 batch_shardings=batch_shardings, train_step=train_step, eval_step=eval_step)


def program_for(cfg: schema.Config, devices: Sequence[jax.Device], *,
                require_data: bool = True, memory_standin: bool = False) -> Program:
  """The program `cfg` runs on `devices`: validated to a Plan (UserError on a bad config, before anything
  is built), then built on a mesh over exactly those devices. The process count is that of the devices,
  so a subset of one process's devices plans as a one-process run. `require_data=False`: no data source
  needed (ahead-of-time compiles, generation, benchmarks on synthetic batches). `memory_standin`: build the
  model's memory stand-in (`fit.memory_standin`: an ahead-of-time compile for a GPU/Trainium target on
  XLA:CPU; its values are not the model's, so it is compiled, never run)."""
  cfg, devices = schema.Config.of(cfg), list(devices)  # typed once (a tool or test may hand the ConfigDict)
  num_processes = len({d.process_index for d in devices})
  plan = validate(cfg, len(devices), num_processes, require_data=require_data)
  every, devices = devices, split_devices(cfg, devices)[0]  # the trainer's devices (post.rollout_devices: not the last)
  quant.check_devices(cfg.model, devices)
  offload.check_devices(cfg.optimizer, devices, cfg.runtime.platform)
  if cfg.model.remat == "offload":  # activations go to the same host memory kind
    offload.check_host_memory("model.remat=offload", devices, cfg.runtime.platform)
  table = schedule_table = ""
  if cfg.model.remat == "auto":  # each candidate is planned as this program is: on every device
    cfg, table = resolve_remat(cfg, every, memory_standin)
  if cfg.pipeline.schedule == "auto" and plan.pipeline is not None:
    cfg, schedule_table = resolve_schedule(cfg, every, memory_standin)
    plan = validate(cfg, len(every), num_processes, require_data=require_data)
  return dataclasses.replace(build(cfg, plan, make_mesh(plan.mesh, devices), memory_standin=memory_standin),
                             remat_table=table, schedule_table=schedule_table)


def resolve_schedule(cfg: schema.Config, devices: Sequence[jax.Device],
                     memory_standin: bool = False) -> tuple[schema.Config, str]:
  """`cfg` with `pipeline.schedule=auto` replaced by the schedule `program/schedule_fit.py` chooses from the
  ahead-of-time compile of each candidate on `devices` (of the memory stand-in when asked), and the table of
  candidates (also logged)."""

  def compile_candidate(trial: schema.Config):
    program = program_for(trial, devices, require_data=False, memory_standin=memory_standin)
    with jax.set_mesh(program.mesh):
      return program.lower().compile(), program.plan

  kind, table, _ = schedule_fit.choose_schedule(cfg, devices, compile_candidate)
  log.info("%s", table)
  return schedule_fit.resolved(cfg, kind, len(devices)), table  # NO_PIPELINE: the stages' devices become fsdp


def split_devices(cfg: schema.Config, devices: Sequence[jax.Device]) -> tuple[list, list]:
  """(the trainer's devices, the rollout side's): post.rollout_devices takes the last ones (validated by
  `plan.validate`); without it the trainer has them all and the rollout side none."""
  devices, n = list(devices), cfg.post.rollout_devices
  return (devices[:len(devices) - n], devices[len(devices) - n:]) if n else (devices, [])


def resolve_remat(cfg: schema.Config, devices: Sequence[jax.Device],
                  memory_standin: bool = False) -> tuple[schema.Config, str]:
  """`cfg` with `model.remat=auto` replaced by the policy `program/fit.py` chooses for the target from the
  ahead-of-time compile of each candidate on `devices` (of its memory stand-in with `memory_standin`), and the
  table of candidates (also logged)."""
  def compile_candidate(trial: schema.Config):
    program = program_for(trial, devices, require_data=False, memory_standin=memory_standin)
    with jax.set_mesh(program.mesh):
      return program.lower().compile(), program.plan

  remat, table, _ = fit.choose_remat(cfg, devices, compile_candidate, memory_standin)
  log.info("%s", table)
  return schema.with_values(cfg, {"model.remat": remat}), table
