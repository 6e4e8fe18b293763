"""What the Loop (`loop/trainer.py`) drives: a Stepper, chosen by the plan's mode (`STEPPERS`, the one
place a mode is dispatched). Pretraining and SFT are the same stepper (one guarded update per step)
over different data; RL is `posttrain/rl.py` (a round of rollouts and several updates).

A Stepper has:
  unit               how logs and events name a step ("step", "round")
  updates_per_step   optimizer updates a step makes: the LR schedule is sized in updates (`program/plan.py`)
  spike_signal       what the in-graph spike guard watches ("loss", or "grad_norm" when the loss is ~0)
  evaluates_at_start whether the starting model is evaluated at step 0 (post-training's baseline)
  data               the run's data (the Data interface below)
  start(state, step)                        before an attempt's first step
  run(state, step) -> (state, Outcome)      the step that completes as `step`
  after_run(step, last), after_rollback(step, last)   host work after a step / a rollback
  guard(rollbacks, step, outcome, last)     the guard policy's verdict on the step (a Rollback or None)
  log_line(step, outcome)                   a post-training step's own console line (pretraining: none)
and a Data has describe, get_state/set_state, scalars, eval_sets, extra_eval, bytes_per_token,
newly_past_max_epochs, tokenizer_identity, unigram_entropy, check_checkpoint and close.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable

from maxtrain.config import schema
from maxtrain.loop.data import Data
from maxtrain.loop.observers import Observers
from maxtrain.models import registry
from maxtrain.posttrain.data import SftData
from maxtrain.posttrain.rl import Outcome, RlStepper
from maxtrain.program import build as program_lib
from maxtrain.posttrain.async_rollout import AsyncRlStepper

log = logging.getLogger("maxtrain")


class PretrainStepper:
  """One guarded update per step on the data's next batch (token stores, or SFT's packed rows). The
  next batch is read while the device runs the step, and the step's guard flags are read one step
  late (`loop/rollback.py` after_step), so dispatch never waits on the host."""
  unit = "step"
  updates_per_step = 1
  spike_signal = "loss"

  def __init__(self, cfg: schema.Config, data: Any, stage_programs: dict, observers: Observers,
               metrics: Any, compile_fn: Callable):
    self.cfg, self.data, self.stage_programs, self.observers, self.metrics = cfg, data, stage_programs, observers, metrics
    self.program = stage_programs[cfg.data.batch_size]
    self.evaluates_at_start = self.program.plan.mode == "sft"  # SFT: the starting model's eval (loss, exact match) is the baseline
    self._compile = compile_fn
    self._steps: dict[tuple[int, ...], Any] = {}  # the compiled step of each batch shape seen
    self.batch = None

  def describe(self) -> str:
    return "one update a step"

  def start(self, state: Any, step: int) -> None:
    self.batch = self._next_batch(step + 1)

  def run(self, state: Any, step: int) -> tuple[Any, Outcome]:
    state, metrics = self._step_for(state, self.batch)(state, self.batch)
    return state, Outcome(metrics)

  def after_run(self, step: int, last: bool) -> None:
    if not last:  # host work for the next batch overlaps the device running this step
      self.batch = self._next_batch(step + 1)

  def after_rollback(self, step: int, last: bool) -> None:
    if last:  # no next batch was read: read one (the data moves on past the bad step)
      self.batch = self._next_batch(step + 1)

  def guard(self, rollbacks: Any, step: int, outcome: Outcome, last: bool) -> Any:
    return rollbacks.after_step(step, outcome.metrics, last=last)

  def log_line(self, step: int, outcome: Outcome) -> None:
    pass  # MetricsLogger.train's step line says it all

  def _next_batch(self, step: int) -> dict:
    """The batch of the step that will complete as `step`, as the loop's observers leave it."""
    batch, wait_s = self.data.next_batch()
    self.metrics.data_wait(wait_s)
    return self.observers.batch(step, batch)

  def _step_for(self, state: Any, batch: dict) -> Any:
    """The compiled step for `batch`'s shape, compiled once per shape. A stage's batch size (a batch
    ramp) can change the microbatch count, so its step is built from the stage's config (`stage_config`);
    the state, its shardings and the LR schedule (in steps) are the same."""
    shape = batch["inputs"].shape
    if shape not in self._steps:
      program = self.stage_programs[shape[0]]
      if program is not self.program:
        log.info("data stage: global batch %d x %d; the step accumulates %d microbatches", *shape,
                 program.plan.batch.num_microbatches)
      self._steps[shape] = self._compile(program.train_step, state, batch, len(self._steps) + 1)
    self.metrics.tokens_per_step = math.prod(shape)
    self.metrics.flops_per_token = registry.flops_per_token(self.program.model_cfg, shape[1])  # attention grows with seq_len
    return self._steps[shape]


def make_stepper(cfg: schema.Config, program: program_lib.Program, stage_programs: dict, *, observers: Observers,
                 metrics: Any, out_dir: Path, compile_fn: Callable, starting_state: Callable) -> Any:
  """The stepper of the plan's mode, with its data (built here: bad data is exit 2 before compiling)."""
  mode = program.plan.mode
  if mode == "rl" and (cfg.post.rollout_devices or cfg.post.max_staleness):  # rollouts on their own thread (and devices)
    return AsyncRlStepper(cfg, program, observers, metrics, out_dir, starting_state, metrics.events)
  if mode == "rl":
    return RlStepper(cfg, program, observers, metrics, out_dir, starting_state)
  data = SftData(cfg, program.batch_shardings) if mode == "sft" else Data(cfg, program.batch_shardings)
  return PretrainStepper(cfg, data, stage_programs, observers, metrics, compile_fn)
