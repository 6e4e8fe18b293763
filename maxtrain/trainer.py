"""The training loop: validated config -> data -> mesh -> state (fresh or restored) -> compiled
step -> loop with periodic checkpoints, eval, metrics and events.

`Trainer.__init__` does everything that can fail on bad input, before compiling; `Trainer.train`
runs the loop. Every attempt appends to `<output_dir>/events.jsonl` (see monitor/events.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

import jax
import ml_collections
import numpy as np

from maxtrain import config as config_lib
from maxtrain import optim
from maxtrain import runtime
from maxtrain import state as state_lib
from maxtrain import step as step_lib
from maxtrain.checkpoint import Checkpointer, SaveTiming
from maxtrain.data import corpus, pipeline
from maxtrain.data.store import TokenStore
from maxtrain.errors import Aborted, Preempted, UserError, exit_code
from maxtrain.faults import Faults
from maxtrain.models.llama import ModelConfig, param_count
from maxtrain.monitor import events as ev
from maxtrain.monitor import memory, mfu as mfu_lib, prometheus
from maxtrain.monitor.profiler import Profiler
from maxtrain.monitor.tensorboard import MetricWriter
from maxtrain.monitor.watchdog import Watchdog
from maxtrain.preemption import StopRequest
from maxtrain.sharding.mesh import make_mesh

log = logging.getLogger("maxtrain")


def open_stores(data_cfg: ml_collections.ConfigDict, vocab_size: int) -> tuple[TokenStore, TokenStore]:
  """Opens (building the embedded corpus on first use) and checks the train and val stores."""
  if data_cfg.path:
    train_prefix, val_prefix = f"{data_cfg.path}.train", f"{data_cfg.path}.val"
  else:
    train_prefix, val_prefix = corpus.prepare_corpus(data_cfg.corpus, tokenizer_spec=data_cfg.tokenizer)
  train, val = TokenStore.open(train_prefix), TokenStore.open(val_prefix)
  for store in (train, val):
    if store.vocab_size > vocab_size:
      raise UserError(
          f"token store {store.prefix} was built with a tokenizer of {store.vocab_size} ids "
          f"({store.tokenizer_identity}), more than config.model.vocab_size={vocab_size}. "
          f"Set --config.model.vocab_size to at least {store.vocab_size} (rounded up so mesh.tensor divides it)."
      )
  if train.tokenizer_identity != val.tokenizer_identity:
    raise UserError(f"{train.prefix} and {val.prefix} were built with different tokenizers "
                    f"({train.tokenizer_identity} vs {val.tokenizer_identity}); rebuild both with tools/index_data.py")
  return train, val


class Trainer:
  def __init__(self, cfg: ml_collections.ConfigDict, t_process_start: float | None = None):
    self.cfg = cfg
    self.t_start = time.monotonic() if t_process_start is None else t_process_start
    runtime.initialize_distributed(cfg.runtime)
    layout = config_lib.validate(cfg, jax.device_count(), jax.process_count())
    self.train_store, self.val_store = open_stores(cfg.data, cfg.model.vocab_size)
    runtime.configure_compile_cache(cfg.runtime.compile_cache_dir)
    self.mesh = make_mesh(layout)
    self.out_dir = Path(cfg.output_dir)
    self.out_dir.mkdir(parents=True, exist_ok=True)
    self.ckpt = Checkpointer(cfg.checkpoint, cfg.checkpoint.dir or str(self.out_dir / "checkpoints"),
                             self.out_dir / "checkpoints")
    resume_path = self.ckpt.resolve_resume()
    self.events = ev.EventLog(self.out_dir / ev.FILENAME, jax.process_index())
    self.events.emit(ev.JOB_START, hosts=jax.process_count(), devices=jax.device_count(),
                     device_kind=jax.devices()[0].device_kind, config_hash=ev.config_hash(cfg.to_dict()))
    if jax.process_index() == 0:
      config_lib.save(cfg, self.out_dir / "config.json")
    log.info("devices: %d x %s; mesh %s; train %s (%d tokens), val %s (%d tokens)",
             jax.device_count(), jax.devices()[0].device_kind, layout.describe(), self.train_store.prefix,
             self.train_store.num_tokens, self.val_store.prefix, self.val_store.num_tokens)
    self.resume_path = resume_path
    try:
      self._prepare()
    except UserError as e:  # the attempt's record ends here: a bad-input exit, not a crash
      self.events.emit(ev.EXIT, code=exit_code(e), error=str(e))
      self.events.close()
      raise

  def _prepare(self) -> None:
    """Model, optimizer, state layout, data loaders: what is left to check before compiling."""
    cfg = self.cfg
    self.model_cfg = ModelConfig.from_config(cfg.model)
    self.optimizer = optim.make(cfg.optimizer, cfg.optimizer.decay_steps or cfg.steps)
    self.spec = state_lib.spec(self.model_cfg, self.optimizer.tx, self.mesh, cfg.seed,
                               guard_window=cfg.guards.spike_window)
    self.seq_len, self.batch_size = cfg.data.seq_len, cfg.data.batch_size
    self.loader = pipeline.TrainLoader(self.train_store.prefix, self.seq_len, self.batch_size, cfg.seed,
                                       jax.process_index(), jax.process_count())
    self.train_batch_sharding = step_lib.batch_shardings(self.mesh)
    self.batch_sharding = self.train_batch_sharding["inputs"]
    self.eval_data = [pipeline.to_global(b, self.batch_sharding) for b in pipeline.eval_batches(
        self.val_store.prefix, self.seq_len, self.batch_size, cfg.eval.batches, jax.process_index(),
        jax.process_count())]
    self.flops_per_token = self.model_cfg.train_flops_per_token(self.seq_len)
    self.peak_flops, source = mfu_lib.peak_flops(jax.local_devices()[0], cfg.mfu.peak_flops)
    log.info("MFU peak: %s; model FLOPs/token %.3g", source, self.flops_per_token)

  def _load_state(self) -> None:
    if self.resume_path is None:
      self.state = state_lib.initialize(self.spec, self.mesh)
    else:
      t0 = time.monotonic()
      restored = self.ckpt.restore(self.resume_path, self.spec.abstract, self.spec.shardings)
      self.state = restored.state
      self.loader.set_state(restored.data_state)  # O(1): the loader indexes windows, nothing is replayed
      self.events.emit(ev.RESTORE, restored.step, seconds=time.monotonic() - t0, path=str(self.resume_path))
      log.info("restored step %d from %s in %.2fs (saved on mesh %s)", restored.step, self.resume_path,
               time.monotonic() - t0, restored.meta.get("mesh"))
    log.info("model: %.2fM parameters; optimizer %s: %s", param_count(self.state.params) / 1e6,
             self.cfg.optimizer.name, optim.describe_groups(self.state.params, self.optimizer.labels(self.state.params)))

  def _eval_step(self):
    return jax.jit(step_lib.make_eval_step(self.spec.graphdef), in_shardings=(self.spec.shardings.params,
                   self.batch_sharding), out_shardings=state_lib.replicated(self.mesh))

  def _compile(self, batch):
    train_step = step_lib.jit_train_step(self.cfg, self.spec, self.optimizer, self.mesh)
    self.eval_step = self._eval_step()
    self.events.emit(ev.COMPILE_START, int(self.state.step))
    t0 = time.monotonic()
    compiled = train_step.lower(self.state, batch).compile()
    self.events.emit(ev.COMPILE_END, int(self.state.step), seconds=time.monotonic() - t0)
    log.info("compiled train step in %.1fs", time.monotonic() - t0)
    return compiled

  def _next_batch(self, step: int) -> dict:
    """The batch of the step that will complete as `step`."""
    t0 = time.monotonic()
    batch = pipeline.to_global(next(self.loader), self.batch_sharding)
    if self.summary is not None:
      self.summary.add_data_wait(time.monotonic() - t0)
    fault = np.asarray(self.faults.in_graph(step), np.float32)
    batch["fault"] = jax.device_put(fault, self.train_batch_sharding["fault"])
    return batch

  def _check_guards(self, step: int, metrics: dict) -> int | None:
    """Host side of the guards, for a step already finished. Returns the step to roll back to."""
    flags = jax.device_get({k: metrics[k] for k in ("nonfinite", "spike", "loss_zscore", "consecutive_bad", "loss")})
    g = self.cfg.guards
    if flags["nonfinite"]:
      self.events.emit(ev.NAN_SKIP, step, count=1, consecutive=int(flags["consecutive_bad"]))
      log.warning("step %d: non-finite loss or gradients; update skipped (%d in a row)", step,
                  flags["consecutive_bad"])
      if flags["consecutive_bad"] >= g.max_consecutive_bad:
        return self._rollback(step, first_bad=step - int(flags["consecutive_bad"]) + 1,
                              reason=f"{flags['consecutive_bad']} non-finite steps in a row")
    if flags["spike"]:
      self.events.emit(ev.SPIKE, step, loss=float(flags["loss"]), zscore=float(flags["loss_zscore"]),
                       action=g.spike_action)
      log.warning("step %d: loss spike %.4f (z-score %.1f > %.1f); update skipped; action %s", step, flags["loss"],
                  flags["loss_zscore"], g.spike_zscore, g.spike_action)
      if g.spike_action == "abort":
        raise Aborted(f"loss spike at step {step}: loss {flags['loss']:.4f}, z-score {flags['loss_zscore']:.1f} > "
                      f"guards.spike_zscore={g.spike_zscore} (guards.spike_action=abort)")
      if g.spike_action == "rollback":
        return self._rollback(step, first_bad=step, reason=f"loss spike (z-score {flags['loss_zscore']:.1f})")
    return None

  def _rollback(self, step: int, first_bad: int, reason: str) -> int:
    """Restores the newest checkpoint before `first_bad`; the data loader keeps going forward, so the
    batches that led to the fault are not replayed."""
    if self.rollbacks >= self.cfg.guards.max_rollbacks:
      raise Aborted(f"{reason} at step {step}, and guards.max_rollbacks={self.cfg.guards.max_rollbacks} rollbacks "
                    "were already used in this run")
    self.rollbacks += 1
    t0 = time.monotonic()
    self._log_saves(self.ckpt.wait())
    good = [s for s in self.ckpt.steps() if s < first_bad]
    if good:
      self.state = self.ckpt.restore(self.ckpt.local_path(good[-1]), self.spec.abstract, self.spec.shardings).state
    else:
      self.state = state_lib.initialize(self.spec, self.mesh)
    to_step = int(self.state.step)
    self.events.emit(ev.ROLLBACK, to_step, from_step=step, to_step=to_step, seconds=time.monotonic() - t0,
                     reason=reason)
    log.warning("rollback %d/%d: %s at step %d; restored step %d; the data skips ahead past the fault",
                self.rollbacks, self.cfg.guards.max_rollbacks, reason, step, to_step)
    return to_step

  def _evaluate(self, step: int) -> float:
    with self.summary.outside(step) if self.summary is not None else contextlib.nullcontext():
      t0 = time.monotonic()
      total, count = 0.0, 0.0
      for batch in self.eval_data:
        loss_sum, n = self.eval_step(self.state.params, batch)
        total, count = total + loss_sum, count + n
      loss = float(total) / max(float(count), 1.0)
      self.events.emit(ev.EVAL, step, seconds=time.monotonic() - t0, loss=loss)
    self.writer.scalars(step, {"eval/loss": loss})
    log.info("step %d  eval loss %.4f", step, loss)
    return loss

  def _log_saves(self, timings: list[SaveTiming]) -> None:
    for timing in timings:
      self.events.emit(ev.CHECKPOINT_SAVE_END, timing.step, blocking_s=timing.blocking_s, save_s=timing.save_s)
      self.writer.scalars(timing.step, {"checkpoint/blocking_s": timing.blocking_s,
                                        "checkpoint/save_s": timing.save_s})
      log.info("checkpoint step %d saved: loop blocked %.3fs, complete on disk after %.3fs",
               timing.step, timing.blocking_s, timing.save_s)

  def _save(self, step: int, data_state: dict, sync: bool) -> None:
    with self.summary.outside(step):
      self.events.emit(ev.CHECKPOINT_SAVE_START, step)
      t0 = time.monotonic()
      timing = self.ckpt.save(step, self.state, data_state, self.cfg, dict(self.mesh.shape))
      if timing is not None:
        self.faults.after_save_started(step)
        done = self.ckpt.wait() if sync else self.ckpt.poll()
        if sync:
          timing.blocking_s = time.monotonic() - t0  # the loop waited for all of it
        self.events.emit(ev.CHECKPOINT_BLOCKED, step, blocking_s=time.monotonic() - t0)
        self._log_saves(done)

  def _log_metrics(self, step: int, metrics: dict) -> None:
    metrics = jax.device_get(metrics)  # note: a host-device sync point, once per log interval
    # Every scalar the step returns is logged as train/<name>: new metrics need no loop change.
    scalars = {f"train/{k}": v for k, v in metrics.items()}
    pending = self.summary.pending(step)
    speed = ""
    if pending is not None:  # None at the attempt's first step, whose time is mostly compilation
      seconds, count, data_wait_s = pending
      step_time = seconds / count
      tokens_per_s = self.batch_size * self.seq_len / step_time
      scalars.update({"train/step_time_s": step_time, "train/tokens_per_s": tokens_per_s,
                      "train/data_wait_s": data_wait_s / count})
      speed = f"  {step_time:.3f}s/step  {tokens_per_s:.0f} tok/s"
      mfu = mfu_lib.mfu(tokens_per_s, self.flops_per_token, jax.device_count(), self.peak_flops)
      if mfu is not None:
        scalars["train/mfu"] = mfu
        speed += f"  MFU {mfu:.1%}"
    scalars.update(memory.memory_scalars())
    self.writer.scalars(step, scalars)
    if self.prometheus is not None:
      self.prometheus.update(scalars)
    log.info("step %d/%d  loss %.4f  grad_norm %.3f  lr %.2e%s", step, self.cfg.steps, metrics["loss"],
             metrics["grad_norm"], metrics["lr"], speed)
    # Flushed after the logging above, so that its time is inside the steps interval (the loop's
    # own cost) rather than a gap the goodput report could only call `other`.
    self.summary.flush(step)

  def train(self) -> dict:
    """Runs the loop; returns a summary. Raises Preempted after saving when asked to stop."""
    cfg, step = self.cfg, 0
    self.summary = None
    self.writer = MetricWriter(self.out_dir / "tensorboard")
    self.prometheus = prometheus.start(cfg.monitor.prometheus_port, self.out_dir.name, jax.process_index())
    self.faults = Faults(cfg.faults, self.out_dir)
    self.rollbacks = sum(r["kind"] == ev.ROLLBACK for r in ev.read_events(self.out_dir / ev.FILENAME)
                         if r["process"] == jax.process_index())
    profiler = Profiler(self.out_dir / "tensorboard", cfg.profile.start_step, cfg.profile.num_steps)
    stop = StopRequest().install()
    watchdog = Watchdog(self.out_dir, self.events, cfg.watchdog.timeout_s, cfg.watchdog.startup_timeout_s).start()
    code, eval_loss = 1, float("nan")
    try:
      self._load_state()
      step = int(self.state.step)
      if step >= cfg.steps:
        log.info("the checkpoint is already at step %d of %d: nothing to train (use a new output_dir, or "
                 "raise steps to continue)", step, cfg.steps)
        self.eval_step = self._eval_step()
        with jax.set_mesh(self.mesh):
          eval_loss = self._evaluate(step)
      if step == 0:
        self.writer.text("config", "```\n" + json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n```")
      with jax.set_mesh(self.mesh):
        data_state = self.loader.get_state()  # the loader position matching `state`
        if step < cfg.steps:
          batch = self._next_batch(step + 1)
          compiled = self._compile(batch)
        unchecked = None  # (step, metrics) whose guard flags the host reads one step late
        while step < cfg.steps:
          profiler.maybe_start(step + 1)
          with profiler.step_annotation(step + 1):
            self.state, metrics = compiled(self.state, batch)
          profiler.maybe_stop(step + 1, metrics)
          step += 1
          watchdog.beat(step)
          data_state = self.loader.get_state()
          if step < cfg.steps:
            # Host work for the next batch overlaps the device running this step (async dispatch).
            batch = self._next_batch(step + 1)
          # The previous step is done (or nearly): reading its flags does not stall the device. The
          # last step has nothing to overlap with and is checked at once.
          to_check = [unchecked] if unchecked else []
          unchecked = (step, metrics)
          if step == cfg.steps:
            to_check, unchecked = to_check + [unchecked], None
          rolled_back_to = None
          for checked_step, checked_metrics in to_check:
            rolled_back_to = self._check_guards(checked_step, checked_metrics)
            if rolled_back_to is not None:
              break
          if rolled_back_to is not None:
            step, unchecked = rolled_back_to, None
            data_state = self.loader.get_state()
            if self.summary is not None:
              self.summary.reset(step)
            continue
          if self.summary is None:
            jax.block_until_ready(metrics)
            self.events.emit(ev.FIRST_STEP, step)
            self.summary = ev.StepsSummary(self.events, step)
            log.info("first step (%d) done %.1fs after process start", step, time.monotonic() - self.t_start)
          if step % cfg.log_every == 0 or step == cfg.steps:
            self._log_metrics(step, metrics)
          if step == cfg.steps or (cfg.eval.every_steps and step % cfg.eval.every_steps == 0):
            eval_loss = self._evaluate(step)
          self.faults.after_step(step)
          if stop.requested():
            self.events.emit(ev.PREEMPTION, step, signal=stop.signal_name)
            watchdog.beat(step)  # a synchronous save is progress, not a hang
            self._save(step, data_state, sync=True)
            raise Preempted(f"stopped by {stop.signal_name} after step {step}; checkpoint saved in "
                            f"{self.ckpt.location}")
          if self.ckpt.should_save(step) or step == cfg.steps:
            self._save(step, data_state, sync=step == cfg.steps)
          else:
            self._log_saves(self.ckpt.poll())
        if self.ckpt.failed_step == step:
          # Exiting 0 would lose this run's work silently; a crash exit lets a supervisor restart
          # from the newest complete checkpoint.
          raise RuntimeError(f"the final checkpoint (step {step}) could not be written to {self.ckpt.location}: "
                             f"{self.ckpt.last_error}")
      code = 0
    except BaseException as e:
      code = exit_code(e)
      if code == 1:
        self.events.emit(ev.CRASH, step, code=1, reason=f"{type(e).__name__}: {e}"[:1000])
      raise
    finally:
      watchdog.stop()
      stop.uninstall()
      profiler.stop()
      self.ckpt.close()
      self.writer.close()
      if self.prometheus is not None:
        self.prometheus.close()
      self.events.emit(ev.EXIT, step, code=code)
      self.events.close()

    entropy = self.train_store.unigram_entropy()
    summary = {"final_eval_loss": eval_loss, "unigram_entropy": entropy, "steps": step,
               "wall_s": time.monotonic() - self.t_start}
    log.info("final eval loss %.4f nats/token vs unigram entropy %.4f nats/token of the training corpus "
             "(a model that learned nothing beyond token frequencies scores about the latter)", eval_loss, entropy)
    if jax.process_index() == 0:
      (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def run(cfg: ml_collections.ConfigDict, t_process_start: float | None = None) -> dict:
  """Trains per `cfg`. Raises UserError on bad input (before compiling), Preempted after saving."""
  return Trainer(cfg, t_process_start).train()
