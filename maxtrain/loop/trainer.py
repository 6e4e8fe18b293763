"""The Loop: step -> guards -> metrics -> eval / checkpoint schedule, driving the Stepper the plan's
mode chooses (`loop/stepper.py`: pretraining and SFT one update a step, RL a round of rollouts and
updates); the loop never knows which kind of step it drives.

`Trainer.__init__` builds the run's components and does everything that can fail on bad input,
before compiling: the plan and the program (`program/build.py` program_for), the stepper and its data,
checkpoints (`checkpoint/schedule.py`), rollbacks (`loop/rollback.py`), metrics (`monitor/metrics.py`)
and the process's lifecycle (watchdog, signals, the drills observing the loop: `loop/drills.py`).
`Trainer.train` runs the loop.
Every attempt appends to `<output_dir>/events.jsonl` (monitor/events.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from pathlib import Path

import jax
from flax import nnx

from maxtrain import config as config_lib
from maxtrain.config import sections
from maxtrain.aot import estimate
from maxtrain.optim import optimizer as optim
from maxtrain.program import build as program_lib
from maxtrain.program import state as state_lib
from maxtrain.checkpoint.identity import RunIdentity
from maxtrain.checkpoint.schedule import Checkpoints
from maxtrain.config import schema
from maxtrain.loop import drills
from maxtrain.loop.observers import Observers
from maxtrain.loop.stepper import make_stepper
from maxtrain.errors import EXIT_CRASH, Aborted, Preempted, UserError, exit_code, require_writable_dir
from maxtrain.loop.rollback import Rollback, Rollbacks
from maxtrain.models import registry
from maxtrain.evaluation.in_loop import TaskEval  # noqa: I001 (lm-eval itself is imported only when eval.tasks is set)
from maxtrain.monitor import events as ev
from maxtrain.monitor import mfu as mfu_lib, tracking
from maxtrain.monitor.metrics import MetricsLogger
from maxtrain.monitor.profiler import Profiler
from maxtrain.monitor.routing import RoutingMonitor
from maxtrain.monitor.stragglers import StragglerMonitor
from maxtrain.monitor.watchdog import Watchdog
from maxtrain.runtime import cache, distributed
from maxtrain.runtime.kv import KeyValue
from maxtrain.runtime.lock import RunLock
from maxtrain.runtime.preemption import StopRequest
from maxtrain.program import plan as plan_lib
from maxtrain.program.plan import stage_config, stage_shapes
from maxtrain.interop import init_from
from maxtrain.posttrain import remote_rollout

log = logging.getLogger("maxtrain")


class Trainer:
  def __init__(self, cfg: schema.Config, t_process_start: float | None = None):
    self.cfg = cfg = schema.Config.of(cfg)  # typed at load by the shell; a test or tool may hand the ConfigDict
    self.t_start = time.monotonic() if t_process_start is None else t_process_start
    _initialize(cfg)
    self.kv = KeyValue.current()  # None with one process (or one trainer process)
    self.program = program_lib.program_for(cfg, jax.devices())
    # A batch ramp's stages each get their step's program, built (outside any mesh context) and checked now.
    self.stage_programs = {cfg.data.batch_size: self.program}
    for batch_size, seq_len in stage_shapes(cfg):  # arithmetic, before any allocation; every stage's batch
      estimate.check_fits(stage_config(cfg, batch_size, seq_len), jax.device_count(), jax.local_devices(),
                          jax.process_count())
      if batch_size not in self.stage_programs:
        self.stage_programs[batch_size] = program_lib.program_for(stage_config(cfg, batch_size, seq_len), jax.devices())
    self._eval_steps: dict[tuple[int, ...], object] = {}  # the compiled eval step of each eval batch shape
    warmup_note = sections.warmup(cfg, asked=False)  # the load refused the other cases
    if warmup_note:  # legal (short smoke runs), but never silent
      log.warning("%s", warmup_note)
    cache.configure_compile_cache(cfg.runtime.compile_cache_dir)
    self.out_dir = Path(cfg.output_dir)
    prepare_output_dir(self.out_dir)
    self.exit_code = EXIT_CRASH
    with contextlib.ExitStack() as stack:
      if jax.process_index() == 0:  # before anything is written there: a second trainer leaves no trace
        stack.callback(RunLock(self.out_dir).acquire().release)
      self.events = stack.enter_context(ev.EventLog(self.out_dir / ev.FILENAME, jax.process_index()))
      self.events.emit(ev.JOB_START, hosts=jax.process_count(), devices=jax.device_count(),
                       device_kind=jax.devices()[0].device_kind, config_hash=ev.config_hash(config_lib.redacted(cfg)))
      stack.callback(lambda: self.events.emit(ev.EXIT, self.step, code=self.exit_code))
      self.step = 0
      try:
        self._build_components(stack)
      except (UserError, KeyboardInterrupt) as e:  # the attempt's record ends here: bad input or Ctrl-C, not a crash
        self.exit_code = exit_code(e)
        raise
      self._resources = stack.pop_all()

  def _build_components(self, stack: contextlib.ExitStack) -> None:
    cfg, program = self.cfg, self.program
    # First in, last out: the watchdog also watches the exit (the wait for the last save and upload).
    self.watchdog = Watchdog(self.out_dir, self.events, cfg.watchdog.timeout_s, cfg.watchdog.startup_timeout_s,
                             kv=self.kv).start()
    stack.callback(self.watchdog.stop)
    peak_flops, peak_source, peak_contended = mfu_lib.peak_info(jax.local_devices()[0], cfg.mfu.peak_flops)
    self.metrics = MetricsLogger(self.out_dir, self.events, total_steps=cfg.steps,
                                 tokens_per_step=program.plan.batch.tokens, flops_per_token=program.flops_per_token,
                                 peak_flops=peak_flops, prometheus_port=cfg.monitor.prometheus_port,
                                 prometheus_host=cfg.monitor.prometheus_host,
                                 peak_contended=peak_contended)
    stack.callback(self.metrics.close)
    tracking.attach(cfg, self.out_dir, self.metrics, stack, lambda: self.exit_code)  # MLflow, OTel: off by default
    self.observers = Observers()
    drills.install(self.observers, cfg.faults, self.out_dir, jax.process_index(), settle=lambda: self.checkpoints.settle())
    self.checkpoints = Checkpoints(cfg, self.out_dir, self.events, self.metrics, self.observers.save_started,
                                   on_progress=self.watchdog.progress, on_saved=self.observers.saved,
                                   mesh_shape=dict(program.mesh.shape), state_spec=program.state)
    stack.callback(self.checkpoints.close)  # waits for the last save (and its upload)
    self.resume_path = self.checkpoints.resolve_resume()
    if jax.process_index() == 0:
      config_lib.save(cfg, self.out_dir / "config.json")
    if self.resume_path is not None:  # before reading data: a checkpoint of another mode is named as such
      check_checkpoint_mode(cfg, program.plan.mode, self.checkpoints.read_meta(self.resume_path), self.resume_path)
    self.stepper = make_stepper(cfg, program, self.stage_programs, observers=self.observers, metrics=self.metrics,
                                out_dir=self.out_dir, compile_fn=self._compile, starting_state=self._starting_state)
    self.data = self.stepper.data
    stack.callback(self.data.close)
    if self.resume_path is not None:  # before compiling: the checkpoint's tokenizer is this run's
      self.data.check_checkpoint(self.checkpoints.read_meta(self.resume_path), self.resume_path)
    log.info("devices: %d x %s; mesh %s; %s; %s", jax.device_count(), jax.devices()[0].device_kind,
             program.plan.mesh.describe(), self.data.describe(), self.stepper.describe())
    log.info("MFU peak: %s; model FLOPs/token %.3g", peak_source, program.flops_per_token)
    self.task_eval = TaskEval(cfg, program, self.events, self.metrics)  # eval.tasks: lm-eval in the loop
    self.rollbacks = Rollbacks(cfg.guards, self.events, self.checkpoints, self.resume_path, unit=self.stepper.unit,
                               signal=self.stepper.spike_signal)
    self.routing = RoutingMonitor(self.events, cfg.model.moe.collapse_entropy, cfg.model.moe.collapse_steps)
    self.profiler = Profiler(self.out_dir / "tensorboard", cfg.profile.start_step, cfg.profile.num_steps)
    stack.callback(self.profiler.stop)
    self.stop = StopRequest(self.kv).install()
    stack.callback(self.stop.uninstall)
    self.stragglers = StragglerMonitor(self.kv, self.events, program.plan.fleet)
    if self.kv is not None:  # other processes' stop requests and hangs arrive as notices
      stack.callback(self.kv.stop_listening, self.kv.listen({"stop": self.stop.on_notice,
                                                              "hang": self.watchdog.on_notice}))

  def train(self) -> dict:
    """Runs the loop; returns the summary. Raises Preempted after saving when asked to stop."""
    with self._resources:
      try:
        eval_loss = self._loop(self._initial_state())
        self.exit_code = 0
      except BaseException as e:
        # A collective that fails because a watchdog is ending the job is part of that hang, not a crash.
        self.exit_code = self.watchdog.exit_code_for(e)
        if self.exit_code == EXIT_CRASH:
          self.events.emit(ev.CRASH, self.step, code=EXIT_CRASH, reason=config_lib.redact_text(f"{type(e).__name__}: {e}")[:1000])
        raise
    return self._summary(eval_loss)

  def _loop(self, state: state_lib.TrainState) -> float:
    cfg, eval_loss, stepper = self.cfg, float("nan"), self.stepper
    step = self.step = int(state.step) // stepper.updates_per_step
    if step >= cfg.steps:
      log.info("the checkpoint is already at %s %d of %d: nothing to train (use a new output_dir, or raise steps "
               "to continue)", stepper.unit, step, cfg.steps)
      return self._evaluate(state, step)
    if step == 0:
      self.metrics.text("config", "```\n" + json.dumps(config_lib.redacted(cfg), indent=2, sort_keys=True) + "\n```")
      if stepper.evaluates_at_start:  # post-training: the starting model's eval (loss, held-out accuracy) is the baseline
        self._evaluate(state, 0)
    with jax.set_mesh(self.program.mesh):
      data_state = self.data.get_state()  # the data position matching `state`
      stepper.start(state, step)
      while step < cfg.steps:
        if self.metrics.summary is not None:  # not the attempt's first step: its dispatch waits for compilation
          self.stragglers.dispatching(step + 1)
        self.profiler.maybe_start(step + 1)
        with self.profiler.step_annotation(step + 1):
          state, outcome = stepper.run(state, step + 1)
        self.profiler.maybe_stop(step + 1, outcome.metrics)
        step = self.step = step + 1
        self.observers.step_ran(step)  # before a rollback (the last step's flags are read at once)
        data_state = self.data.get_state()
        self._check_epochs(step)
        last = step == cfg.steps
        stepper.after_run(step, last)
        rollback = stepper.guard(self.rollbacks, step, outcome, last)
        if rollback is not None:
          state, step = self._rollback(rollback)
          stepper.after_rollback(step, last)
          self.watchdog.beat(step)
          self.stragglers.reset()
          data_state = self.data.get_state()
          continue
        if self.metrics.summary is None:
          self.metrics.first_step(step, outcome.metrics, self.t_start)
        if step % cfg.log_every == 0 or last:
          self.routing.check(step, self.metrics.train(step, outcome.metrics, fleet=self.stragglers.exchange(step)))
          self.metrics.scalars(step, {**self.data.scalars(data_state), **(outcome.scalars or {})})
          stepper.log_line(step, outcome)
        eval_loss = self._after_step(state, step, data_state, eval_loss)
    self.checkpoints.check_final(step)
    return eval_loss

  def _after_step(self, state: state_lib.TrainState, step: int, data_state: dict, eval_loss: float) -> float:
    """The end of every step, in every loop (pretraining, GRPO): eval when due, then the watchdog's beat,
    observers (the drills), the stop request and the checkpoint schedule. Returns the latest eval loss."""
    cfg = self.cfg
    if step == cfg.steps or (cfg.eval.every_steps and step % cfg.eval.every_steps == 0):
      eval_loss = self._evaluate(state, step)
    # After the step and its events: a hang's idle window (goodput's `hang`) starts after them.
    self.watchdog.beat(step)
    self.observers.step_done(step)
    if self.stop.requested(step):
      self._preempt(state, step, data_state)
    self.checkpoints.after_step(step, state, data_state, dict(self.program.mesh.shape), self._run_identity(),
                                final=step == cfg.steps)
    return eval_loss

  def _run_identity(self) -> RunIdentity:
    """What every checkpoint's meta says about this run, as it stands now: its stores' tokenizer, its rollbacks."""
    return RunIdentity(tokenizer_identity=self.data.tokenizer_identity, rollbacks=self.rollbacks.used)

  def _starting_state(self) -> state_lib.TrainState:
    """The run's step-0 state: checkpoint.init_from's parameters with a new optimizer state, else the
    seed's initialisation (a fresh run, and a rollback with no checkpoint from before the fault)."""
    if self.cfg.checkpoint.init_from:
      return init_from.initial_state(self.program, self.cfg.checkpoint.init_from, self.cfg.guards.spike_window)
    return state_lib.initialize(self.program.state, self.program.mesh)

  def _initial_state(self) -> state_lib.TrainState:
    spec = self.program.state
    if self.resume_path is None:
      state = self._starting_state()
    else:
      restored = self.checkpoints.restore(self.resume_path, spec)
      state = restored.state
      self.data.set_state(restored.data_state)
      self.checkpoints.promote(restored, self._run_identity())  # a local step, once every check passed
      if self.data.data_change:  # post.resume_new_data let other data through: on the record
        self.events.emit(ev.DATA_CHANGE, int(state.step) // self.stepper.updates_per_step, change=self.data.data_change)
    log.info("model: %.2fM parameters; optimizer %s: %s", registry.param_count(state.params) / 1e6, self.cfg.optimizer.name,
             optim.describe_groups(state.params, self.program.optimizer.labels(state.params)))
    return state

  def _compile(self, train_step: object, state: state_lib.TrainState, batch: dict, count: int):
    """A stepper's jitted step compiled for (state, batch), with its events; with several processes they
    all wait for each other's compile before its first run (CPU (gloo) collectives give a late peer 30 s)."""
    self.events.emit(ev.COMPILE_START, int(state.step))
    t0 = time.monotonic()
    compiled = train_step.lower(state, batch).compile()
    self.events.emit(ev.COMPILE_END, int(state.step), seconds=time.monotonic() - t0)
    log.info("compiled train step in %.1fs", time.monotonic() - t0)
    if self.kv is not None:  # the first step starts together: CPU (gloo) collectives give a late peer only 30 s
      self.kv.barrier(f"compiled/{count}", self.cfg.runtime.init_timeout_s)
    return compiled

  def _rollback(self, rollback: Rollback) -> tuple[state_lib.TrainState, int]:
    per_step = self.stepper.updates_per_step
    state = self.rollbacks.perform(rollback, self.program.state, self._starting_state, per_step=per_step)
    step = self.step = int(state.step) // per_step
    self.metrics.restart_interval(step)
    return state, step

  def _eval_step_for(self, params: nnx.State, batch: dict):
    """The compiled eval step for `batch`'s shape; with several processes, they all wait for each other's
    compile before its first run, as for the train step (gloo gives a late peer 30 s)."""
    shape = batch["inputs"].shape
    if shape not in self._eval_steps:
      t0 = time.monotonic()
      self._eval_steps[shape] = self.program.eval_step.lower(params, batch).compile()
      log.info("compiled eval step in %.1fs", time.monotonic() - t0)
      if self.kv is not None:
        self.kv.barrier(f"compiled-eval/{len(self._eval_steps)}", self.cfg.runtime.init_timeout_s)
    return self._eval_steps[shape]

  def _evaluate(self, state: state_lib.TrainState, step: int) -> float:
    with jax.set_mesh(self.program.mesh), self.metrics.eval(step) as result:
      total, count, per_source = 0.0, 0.0, {}
      for name, batches in self.data.eval_sets.items():
        source_total, source_count = 0.0, 0.0
        for batch in batches:
          loss_sum, n = self._eval_step_for(state.params, batch)(state.params, batch)
          source_total, source_count = source_total + loss_sum, source_count + n
        total, count = total + source_total, count + source_count
        loss = float(source_total) / max(float(source_count), 1.0)
        per_source[f"eval/{name}/loss"] = loss
        bytes_per_token = self.data.bytes_per_token(name)
        if bytes_per_token:  # comparable across tokenizers: nats per token -> bits per input byte
          per_source[f"eval/{name}/bits_per_byte"] = loss / math.log(2) / bytes_per_token
      result["loss"] = float(total) / max(float(count), 1.0)
      per_source.update(self.data.extra_eval(self.program, state.params))  # post-training's held-out accuracy
    self.metrics.scalars(step, per_source)
    with self.metrics.outside(step):  # not step time (goodput)
      self.task_eval.run(state.params, step)
    return result["loss"]

  def _check_epochs(self, step: int) -> None:
    """A source read past data.max_epochs: a warning event, or exit 3 when the config says stop."""
    for name, epochs in self.data.newly_past_max_epochs().items():
      self.events.emit(ev.DATA_REPEAT, step, source=name, epochs=epochs, max_epochs=self.cfg.data.max_epochs)
      log.warning("data: source %s is past data.max_epochs=%g (%.3f epochs) at step %d", name,
                  self.cfg.data.max_epochs, epochs, step)
      if self.cfg.data.stop_at_max_epochs:
        raise Aborted(f"source {name} was read past data.max_epochs={self.cfg.data.max_epochs} ({epochs:.3f} "
                      f"epochs) at step {step} and data.stop_at_max_epochs is set: add data or raise max_epochs")

  def _preempt(self, state: state_lib.TrainState, step: int, data_state: dict) -> None:
    self.events.emit(ev.PREEMPTION, step, signal=self.stop.reason)
    self.watchdog.beat(step)  # a synchronous save is progress, not a hang
    self.checkpoints.save_preemption(step, state, data_state, dict(self.program.mesh.shape), self._run_identity(),
                                     since_signal_s=self.stop.seconds_since())
    raise Preempted(f"stopped by {self.stop.reason} after step {step}; checkpoint saved in "
                    f"{self.checkpoints.location}")

  def _summary(self, eval_loss: float) -> dict:
    entropy = self.data.unigram_entropy()
    summary = {"final_eval_loss": eval_loss, "unigram_entropy": entropy, "steps": self.step,
               "wall_s": time.monotonic() - self.t_start}
    log.info("final eval loss %.4f nats/token vs unigram entropy %.4f nats/token of the training corpus "
             "(a model that learned nothing beyond token frequencies scores about the latter)", eval_loss, entropy)
    if jax.process_index() == 0:
      strict = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in summary.items()}
      (self.out_dir / "summary.json").write_text(json.dumps(strict, indent=2, allow_nan=False) + "\n")  # NaN -> null
    return summary


def check_checkpoint_mode(cfg: schema.Config, mode: str, meta: dict, path: object) -> None:
  """A checkpoint resumes only in the mode that wrote it (its data state and step unit are that mode's):
  UserError naming both, before any data is read or anything compiles."""
  # a checkpoint from before post-training existed: migrated to post.mode's default, pretraining
  saved = plan_lib.canonical_mode(config_lib.saved_config(meta, f"checkpoint {path}")["post"]["mode"])
  if saved != mode:
    raise UserError(f"checkpoint {path} was written by a {plan_lib.describe_mode(saved)} run, but this run is "
                    f"{plan_lib.describe_mode(mode)} (config.post.mode={cfg.post.mode!r}): resume it with "
                    f"post.mode={saved!r}, or start from its weights in a new output_dir with "
                    f"checkpoint.init_from={path}")


def prepare_output_dir(out_dir: Path) -> None:
  """Creates `output_dir` and proves it writable, before any compute: UserError (exit 2) naming it."""
  require_writable_dir(out_dir, f"config.output_dir={out_dir}")


def _initialize(cfg: schema.Config) -> bool:
  """jax.distributed (runtime/distributed.py); True on a process of an RL job's rollout side (whole processes
  of their own: posttrain/remote_rollout.py), which runs no Loop."""
  distributed.initialize_distributed(cfg.runtime, cfg.post.sync_timeout_s if cfg.post.rollout_devices else 0.0)
  return bool(cfg.post.rollout_devices) and remote_rollout.join_trainer_group(cfg)


def run(cfg: schema.Config, t_process_start: float | None = None) -> dict:
  """Trains per `cfg` (or, on a rollout process, serves the trainer's rollouts). Raises UserError on bad
  input (before compiling), Preempted after saving."""
  cfg = schema.Config.of(cfg)
  if _initialize(cfg):
    return remote_rollout.serve(cfg)
  code = EXIT_CRASH
  try:
    summary = Trainer(cfg, t_process_start).train()
    code = 0
    return summary
  except BaseException as e:
    code = exit_code(e)
    raise
  finally:  # the rollout processes end with the trainer's code (the launcher restarts the job as one)
    remote_rollout.stop(cfg, code)
