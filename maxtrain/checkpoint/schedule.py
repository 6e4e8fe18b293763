"""The run's checkpoint component: where (the durable tier `checkpoint.dir`, default
`<output_dir>/checkpoints`, and the optional node-local tier `checkpoint.local_dir`), when (checkpoint/cadence.py:
every N steps or minutes, or from the measured cost and failure rate; always at the end and on preemption, the tiers
per policy.preemption_plan), which tier a run resumes from (checkpoint/resume.py), restoring onto the run's state
spec, and the record of every save and restore, phase by phase (record.py). The tiers themselves are `storage.py`
(Orbax, S3, verification) and `local.py` (the local tier), both a tiers.Tier. What a save writes about the run comes
with each call (identity.RunIdentity), never set on this object afterwards."""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any, Callable

import jax

from maxtrain import config as config_lib
from maxtrain.checkpoint import policy, timeline
from maxtrain.checkpoint.agreement import Agreement
from maxtrain.checkpoint.cadence import Cadence
from maxtrain.checkpoint.durable_read import param_shapes
from maxtrain.checkpoint.identity import RunIdentity, local_identity, run_meta
from maxtrain.checkpoint.local import LocalTier
from maxtrain.checkpoint.record import SaveRecord
from maxtrain.checkpoint.resume import Resolved, Resume
from maxtrain.checkpoint.storage import Checkpointer
from maxtrain.checkpoint.tiers import Restored
from maxtrain.config import schema
from maxtrain.config.sections import checkpoint_tiers as validate_tiers  # beside the keys
from maxtrain.errors import UserError
from maxtrain.models import quant, registry
from maxtrain.monitor import events as ev
from maxtrain.runtime.kv import KeyValue

log = logging.getLogger("maxtrain")


def check_model(cfg: schema.Config, path: Path, meta: dict, state_spec: Any, events: Any) -> None:
  """DESIGN rule 1 for the model: a step saved under other model math (same parameter tree, another function:
  a sliding window, a RoPE base, another family) is exit 2 naming the keys before anything is restored,
  unless checkpoint.resume_new_model (then on the record). Another parameter tree is left to the restore,
  which names the parameters. The local tier also refuses such a step by its config hash; this catches the
  durable tier and an explicit resume path."""
  if meta.get("param_shapes", {}) != param_shapes(state_spec.abstract):
    return
  changes = registry.math_changes(config_lib.saved_config(meta, f"checkpoint {path}")["model"],
                                  config_lib.redacted(cfg)["model"])
  if not changes:
    return
  if not cfg.checkpoint.resume_new_model:
    raise UserError(f"checkpoint {path} was saved under another model ({'; '.join(changes)}): its parameters "
                    "would compute another function. Resume with the saved values, start a new run from its "
                    "parameters (checkpoint.init_from), or set --config.checkpoint.resume_new_model=True to go on "
                    "deliberately.")
  log.warning("resuming %s under changed model keys (checkpoint.resume_new_model): %s", path, "; ".join(changes))
  events.emit(ev.MODEL_CHANGE, None, path=str(path), changes=changes)


class Checkpoints:
  """The run's checkpoint component: where (`checkpoint.dir`, default `<output_dir>/checkpoints`), when
  (every `checkpoint.every_steps`, at the end, on preemption), restoring onto the run's state spec,
  and the record of every save (events, TensorBoard, the log)."""

  def __init__(self, cfg: schema.Config, output_dir: Path, events: Any, metrics: Any,
               on_save_started: Any = None, on_progress: Callable[[], None] | None = None,
               on_saved: Callable[[int, Path], None] | None = None, mesh_shape: dict | None = None,
               state_spec: Any = None):
    """`state_spec`: the run's state (abstract and shardings); a durable step without a manifest is checked by
    restoring onto it (storage.Checkpointer.verify)."""
    default_dir = output_dir / "checkpoints"
    self.cfg, self.mesh_shape = cfg, mesh_shape or {}
    validate_tiers(cfg.checkpoint, str(default_dir))  # checkpoint.dir="" resolves only now
    target = None if state_spec is None else (state_spec.abstract, state_spec.shardings)
    self.store = Checkpointer(cfg.checkpoint, cfg.checkpoint.dir or str(default_dir), default_dir, on_progress,
                              lock=jax.process_index() == 0, target=target)
    ck, kv = cfg.checkpoint, KeyValue.current()
    self.local = None
    if ck.local_dir:
      try:
        self.local = LocalTier(ck.local_dir, jax.process_index(), ck.local_max_to_keep,
                               local_identity(cfg, output_dir, self.store.location))
      except BaseException:
        self.store.release_locks()  # exit 2 (in use, unwritable): the durable tier's lock goes with it
        raise
    self.agreement = Agreement(kv, jax.process_index(), jax.process_count())
    self.cadence = Cadence(ck, events, kv, jax.process_index(), output_dir / ev.FILENAME)
    self.resume = Resume(ck, self.store, self.local, self.agreement, events, self.mesh_shape, jax.process_count())
    self.resumed = Resolved(None, None)
    # A restore to a step abandons the newer ones of both tiers (timeline.py).
    self._abandon_after = functools.partial(timeline.abandon_after, store=self.store, local=self.local,
                                            agreement=self.agreement, events=events)
    self.events, self.metrics = events, metrics
    self.record = SaveRecord(self.store, events, metrics, on_saved or (lambda step, path: None),
                             ck.max_durable_lag, self.local is not None)
    self.on_save_started = on_save_started or (lambda step: None)
    self.on_progress = on_progress or (lambda: None)

  @property
  def location(self) -> str:
    return self.store.location

  def resolve_resume(self) -> Path | None:
    """The step to restore, or None for a fresh start."""
    self.resumed = self.resume.resolve()
    return self.resumed.path

  def read_meta(self, path: Path) -> dict:
    if self.local is not None and Path(path).parent == self.local.root:
      return self.local.read_meta(path)
    return self.store.read_meta(path)

  def restore(self, path: Path, state_spec: Any) -> Restored:
    check_model(self.cfg, path, self.read_meta(path), state_spec, self.events)
    t0 = time.monotonic()
    local = self.resumed.tier == policy.LOCAL and Path(path).parent == self.local.root
    restored = (self.local if local else self.store).restore(path, state_spec.abstract, state_spec.shardings)
    seconds = time.monotonic() - t0
    tier = self.resumed.tier or policy.DURABLE
    self.events.emit(ev.RESTORE, restored.step, seconds=seconds, path=str(path), tier=tier,
                     reason=self.resumed.reason, verify_s=self.resumed.verify_s, read_s=seconds)
    updates = int(restored.state.step)
    log.info("restored step %d%s from the %s tier, %s, in %.2fs (saved on mesh %s)", restored.step,
             f" ({updates} optimizer updates)" if updates != restored.step else "", tier, path, seconds,
             restored.meta.get("mesh"))
    note = quant.resume_note(config_lib.saved_config(restored.meta, f"checkpoint {path}")["model"], self.cfg.model)
    if note:
      log.warning("%s", note)
    self._abandon_after(restored.step, f"resumed from step {restored.step}")
    return restored

  def promote(self, restored: Restored, identity: RunIdentity) -> None:
    """Called once the restored state was accepted (its data state set: every check passed). Resumed from a
    local step (newer than the durable tier's): the same state, now on the devices, saved to the durable tier,
    so the step survives the node. Only a verified step: promotion writes a fresh manifest, which would make an
    unchecked one look verified. The formats differ (each process's raw shards vs one Orbax checkpoint), so
    this is a save, not a copy; like every durable save the loop blocks only for the device-to-host copy, the
    write and the manifest happen in the background."""
    if (self.resumed.tier != policy.LOCAL or not self.cfg.checkpoint.promote_local
        or restored.step in self.store.steps()):
      return
    if not self.cfg.checkpoint.verify:
      log.warning("local step %d not promoted to the durable tier: it was not verified (checkpoint.verify=False)",
                  restored.step)
      return
    log.info("promoting local step %d to the durable tier %s in the background", restored.step, self.location)
    self.events.emit(ev.CHECKPOINT_SAVE_START, restored.step, tier=policy.DURABLE, promoted_from=policy.LOCAL)
    t0 = time.monotonic()
    meta = {**run_meta(self.cfg, self.mesh_shape, identity), "promoted_from": policy.LOCAL}
    if self.store.save(restored.step, restored.state, restored.data_state, meta):
      self.events.emit(ev.CHECKPOINT_BLOCKED, restored.step, blocking_s=time.monotonic() - t0, tier=policy.DURABLE,
                       promoted_from=policy.LOCAL)

  def restore_before(self, step: int, state_spec: Any) -> Any | None:
    """The newest checkpoint's state from before `step` that verifies (waiting for a save in flight), or
    None when there is none at all. Corrupt ones above a good one are moved aside (an event each); when
    checkpoints exist but none verifies, CorruptCheckpoint (exit 2): the run must not go on from step 0."""
    self.record.durable(self.store.wait())
    good = self.resume.durable_before(step)
    if self.local is not None:  # the local tier may hold a newer step from before the fault
      self.record.local(self.local.wait())
      durable = int(good.name) if good is not None and good.name.isdigit() else None
      choice = self.resume.choose_local(durable, before=step)
      log.info("rollback: %s", choice.reason)
      if choice.tier == policy.LOCAL:
        state = self.local.restore(self.local.path(choice.step), state_spec.abstract, state_spec.shardings).state
        self._abandon_after(choice.step, f"rolled back from step {step}")
        return state
    restored = int(good.name) if good is not None and good.name.isdigit() else 0
    self._abandon_after(restored, f"rolled back from step {step}")
    if good is None:
      return None
    return self.store.restore(good, state_spec.abstract, state_spec.shardings).state

  def after_step(self, step: int, state: Any, data_state: dict, mesh_shape: dict, identity: RunIdentity, *,
                 final: bool) -> None:
    """Saves when the cadence says so (the final step synchronously, to the durable tier); else collects
    finished saves. A step due in both tiers goes to the durable one only."""
    self.cadence.observe(step)
    durable = self.cadence.due(policy.DURABLE, step)  # both asked every step: a due() may be a decision point
    local = self.local is not None and self.cadence.due(policy.LOCAL, step)
    if final or durable:
      self.save(step, state, data_state, mesh_shape, identity, sync=final)
    elif local:
      self.save_local(step, state, data_state, mesh_shape, identity, sync=False)
    else:
      self.record.durable(self.store.poll())
    if self.local is not None:
      self.record.local(self.local.poll())
    self.record.uploads(step)

  def save_local(self, step: int, state: Any, data_state: dict, mesh_shape: dict, identity: RunIdentity, *,
                 sync: bool) -> None:
    """A save to this process's local tier: the loop blocks for the device-to-host copy only (`sync`: all of it)."""
    with self.metrics.outside(step):
      self.events.emit(ev.CHECKPOINT_SAVE_START, step, tier=policy.LOCAL)
      t0 = time.monotonic()
      meta = {**run_meta(self.cfg, mesh_shape, identity), "identity": self.local.identity,
              "process_count": jax.process_count(), "process_index": jax.process_index(),
              "param_shapes": param_shapes(state), "step": step, "wall_time": time.time()}
      self.local.save(step, state, data_state, meta)
      self.on_save_started(step)
      done = self.local.wait() if sync else self.local.poll()
      blocking = time.monotonic() - t0
      self.events.emit(ev.CHECKPOINT_BLOCKED, step, blocking_s=blocking, tier=policy.LOCAL)
      self.cadence.saved(policy.LOCAL, step, blocking)
      self.record.local(done)

  def save(self, step: int, state: Any, data_state: dict, mesh_shape: dict, identity: RunIdentity, *,
           sync: bool) -> None:
    """A save to the durable tier: the loop blocks for the device-to-host copy only (`sync`: all of it)."""
    with self.metrics.outside(step):
      self.events.emit(ev.CHECKPOINT_SAVE_START, step)
      t0 = time.monotonic()
      timing = self.store.save(step, state, data_state, run_meta(self.cfg, mesh_shape, identity))
      if timing is not None:
        self.on_save_started(step)
        done = self.store.wait() if sync else self.store.poll()
        if sync:
          timing.blocking_s = time.monotonic() - t0  # the loop waited for all of it
        self.events.emit(ev.CHECKPOINT_BLOCKED, step, blocking_s=time.monotonic() - t0)
        self.cadence.saved(policy.DURABLE, step, timing.blocking_s)
        self.record.durable(done)

  def save_preemption(self, step: int, state: Any, data_state: dict, mesh_shape: dict, identity: RunIdentity,
                      since_signal_s: float = 0.0) -> None:
    """Asked to stop: the tiers whose measured save time fits in what is left of the grace period
    (`checkpoint.preemption_grace_s`), fastest first (policy.preemption_plan); process 0 decides for all (the
    durable save is collective). The plan and its inputs are a `checkpoint_preemption` event."""
    if self.local is not None:
      self.record.local(self.local.wait())  # a local save in flight (milliseconds): its time is measured too
    self.record.durable(self.store.poll())
    grace = float(self.cfg.checkpoint.preemption_grace_s)
    remaining = grace - since_signal_s if grace > 0 else None
    costs = {policy.DURABLE: self.record.save_cost(policy.DURABLE)}
    if self.local is not None:
      costs[policy.LOCAL] = self.record.save_cost(policy.LOCAL)
    plan = self.agreement.plan(step, policy.preemption_plan(remaining, costs))
    self.events.emit(ev.CHECKPOINT_PREEMPTION, step, grace_s=grace, remaining_s=remaining, cost_s=costs,
                     tiers=plan.tiers, skipped=plan.skipped, why=plan.why)
    skipped = f", not the {' nor the '.join(plan.skipped)}" if plan.skipped else ""
    log.warning("stop request: saving step %d to the %s tier%s%s (%s)", step, " then the ".join(plan.tiers),
                "s" if len(plan.tiers) > 1 else "", skipped, plan.why)
    for tier in plan.tiers:
      if tier == policy.LOCAL:
        self.save_local(step, state, data_state, mesh_shape, identity, sync=True)
      else:
        self.save(step, state, data_state, mesh_shape, identity, sync=True)

  def check_final(self, step: int) -> None:
    """Exiting 0 would lose this run's work silently when its last save failed; a crash exit lets a
    supervisor restart from the newest complete checkpoint."""
    if self.store.saves.failed_step == step:
      raise RuntimeError(f"the final checkpoint (step {step}) could not be written to {self.location}: "
                         f"{self.store.saves.last_error}")

  def settle(self) -> None:
    """Waits for the saves in flight (both tiers) and records them."""
    if self.local is not None:
      self.record.local(self.local.wait())
    self.record.durable(self.store.wait())

  def close(self) -> None:
    self.on_progress()  # the wait for the last save and upload starts now, under the watchdog
    if self.local is not None:
      self.record.local(self.local.wait())
      self.local.close()
    self.store.close()
