"""The evaluation sidecar (`python -m maxtrain.eval --watch RUN_DIR --tasks ...`): every verified
checkpoint of a run evaluated exactly once, across its own kills and the trainer's restarts.

Exactly once, by construction: a step is done iff RUN/eval/STEP/results.json exists, and that file
appears whole or not at all (written aside, fsynced, renamed). A sidecar killed mid-evaluation left no
file, so the step is evaluated again (its one completed evaluation); one killed between the rename and
its `checkpoint_eval` event gets the event on restart (`reconcile`), so events count results exactly.
Every step the sidecar started ends recorded, evaluated or skipped with the reason: a started step whose
checkpoint is gone (the trainer's `checkpoint.max_to_keep` rotated it away while the sidecar was down
or busy) gets a `checkpoint_eval_skipped` record once the sidecar sees it missing.
One sidecar per run (a lock the kernel drops with its holder, SIGKILL included). It exits 0 once the
trainer's last attempt has exited 0 in every process and no checkpoint is left: the trainer's exit
event is written after its last checkpoint is durable, so reading it before listing the checkpoints
leaves no race.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Sequence

from maxtrain.errors import UserError
from maxtrain.checkpoint import manifest
from maxtrain.checkpoint.manifest import CorruptCheckpoint
from maxtrain.evaluation import run
from maxtrain.monitor import events as ev

log = logging.getLogger("maxtrain")
EVAL_START = "checkpoint_eval_start"  # The sidecar began evaluating the checkpoint of `step`: tasks.
EVAL_DONE = "checkpoint_eval"  # Its results are durable: seconds, results (path)[, recovered: event re-emitted].
EVAL_SKIPPED = "checkpoint_eval_skipped"  # The checkpoint of `step` failed verification or was deleted: reason.
KILL_AT_STEP_ENV = "MAXTRAIN_FAULT_KILL_DURING_EVAL_AT_STEP"  # a drill: SIGKILL mid-evaluation of this step, once


def results_path(run_dir: Path, step: int) -> Path:
  return run_dir / "eval" / str(step) / "results.json"


def run_finished(run_dir: Path) -> bool:
  """Whether the trainer's latest attempt exited 0 in every one of its processes."""
  path = run_dir / ev.FILENAME
  if not path.exists():
    return False
  records = ev.read_events(path)
  starts = [i for i, r in enumerate(records) if r.get("kind") == ev.JOB_START]
  if not starts:
    return False
  attempt = records[starts[-1]]
  later = records[starts[-1]:]
  exits = {r.get("process", 0): r.get("code") for r in later if r.get("kind") == ev.EXIT}
  processes = int(attempt.get("hosts") or 1)
  return len(exits) == processes and all(code == 0 for code in exits.values())


def checkpoint_steps(run_dir: Path) -> list[int]:
  directory = run_dir / "checkpoints"
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


class Sidecar:
  def __init__(self, run_dir: Path, names: Sequence[str], manager: Any, overrides: Sequence[str], batch_size: int):
    if not run_dir.is_dir():
      raise UserError(f"--watch={run_dir}: no such directory (a run's output_dir)")
    self.run_dir, self.names, self.manager = run_dir, list(names), manager
    self.overrides, self.batch_size = list(overrides), batch_size
    (run_dir / "eval").mkdir(exist_ok=True)
    self._lock = open(run_dir / "eval" / ".watch.lock", "a")
    try:
      fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise UserError(f"another evaluation sidecar is watching {run_dir} (it holds {self._lock.name}); "
                      "one per run") from None
    self.events = ev.EventLog(run_dir / "eval" / ev.FILENAME)
    self.lm: Any = None
    self._seam: Any = None  # the step being evaluated's fault seam (_fault_seam), called by the LM (_after_batch)
    self.skipped: set[int] = set()  # steps recorded as skipped (an event each), never tried again
    self.unfinished: set[int] = set()  # steps started without a done or skipped record yet
    self.reconcile()

  def _event_steps(self, kind: str) -> set[int]:
    path = self.run_dir / "eval" / ev.FILENAME
    return {r["step"] for r in ev.read_events(path) if r.get("kind") == kind} if path.exists() else set()

  def reconcile(self) -> None:
    """An event for every results file (a sidecar killed between its rename and its event); the steps
    earlier sidecars started and never finished or skipped (killed mid-evaluation) are tracked, and
    recorded as skipped once their checkpoint is gone."""
    logged = self._event_steps(EVAL_DONE)
    for step in checkpoint_steps(self.run_dir):
      if step not in logged and results_path(self.run_dir, step).exists():
        self.events.emit(EVAL_DONE, step, results=str(results_path(self.run_dir, step)), recovered=True)
        logged.add(step)
    self.skipped = self._event_steps(EVAL_SKIPPED)
    self.unfinished = self._event_steps(EVAL_START) - logged - self.skipped
    self.close_vanished()

  def close_vanished(self) -> None:
    """A `checkpoint_eval_skipped` record for each started, unfinished step whose checkpoint is gone."""
    for step in sorted(self.unfinished):
      if results_path(self.run_dir, step).exists():
        continue  # finished by this sidecar after all (its done event follows)
      if not (self.run_dir / "checkpoints" / str(step)).is_dir():
        self._skip(step, "the checkpoint was deleted (the trainer's checkpoint.max_to_keep rotated it away) before "
                   "its evaluation finished (the sidecar stopped or was killed mid-evaluation)")

  def _skip(self, step: int, reason: str) -> None:
    self.skipped.add(step)
    self.unfinished.discard(step)
    self.events.emit(EVAL_SKIPPED, step, reason=reason[:1000])
    log.warning("checkpoint %d not evaluated: %s", step, reason[:300])

  def pending(self) -> list[int]:
    """Checkpoint steps not evaluated yet whose manifest is written (the trainer writes it last, after
    Orbax's commit): loading verifies them, once; a step that fails is skipped from then on."""
    return [step for step in checkpoint_steps(self.run_dir)
            if step not in self.skipped and not results_path(self.run_dir, step).exists()
            and (self.run_dir / "checkpoints" / str(step) / manifest.MANIFEST_NAME).is_file()]

  def evaluate(self, step: int) -> None:
    from maxtrain.monitor.tensorboard import MetricWriter  # jax: not for `maxtrain.eval --help`

    path = str(self.run_dir / "checkpoints" / str(step))
    self.events.emit(EVAL_START, step, tasks=self.names)
    self.unfinished.add(step)
    t0 = time.monotonic()
    try:  # verified here, before any parameter is read
      if self.lm is None:
        self.lm, _ = run.load_lm(path, self.overrides, self.batch_size, after_batch=self._after_batch)
      else:
        self.lm.load_params(path)
    except Exception as e:
      # Corrupt (the trainer's resume moves it aside), or deleted by checkpoint.max_to_keep while being
      # read: skipped, with a record. Anything else is the sidecar's own failure.
      if not isinstance(e, CorruptCheckpoint) and Path(path).is_dir():
        raise
      self._skip(step, f"{type(e).__name__}: {e}")
      return
    self._seam = self._fault_seam(step)
    results = run.evaluate(self.lm, self.names, self.manager)
    run.write_json(results_path(self.run_dir, step), results)  # the step is done from here on
    writer = MetricWriter(self.run_dir / "eval" / "tensorboard")
    writer.scalars(step, run.scalars(results))
    writer.close()
    self.events.emit(EVAL_DONE, step, seconds=time.monotonic() - t0, results=str(results_path(self.run_dir, step)))
    self.unfinished.discard(step)

  def _after_batch(self) -> None:
    if self._seam is not None:
      self._seam()

  def _fault_seam(self, step: int) -> Any:
    """The drill's SIGKILL after the first scored batch of `step` (once per run dir), else None."""
    if os.environ.get(KILL_AT_STEP_ENV) != str(step):
      return None
    record = self.run_dir / "eval" / "faults_fired.json"
    if record.exists() and f"kill_during_eval_at_step={step}" in json.loads(record.read_text()):
      return None

    def kill() -> None:
      record.write_text(json.dumps([f"kill_during_eval_at_step={step}"]))
      os.kill(os.getpid(), signal.SIGKILL)

    return kill

  def loop(self, poll_s: float) -> int:
    while True:
      finished = run_finished(self.run_dir)  # read before listing: see the module docstring
      self.close_vanished()
      todo = self.pending()
      if todo:
        self.evaluate(todo[0])
      elif finished:
        self.events.close()
        return 0
      else:
        time.sleep(poll_s)  # polling a directory another process writes


def watch(run_dir: Path, names: Sequence[str], manager: Any, overrides: Sequence[str], batch_size: int,
          poll_s: float = 2.0) -> int:
  return Sidecar(run_dir, names, manager, overrides, batch_size).loop(poll_s)
