"""The run's checkpoint component: where (the durable tier `checkpoint.dir`, default
`<output_dir>/checkpoints`, and the optional node-local tier `checkpoint.local_dir`), when (checkpoint/cadence.py:
every N steps or minutes, or from the measured cost and failure rate; always at the end and on preemption),
which tier a run resumes from (checkpoint/tiers.py), restoring onto the run's state spec, and the record of
every save and restore, phase by phase (events, TensorBoard, the log). The storage itself is `storage.py`
(Orbax, S3, verification) and `local.py` (the local tier)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

import jax
import ml_collections

from maxtrain import config as config_lib
from maxtrain.checkpoint import manifest, tiers
from maxtrain.checkpoint.cadence import Cadence
from maxtrain.checkpoint.local import LocalSave, LocalTier
from maxtrain.checkpoint.storage import Checkpointer, Restored, SaveTiming, _param_shapes, validate_tiers
from maxtrain.errors import UserError
from maxtrain.models import quant, registry
from maxtrain.monitor import events as ev
from maxtrain.runtime.kv import KeyValue

log = logging.getLogger("maxtrain")
# Config keys a restarted run may change and still be the same run (its length, where it logs, its process layout,
# monitoring, drills, the checkpoint keys themselves); every other section (seed, model, data, optimizer, guards,
# post-training, pipeline) is hashed into a local step's identity.
_NOT_IDENTITY = frozenset({"hardware", "steps", "output_dir", "log_every", "mesh", "checkpoint", "runtime", "mfu",
                           "profile", "monitor", "tracking", "faults", "watchdog", "fleet", "eval"})


class Checkpoints:
  """The run's checkpoint component: where (`checkpoint.dir`, default `<output_dir>/checkpoints`), when
  (every `checkpoint.every_steps`, at the end, on preemption), restoring onto the run's state spec,
  and the record of every save (events, TensorBoard, the log)."""

  def __init__(self, cfg: ml_collections.ConfigDict, output_dir: Path, events: Any, metrics: Any,
               on_save_started: Any = None, on_progress: Callable[[], None] | None = None,
               on_saved: Callable[[int, Path], None] | None = None, mesh_shape: dict | None = None):
    local = output_dir / "checkpoints"
    self.cfg, self.mesh_shape = cfg, mesh_shape or {}
    validate_tiers(cfg.checkpoint, str(local))  # checkpoint.dir="" resolves only now
    self.store = Checkpointer(cfg.checkpoint, cfg.checkpoint.dir or str(local), local, on_progress,
                              lock=jax.process_index() == 0)
    ck, kv = cfg.checkpoint, KeyValue.current()
    self.local = None
    if ck.local_dir:
      try:
        self.local = LocalTier(ck.local_dir, jax.process_index(), ck.local_max_to_keep, self._identity(output_dir))
      except BaseException:
        self.store.release_locks()  # exit 2 (in use, unwritable): the durable tier's lock goes with it
        raise
    self.agreement = tiers.Agreement(kv, jax.process_index(), jax.process_count())
    self.cadence = Cadence(ck, events, kv, jax.process_index(), output_dir / ev.FILENAME)
    self.resume_tier: str | None = None
    self._save_s: dict[str, list[float]] = {tiers.LOCAL: [], tiers.DURABLE: []}  # measured, for a stop request
    self._upload_s: list[float] = []
    self._abandons = 0  # numbers the key-value keys of the abandon barrier
    self._behind_reported = 0  # the lag last reported (a checkpoint_behind event each time it grows)
    self.events, self.metrics = events, metrics
    self.on_save_started = on_save_started or (lambda step: None)
    self.on_progress = on_progress or (lambda: None)
    self.on_saved = on_saved or (lambda step, path: None)  # a save is complete on disk
    self.tokenizer_identity: str | None = None  # of the run's stores (loop/data.py): in every checkpoint's meta
    self.rollbacks = 0  # the run's rollbacks so far (loop/rollback.py keeps the count): in every checkpoint's meta

  @property
  def location(self) -> str:
    return self.store.location

  def _identity(self, output_dir: Path) -> dict[str, str]:
    """Which run a local step belongs to: its output and checkpoint dirs, and a hash of the config sections that
    shape its state (a run restarted as it was keeps it; its length, the process layout, monitoring and drills may
    change)."""
    location = self.store.location
    redacted = config_lib.redacted(self.cfg)
    shaping = {k: v for k, v in redacted.items() if k not in _NOT_IDENTITY}
    return {"output_dir": str(Path(output_dir).absolute().resolve()),
            "checkpoint_dir": location if "://" in location else str(Path(location).absolute().resolve()),
            "config_hash": ev.config_hash(shaping)}

  def resolve_resume(self, state_spec: Any = None) -> Path | None:
    """The step to restore, or None for a fresh start. `state_spec`: the run's state; a durable step without a
    manifest is checked by restoring onto it (storage.Checkpointer.verify)."""
    if state_spec is not None:
      self.store.target = (state_spec.abstract, state_spec.shardings)
    resume = str(self.cfg.checkpoint.resume)
    own = self.local.own_steps() if self.local is not None else []
    if own and resume == "never":
      raise UserError(f"checkpoint.resume=never but checkpoint.local_dir={self.cfg.checkpoint.local_dir} holds this "
                      f"run's local steps {own}; a fresh run must not overwrite them. Use another output_dir, or "
                      "resume=auto.")
    if resume.isdigit() and self.local is not None:  # every process takes this path: the search is agreed
      local_path = self._resolve_local_explicit(int(resume))
      if local_path is not None:
        return local_path
    path = self._resolve_resume()
    if self.local is not None and resume.isdigit():
      self._branch_local(int(resume))
    return path

  def _resolve_local_explicit(self, step: int) -> Path | None:
    """resume=N with a local tier, as in the durable tier: the durable tier's step N when it has one (None: resolved
    there), else this run's local step N if it is usable on every process (exit 2 if not)."""
    self.store.check_step_dirs()
    if step in self.store.steps():
      return None  # the durable tier's step N: resolved there
    if not self.cfg.checkpoint.branch:
      self._branch_local(step)  # newer local steps: exit 2 before anything is read or moved
    choice = self._choose(None, before=step + 1)
    if choice.step != step:
      raise UserError(f"checkpoint.resume={step}: no complete checkpoint at step {step} in {self.location} (found "
                      f"steps {self.store.steps() or 'none'}), nor a local step {step} of this run usable on every "
                      f"process ({choice.reason})")
    self._branch_local(step)
    self.store._branch(step, [s for s in self.store.steps() if s > step], self._on_branch)
    self.resume_tier, self.resume_reason = tiers.LOCAL, f"checkpoint.resume={step}: {choice.reason}"
    self.resume_verify_s = 0.0
    return self.local.path(step)

  def _branch_local(self, step: int) -> None:
    """resume=N while this run's local tier holds newer steps: exit 2 unless checkpoint.branch (then moved
    aside, an event), as in the durable tier."""
    newer = [s for s in self.local.own_steps() if s > step]
    if not newer:
      return
    if not self.cfg.checkpoint.branch:
      raise UserError(f"checkpoint.resume={step} but checkpoint.local_dir={self.cfg.checkpoint.local_dir} holds this "
                      f"run's newer local steps {newer}: continuing from step {step} would train over them. Use "
                      f"resume=auto, or set checkpoint.branch=True to move the newer steps aside and continue from "
                      f"step {step}.")
    moved = [self.local.move_aside(s, "branched") for s in newer]
    log.warning("checkpoint.branch: resuming step %d; newer local steps %s moved aside to %s", step, newer,
                [str(m) for m in moved])
    self._on_branch(step, newer, moved, tiers.LOCAL)

  def _on_branch(self, step: int, newer: list[int], moved: list[Path], tier: str = tiers.DURABLE) -> None:
    self.events.emit(ev.CHECKPOINT_BRANCH, step, newer_steps=newer, moved_to=[str(m) for m in moved], tier=tier)

  def _resolve_resume(self) -> Path | None:
    def corrupt(step: int, error: manifest.CorruptCheckpoint, moved: Path) -> None:
      self.events.emit(ev.CHECKPOINT_CORRUPT, step, file=error.first_bad_file, reason=error.reason,
                       moved_to=str(moved))

    t0 = time.monotonic()
    path = self.store.resolve_resume(on_corrupt=corrupt, on_branch=self._on_branch)
    self.resume_tier = tiers.DURABLE if path is not None else None
    if self.local is not None and str(self.cfg.checkpoint.resume) == "auto":
      durable = int(path.name) if path is not None and path.name.isdigit() else None
      choice = self._choose(durable)
      log.info("resume: %s", choice.reason)
      self.resume_reason = choice.reason
      if choice.tier == tiers.LOCAL:
        path, self.resume_tier = self.local.path(choice.step), tiers.LOCAL
        self.store.forget_prefetched()
    self.resume_verify_s = time.monotonic() - t0  # listing and verifying the candidates
    return path

  def _choose(self, durable: int | None, before: int | None = None) -> tiers.Choice:
    """The tier and step to restore, the same on every process (the local steps and the corrupt ones are
    agreed). As in the durable tier: corrupt local steps are moved aside (an event each) once a good step is
    chosen; when local steps exist but none is usable anywhere and the durable tier has no step either, exit 2
    with nothing moved, unless checkpoint.start_over_if_corrupt."""
    ck = self.cfg.checkpoint
    scan = self.local.scan(self.mesh_shape, jax.process_count(), ck.verify)
    for step, reason in scan.skipped.items():
      log.warning("local checkpoint %s not used: %s", self.local.path(step), reason)
    lists = self.agreement.gather({"usable": scan.usable, "corrupt": sorted(scan.corrupt), "intact": scan.intact})
    choice = tiers.choose([p["usable"] for p in lists], durable, before, verified=bool(ck.verify))

    def below(steps):
      return [s for s in steps if before is None or s < before]

    corrupt = {step: e for step, e in scan.corrupt.items() if step in below(scan.corrupt)}
    anywhere = [(i, s) for i, p in enumerate(lists) for s in below(p["corrupt"])]
    intact = [s for p in lists for s in below(p["intact"])]
    if choice.tier is None and anywhere and not intact and not ck.start_over_if_corrupt:
      for step, error in sorted(corrupt.items(), reverse=True):
        log.error("local %s", error)
      first = corrupt[max(corrupt)] if corrupt else None
      raise UserError(f"checkpoint.local_dir={ck.local_dir}: no local step verifies (steps "
                      f"{sorted({s for _, s in anywhere}, reverse=True)}"
                      f"{'; newest here: ' + str(first) if first is not None else ''}) and the durable tier "
                      f"{self.location} holds no good step. Nothing was moved or trained. Restore the files, or set "
                      "checkpoint.start_over_if_corrupt=True to move them aside and train from step 0.")
    for step, error in sorted(corrupt.items(), reverse=True):
      moved = self.local.move_aside(step)
      log.error("local %s; moved aside to %s%s", error, moved,
                " (checkpoint.start_over_if_corrupt)" if choice.tier is None and not intact else "")
      self.events.emit(ev.CHECKPOINT_CORRUPT, step, file=error.first_bad_file, reason=error.reason,
                       moved_to=str(moved), tier=tiers.LOCAL)
    return choice

  def read_meta(self, path: Path) -> dict:
    if self.local is not None and Path(path).parent == self.local.root:
      return self.local.read_meta(path)
    return self.store.read_meta(path)

  def restore(self, path: Path, state_spec: Any) -> Restored:
    self._check_model(path, state_spec)
    t0 = time.monotonic()
    if self.resume_tier == tiers.LOCAL and Path(path).parent == self.local.root:
      state, data_state = self.local.restore(path, state_spec.abstract, state_spec.shardings)
      restored = Restored(step=int(state.step), state=state, data_state=data_state, meta=self.read_meta(path),
                          path=str(path))
    else:
      restored = self.store.restore(path, state_spec.abstract, state_spec.shardings)
    seconds = time.monotonic() - t0
    tier = self.resume_tier or tiers.DURABLE
    self.events.emit(ev.RESTORE, restored.step, seconds=seconds, path=str(path), tier=tier,
                     reason=getattr(self, "resume_reason", ""), verify_s=getattr(self, "resume_verify_s", None),
                     read_s=seconds)
    log.info("restored step %d from the %s tier, %s, in %.2fs (saved on mesh %s)", restored.step, tier, path,
             seconds, restored.meta.get("mesh"))
    note = quant.resume_note(config_lib.saved_config(restored.meta, f"checkpoint {path}")["model"], self.cfg.model)
    if note:
      log.warning("%s", note)
    self._abandon_after(restored.step, f"resumed from step {restored.step}")
    return restored

  def _check_model(self, path: Path, state_spec: Any) -> None:
    """DESIGN rule 1 for the model: a step saved under other model math (same parameter tree, another function:
    a sliding window, a RoPE base, another family) is exit 2 naming the keys before anything is restored,
    unless checkpoint.resume_new_model (then on the record). Another parameter tree is left to the restore,
    which names the parameters. The local tier also refuses such a step by its config hash; this catches the
    durable tier and an explicit resume path."""
    meta = self.read_meta(path)
    if meta.get("param_shapes", {}) != _param_shapes(state_spec.abstract):
      return
    changes = registry.math_changes(config_lib.saved_config(meta, f"checkpoint {path}")["model"],
                                    config_lib.redacted(self.cfg)["model"])
    if not changes:
      return
    if not self.cfg.checkpoint.resume_new_model:
      raise UserError(f"checkpoint {path} was saved under another model ({'; '.join(changes)}): its parameters "
                      "would compute another function. Resume with the saved values, start a new run from its "
                      "parameters (checkpoint.init_from), or set --config.checkpoint.resume_new_model=True to go on "
                      "deliberately.")
    log.warning("resuming %s under changed model keys (checkpoint.resume_new_model): %s", path, "; ".join(changes))
    self.events.emit(ev.MODEL_CHANGE, None, path=str(path), changes=changes)

  def promote(self, restored: Restored) -> None:
    """Called once the restored state was accepted (its data state set: every check passed). Resumed from a
    local step (newer than the durable tier's): the same state, now on the devices, saved to the durable tier,
    so the step survives the node. Only a verified step: promotion writes a fresh manifest, which would make an
    unchecked one look verified. The formats differ (each process's raw shards vs one Orbax checkpoint), so
    this is a save, not a copy; like every durable save the loop blocks only for the device-to-host copy, the
    write and the manifest happen in the background."""
    if self.resume_tier != tiers.LOCAL or not self.cfg.checkpoint.promote_local or restored.step in self.store.steps():
      return
    if not self.cfg.checkpoint.verify:
      log.warning("local step %d not promoted to the durable tier: it was not verified (checkpoint.verify=False)",
                  restored.step)
      return
    log.info("promoting local step %d to the durable tier %s in the background", restored.step, self.location)
    self.events.emit(ev.CHECKPOINT_SAVE_START, restored.step, tier=tiers.DURABLE, promoted_from=tiers.LOCAL)
    t0 = time.monotonic()
    extra = {"rollbacks": self.rollbacks, "tokenizer_identity": self.tokenizer_identity, "promoted_from": tiers.LOCAL}
    if self.store.save(restored.step, restored.state, restored.data_state, self.cfg, self.mesh_shape, extra):
      self.events.emit(ev.CHECKPOINT_BLOCKED, restored.step, blocking_s=time.monotonic() - t0, tier=tiers.DURABLE,
                       promoted_from=tiers.LOCAL)

  def _abandon_after(self, step: int, why: str) -> None:
    """Restored `step`: the newer steps of both tiers belong to the abandoned timeline. The durable ones are
    moved aside (never deleted: a user may want them back), the local ones (this process's short-term
    copies) deleted; the other processes wait until process 0 has moved them, then list the tier afresh."""
    dropped = self.local.drop_after(step) if self.local is not None else []
    if dropped:
      log.warning("local checkpoint steps %s are newer than the restored step %d (a run that was abandoned): deleted",
                  dropped, step)
    moved = self.store.abandon_after(step)
    kv = self.agreement.kv
    if kv is not None:
      self._abandons += 1
      key = f"ckpt-abandon/{self._abandons}"
      if jax.process_index() == 0:
        kv.set(key, "done")
      elif kv.get(key, tiers.AGREE_TIMEOUT_S) is None:
        raise RuntimeError("process 0 did not set aside the abandoned durable steps within "
                           f"{tiers.AGREE_TIMEOUT_S:.0f}s")
      self.store.reload()
    if (moved or dropped) and jax.process_index() == 0:
      self.events.emit(ev.CHECKPOINT_ABANDONED, step, durable_steps=[s for s, _ in moved],
                       moved_to=[p for _, places in moved for p in places], local_steps=dropped, reason=why)
    if moved and jax.process_index() == 0:
      log.warning("durable checkpoint steps %s are newer than the restored step %d (%s): they belong to an abandoned "
                  "timeline, moved aside (not deleted) to %s; resume=auto will not take them",
                  [s for s, _ in moved], step, why, [p for _, places in moved for p in places])

  def restore_before(self, step: int, state_spec: Any) -> Any | None:
    """The newest checkpoint's state from before `step` that verifies (waiting for a save in flight), or
    None when there is none at all. Corrupt ones above a good one are moved aside (an event each); when
    checkpoints exist but none verifies, CorruptCheckpoint (exit 2): the run must not go on from step 0."""
    self._log(self.store.wait())
    before = [s for s in self.store.steps() if s < step]
    good, corrupt = self.store.newest_good(before)
    if good is None and corrupt:
      raise corrupt[0][1]
    for bad, error in corrupt:
      moved = self.store.move_aside(bad)
      log.error("rollback: %s; moved aside to %s, trying an older checkpoint", error, moved)
      self.events.emit(ev.CHECKPOINT_CORRUPT, bad, file=error.first_bad_file, reason=error.reason, moved_to=str(moved))
    if self.local is not None:  # the local tier may hold a newer step from before the fault
      self._log_local(self.local.wait())
      durable = int(good.name) if good is not None and good.name.isdigit() else None
      choice = self._choose(durable, before=step)
      log.info("rollback: %s", choice.reason)
      if choice.tier == tiers.LOCAL:
        state = self.local.restore(self.local.path(choice.step), state_spec.abstract, state_spec.shardings)[0]
        self._abandon_after(choice.step, f"rolled back from step {step}")
        return state
    restored = int(good.name) if good is not None and good.name.isdigit() else 0
    self._abandon_after(restored, f"rolled back from step {step}")
    if good is None:
      return None
    return self.store.restore(good, state_spec.abstract, state_spec.shardings).state

  def after_step(self, step: int, state: Any, data_state: dict, mesh_shape: dict, *, final: bool) -> None:
    """Saves when the cadence says so (the final step synchronously, to the durable tier); else collects
    finished saves. A step due in both tiers goes to the durable one only."""
    self.cadence.observe(step)
    durable = self.cadence.due("durable", step)  # both asked every step: a due() may be a decision point
    local = self.local is not None and self.cadence.due("local", step)
    if final or durable:
      self.save(step, state, data_state, mesh_shape, sync=final)
    elif local:
      self.save_local(step, state, data_state, mesh_shape, sync=False)
    else:
      self._log(self.store.poll())
    if self.local is not None:
      self._log_local(self.local.poll())
    self._log_remote(step)

  def _log_remote(self, step: int) -> None:
    """Uploads finished (bytes/s), and whether the durable tier falls behind (a slow or stalled bucket)."""
    remote = self.store.remote
    if remote is None:
      return
    for saved_step, num_bytes, seconds in remote.uploaded():
      rate = num_bytes / max(seconds, 1e-9)
      self._upload_s.append(seconds)
      self.events.emit(ev.CHECKPOINT_UPLOAD, saved_step, tier=tiers.DURABLE, bytes=num_bytes, seconds=seconds,
                       bytes_per_s=rate)
      self.metrics.scalars(saved_step, {"checkpoint/durable/upload_s": seconds,
                                        "checkpoint/durable/upload_bytes_per_s": rate})
    pending, limit = remote.pending(), self.cfg.checkpoint.max_durable_lag
    if pending > limit and pending > self._behind_reported:
      self.events.emit(ev.CHECKPOINT_BEHIND, step, tier=tiers.DURABLE, pending=pending, max_durable_lag=limit)
      log.warning("the durable tier %s is falling behind: %d saves wait for upload (checkpoint.max_durable_lag=%d); "
                  "training goes on%s", self.location, pending, limit,
                  " on the local tier" if self.local is not None else "")
    self._behind_reported = pending if pending > limit else 0

  def save_local(self, step: int, state: Any, data_state: dict, mesh_shape: dict, *, sync: bool) -> None:
    """A save to this process's local tier: the loop blocks for the device-to-host copy only (`sync`: all of it)."""
    with self.metrics.outside(step):
      self.events.emit(ev.CHECKPOINT_SAVE_START, step, tier=tiers.LOCAL)
      t0 = time.monotonic()
      meta = {"config": config_lib.redacted(self.cfg), "identity": self.local.identity, "mesh": mesh_shape,
              "process_count": jax.process_count(),
              "process_index": jax.process_index(), "param_shapes": _param_shapes(state), "step": step,
              "wall_time": time.time(), "rollbacks": self.rollbacks, "tokenizer_identity": self.tokenizer_identity}
      self.local.save(step, state, data_state, meta)
      self.on_save_started(step)
      done = self.local.wait() if sync else self.local.poll()
      blocking = time.monotonic() - t0
      self.events.emit(ev.CHECKPOINT_BLOCKED, step, blocking_s=blocking, tier=tiers.LOCAL)
      self.cadence.saved(tiers.LOCAL, step, blocking)
      self._log_local(done)

  def _log_local(self, saves: list[LocalSave]) -> None:
    for save in saves:
      if save.error is not None:
        log.error("local checkpoint of step %d failed: %s: %s (training continues)", save.step,
                  type(save.error).__name__, save.error)
        continue
      phases = {"device_to_host_s": save.blocking_s, **save.phases}
      self._save_s[tiers.LOCAL].append(save.save_s)
      self.events.emit(ev.CHECKPOINT_SAVE_END, save.step, tier=tiers.LOCAL, blocking_s=save.blocking_s,
                       save_s=save.save_s, bytes=save.num_bytes, **phases)
      self.metrics.scalars(save.step, {f"checkpoint/local/{k}": v for k, v in phases.items()}
                           | {"checkpoint/local/save_s": save.save_s})
      log.info("local checkpoint step %d saved (%.1f MB): loop blocked %.3fs, complete after %.3fs (%s)", save.step,
               save.num_bytes / 1e6, save.blocking_s, save.save_s,
               ", ".join(f"{k} {v:.3f}s" for k, v in save.phases.items()))

  def save(self, step: int, state: Any, data_state: dict, mesh_shape: dict, *, sync: bool) -> None:
    with self.metrics.outside(step):
      self.events.emit(ev.CHECKPOINT_SAVE_START, step)
      t0 = time.monotonic()
      extra = {"rollbacks": self.rollbacks, "tokenizer_identity": self.tokenizer_identity}
      timing = self.store.save(step, state, data_state, self.cfg, mesh_shape, extra)
      if timing is not None:
        self.on_save_started(step)
        done = self.store.wait() if sync else self.store.poll()
        if sync:
          timing.blocking_s = time.monotonic() - t0  # the loop waited for all of it
        self.events.emit(ev.CHECKPOINT_BLOCKED, step, blocking_s=time.monotonic() - t0)
        self.cadence.saved(tiers.DURABLE, step, timing.blocking_s)
        self._log(done)

  def save_preemption(self, step: int, state: Any, data_state: dict, mesh_shape: dict,
                      since_signal_s: float = 0.0) -> None:
    """Asked to stop: the tiers whose measured save time fits in what is left of the grace period
    (`checkpoint.preemption_grace_s`), fastest first (tiers.preemption_plan); process 0 decides for all (the
    durable save is collective). The plan and its inputs are a `checkpoint_preemption` event."""
    if self.local is not None:
      self._log_local(self.local.wait())  # a local save in flight (milliseconds): its time is measured too
    self._log(self.store.poll())
    grace = float(self.cfg.checkpoint.preemption_grace_s)
    remaining = grace - since_signal_s if grace > 0 else None
    costs = {tiers.DURABLE: self.save_cost(tiers.DURABLE)}
    if self.local is not None:
      costs[tiers.LOCAL] = self.save_cost(tiers.LOCAL)
    plan = self._agreed_plan(step, tiers.preemption_plan(remaining, costs))
    self.events.emit(ev.CHECKPOINT_PREEMPTION, step, grace_s=grace, remaining_s=remaining, cost_s=costs,
                     tiers=plan.tiers, skipped=plan.skipped, why=plan.why)
    skipped = f", not the {' nor the '.join(plan.skipped)}" if plan.skipped else ""
    log.warning("stop request: saving step %d to the %s tier%s%s (%s)", step, " then the ".join(plan.tiers),
                "s" if len(plan.tiers) > 1 else "", skipped, plan.why)
    for tier in plan.tiers:
      if tier == tiers.LOCAL:
        self.save_local(step, state, data_state, mesh_shape, sync=True)
      else:
        self.save(step, state, data_state, mesh_shape, sync=True)

  def _agreed_plan(self, step: int, plan: tiers.PreemptionPlan) -> tiers.PreemptionPlan:
    kv = self.agreement.kv
    if kv is None:
      return plan
    key = f"ckpt-preempt/{step}"
    if jax.process_index() == 0:
      kv.set(key, json.dumps(dataclasses.asdict(plan)))
      return plan
    value = kv.get(key, tiers.AGREE_TIMEOUT_S)
    if value is None:
      raise RuntimeError(f"process 0 did not say which tiers the stop at step {step} saves within "
                         f"{tiers.AGREE_TIMEOUT_S:.0f}s")
    return tiers.PreemptionPlan(**json.loads(value))

  def save_cost(self, tier: str) -> float | None:
    """Mean seconds from the start of a save of `tier` to its being complete (for s3://, uploaded too) in this
    attempt; None before one was measured."""
    done = self._save_s[tier]
    if not done:
      return None
    cost = sum(done) / len(done)
    if tier == tiers.DURABLE and self.store.remote is not None:
      if not self._upload_s:
        return None
      cost += sum(self._upload_s) / len(self._upload_s)
    return cost

  def check_final(self, step: int) -> None:
    """Exiting 0 would lose this run's work silently when its last save failed; a crash exit lets a
    supervisor restart from the newest complete checkpoint."""
    if self.store.failed_step == step:
      raise RuntimeError(f"the final checkpoint (step {step}) could not be written to {self.location}: "
                         f"{self.store.last_error}")

  def _log(self, timings: list[SaveTiming]) -> None:
    for timing in timings:
      phases = {"device_to_host_s": timing.device_to_host_s, "manifest_s": timing.manifest_s,
                "write_s": timing.save_s - timing.device_to_host_s - (timing.manifest_s or 0.0)}  # Orbax's serialise + write
      self._save_s[tiers.DURABLE].append(timing.save_s)
      self.events.emit(ev.CHECKPOINT_SAVE_END, timing.step, blocking_s=timing.blocking_s, save_s=timing.save_s,
                       tier=tiers.DURABLE, bytes=timing.num_bytes, **phases)
      self.metrics.scalars(timing.step, {"checkpoint/blocking_s": timing.blocking_s,
                                         "checkpoint/save_s": timing.save_s}
                           | {f"checkpoint/durable/{k}": v for k, v in phases.items() if v is not None})
      log.info("checkpoint step %d saved: loop blocked %.3fs, complete on disk after %.3fs",
               timing.step, timing.blocking_s, timing.save_s)
      self.on_saved(timing.step, self.store.local_path(timing.step))

  def settle(self) -> None:
    """Waits for the saves in flight (both tiers) and records them."""
    if self.local is not None:
      self._log_local(self.local.wait())
    self._log(self.store.wait())

  def close(self) -> None:
    self.on_progress()  # the wait for the last save and upload starts now, under the watchdog
    if self.local is not None:
      self._log_local(self.local.wait())
      self.local.close()
    self.store.close()
