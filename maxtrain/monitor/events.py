"""The run's event log: `<output_dir>/events.jsonl`, one JSON object per line, append-only.

Every attempt (restart) of a run and the supervisor that restarts it append to the same file; the
goodput report (`maxtrain.monitor.goodput`, `tools/goodput_report.py`) reads it back. No jax import
here: the supervisor and the report must not pay for it.

Each record holds `wall` (time.time()), `mono` (time.monotonic()), `process` (JAX process index;
`SUPERVISOR` for the supervisor), `attempt`, `step` (optimizer steps completed, or null) and `kind`,
then the kind's fields. Monotonic clocks are per process and per boot: compare `mono` only between
records of one process in one attempt; spans across processes or attempts use `wall`.

Concurrency: the file is opened O_APPEND and every record is one `os.write` of a whole line, so
writers on a local filesystem never interleave partial lines (not guaranteed on NFS). There is no
user-space buffer: a record is in the page cache, visible to readers and safe from a process crash,
when `emit` returns; critical kinds are also fsynced to survive a machine crash.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping

from maxtrain.errors import UserError

ATTEMPT_ENV = "MAXTRAIN_ATTEMPT"  # Set by a supervisor to the restart count (0 for the first launch).
SUPERVISOR = -1  # `process` of records written by the supervisor rather than a JAX process.
FILENAME = "events.jsonl"

# Event kinds and their fields (beyond the common ones). `step` = optimizer steps completed.
JOB_START = "job_start"  # An attempt's trainer process started: hosts, devices, device_kind, config_hash.
COMPILE_START = "compile_start"  # Compilation of the train step begins.
COMPILE_END = "compile_end"  # Compilation done: seconds.
FIRST_STEP = "first_step"  # The attempt's first step finished (blocked on); step = its number.
STEPS = "steps"  # Summary of steps first..step: first, count, seconds, data_wait_s[, step_times] (see below).
EVAL = "eval"  # An evaluation finished: seconds (its duration), loss.
CHECKPOINT_SAVE_START = "checkpoint_save_start"  # A checkpoint save of `step` was requested.
CHECKPOINT_BLOCKED = "checkpoint_blocked"  # The loop resumed after a save's blocking part: blocking_s.
CHECKPOINT_SAVE_END = "checkpoint_save_end"  # That save is complete: tier, blocking_s (loop blocked), save_s (total), bytes, per-phase *_s.
RESTORE = "restore"  # State restored from the checkpoint of `step`: seconds, tier (local | durable), reason, verify_s, read_s.
CHECKPOINT_CORRUPT = "checkpoint_corrupt"  # The checkpoint of `step` failed verification: file, reason, moved_to (tier: local for the local tier's).
CHECKPOINT_BRANCH = "checkpoint_branch"  # checkpoint.branch: resumed `step`; newer_steps moved aside to moved_to; tier.
CHECKPOINT_ABANDONED = "checkpoint_abandoned"  # A restore to `step` abandoned newer steps: durable_steps moved aside to moved_to, local_steps deleted, reason.
CHECKPOINT_PREEMPTION = "checkpoint_preemption"  # Which tiers a stop request saves: remaining_s (of the grace period), cost_s per tier, tiers, skipped, why.
CHECKPOINT_CADENCE = "checkpoint_cadence"  # A tier's next save decided: tier, mode, interval_s, interval_steps, next_step, step_time_s[, cost_s, mtbf_s, failures, span_s], why.
CHECKPOINT_UPLOAD = "checkpoint_upload"  # A durable step is in object storage: bytes, seconds, bytes_per_s.
CHECKPOINT_BEHIND = "checkpoint_behind"  # The durable tier lags: pending (saves waiting for upload), max_durable_lag.
NAN_SKIP = "nan_skip"  # Steps whose update the in-graph guard skipped: count (in the last interval).
SPIKE = "spike"  # Loss spike detected at `step`: loss, threshold.
ROLLBACK = "rollback"  # Rolled back: from_step, to_step (step = to_step); seconds (to restore).
HANG = "hang"  # Watchdog fired: idle_s (seconds since the last completed step), dump[, peer: who hung first].
ROUTING_COLLAPSE = "routing_collapse"  # A MoE layer's load entropy stayed low: layer, load_entropy, threshold, since_step.
STRAGGLER = "straggler"  # Process 0 found a slow process: slow_process, host, own_s, median_s, slower_by_s, ratio.
PREEMPTION = "preemption"  # Asked to stop (SIGTERM / maintenance notice); a checkpoint follows.
CRASH = "crash"  # An attempt died: code, reason (written by the supervisor or an excepthook).
RESTART = "restart"  # Supervisor launches a new attempt (its `attempt`); backoff_s, reason.
EXIT = "exit"  # A process is exiting: code (see DESIGN.md exit codes).
DATA_REPEAT = "data_repeat"  # A source was read past data.max_epochs: source, epochs, max_epochs.
MODEL_CHANGE = "resume_model_change"  # Resumed under config.model keys that change the model's function (checkpoint.resume_new_model): changes.
DATA_CHANGE = "data_change"  # Resumed on other post-training data (post.resume_new_data): change.

KINDS = (JOB_START, COMPILE_START, COMPILE_END, FIRST_STEP, STEPS, EVAL, CHECKPOINT_SAVE_START, CHECKPOINT_BLOCKED,
         CHECKPOINT_SAVE_END, RESTORE, CHECKPOINT_CORRUPT,
         CHECKPOINT_BRANCH, CHECKPOINT_ABANDONED, CHECKPOINT_PREEMPTION,
         CHECKPOINT_CADENCE, CHECKPOINT_UPLOAD, CHECKPOINT_BEHIND, NAN_SKIP, SPIKE, ROLLBACK, HANG, ROUTING_COLLAPSE, STRAGGLER, PREEMPTION, CRASH,
         RESTART, EXIT)
# Worth an fsync: the last words of an attempt, which the goodput report needs to place downtime.
CRITICAL = frozenset({HANG, PREEMPTION, CRASH, EXIT})
_COMMON = ("wall", "mono", "process", "attempt", "step", "kind")

# The `steps` record. Per-step host times would need a device sync every step, which the loop avoids
# (async dispatch), so a summary covers the interval between two log points:
#   step        last step of the interval        first        first step of the interval
#   count       step - first + 1                  seconds      wall seconds of the interval, excluding
#   data_wait_s seconds spent waiting for input                eval and checkpoint blocking
#   step_times  optional list of per-step seconds (only when the trainer measured them)
# The interval ends at the record's `wall`. Step-time percentiles use `step_times` when present,
# else the interval mean (`seconds / count`) for each of its steps: exact with log_every=1, smoothed
# otherwise (a straggler step shows as a slow interval). `StepsSummary` below keeps these fields.


def current_attempt() -> int:
  """The attempt number from $MAXTRAIN_ATTEMPT (set by the supervisor); 0 when unset."""
  text = os.environ.get(ATTEMPT_ENV, "").strip()
  if not text:
    return 0
  try:
    attempt = int(text)
    if attempt < 0:
      raise ValueError
    return attempt
  except ValueError:
    raise UserError(f"${ATTEMPT_ENV}={text!r}: expected a non-negative integer (the restart count, set by a "
                    "supervisor); unset it or set a number") from None


def config_hash(cfg_dict: Mapping[str, Any]) -> str:
  """Short stable hash of a config dict (key order does not matter): tells attempts of one run apart
  from a run restarted with a changed config."""
  text = json.dumps(cfg_dict, sort_keys=True, default=str, separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def _jsonable(value: Any) -> Any:
  # numpy / jax scalars and arrays from the metrics dict.
  if hasattr(value, "tolist"):
    return value.tolist()
  return str(value)


class EventLog:
  """Appends records to `path`. Cheap to construct; one per process. Not thread-safe for `close`."""

  def __init__(self, path: str | os.PathLike, process_index: int = 0, attempt: int | None = None):
    self.path = Path(path)
    self.process_index = process_index
    self.attempt = current_attempt() if attempt is None else attempt
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

  def emit(self, kind: str, step: int | None = None, **fields: Any) -> dict:
    """Appends one record and returns it. Unknown kinds are allowed (new emitters need no change here)."""
    clash = set(fields) & set(_COMMON)
    if clash:
      raise ValueError(f"event fields {sorted(clash)} are reserved")
    if self._fd is None:
      raise ValueError(f"event log {self.path} is closed")
    record = {"wall": time.time(), "mono": time.monotonic(), "process": self.process_index,
              "attempt": self.attempt, "step": None if step is None else int(step), "kind": kind, **fields}
    data = (json.dumps(record, default=_jsonable) + "\n").encode()
    written = os.write(self._fd, data)
    while written < len(data):  # Only on a full disk or a signal; the reader skips a broken line.
      written += os.write(self._fd, data[written:])
    if kind in CRITICAL:
      os.fsync(self._fd)
    return record

  def close(self) -> None:
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None

  def __enter__(self) -> "EventLog":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def read_events(path: str | os.PathLike) -> list[dict]:
  """All records of an event log in file order. A line cut short by a crash mid-write is skipped
  (and a record appended after it on the same line is recovered); other broken lines warn."""
  records, broken = [], 0
  lines = Path(path).read_bytes().split(b"\n")
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      records.append(json.loads(line))
      continue
    except ValueError:
      pass
    # A writer that died mid-line leaves a fragment; the next writer's record follows on the same line.
    start = line.rfind(b'{"wall"')
    if start > 0:
      try:
        records.append(json.loads(line[start:]))
        continue
      except ValueError:
        pass
    if i < len(lines) - 1:  # The final fragment (no newline yet) is the expected crash case.
      broken += 1
  if broken:
    warnings.warn(f"{path}: skipped {broken} unreadable line(s)", stacklevel=2)
  return records


class StepsSummary:
  """Builds the `steps` records of a training loop so that intervals never overlap other timed work.

      summary = StepsSummary(log, step)      # after the attempt's first step (its `first_step` event)
      ... summary.add_data_wait(seconds)     # each step: time blocked on the input pipeline
      summary.flush(step)                    # at each log point: one record for the steps since the last
      with summary.outside(step): evaluate() # eval / checkpoint / rollback: flushed before, not counted

  Wall time between the end of one interval and the start of the next (the `outside` blocks) is left
  to its own events or to the report's `other`; log before `flush` (`pending` gives the open
  interval's figures) so that logging time stays inside an interval.
  """

  def __init__(self, log: EventLog, step: int):
    self.log = log
    self.reset(step)

  def reset(self, step: int) -> None:
    """Starts a new interval now; `step` = steps completed so far."""
    self.first = step + 1
    self.data_wait_s = 0.0
    self._t0 = time.monotonic()

  def add_data_wait(self, seconds: float) -> None:
    self.data_wait_s += seconds

  def pending(self, step: int) -> tuple[float, int, float] | None:
    """(seconds, steps, data_wait_s) of the open interval up to now, or None if no step ran in it."""
    if step < self.first:
      return None
    seconds = time.monotonic() - self._t0
    return seconds, step - self.first + 1, min(self.data_wait_s, seconds)

  def flush(self, step: int, **fields: Any) -> dict | None:
    """Emits the record for steps first..step (None if no step ran) and starts the next interval."""
    record = None
    if step >= self.first:
      seconds = time.monotonic() - self._t0
      record = self.log.emit(STEPS, step, first=self.first, count=step - self.first + 1, seconds=seconds,
                             data_wait_s=min(self.data_wait_s, seconds), **fields)
    self.reset(step)
    return record

  @contextlib.contextmanager
  def outside(self, step: int) -> Iterator[None]:
    """Time inside is not step time: the open interval is flushed first and a new one starts after."""
    self.flush(step)
    try:
      yield
    finally:
      self.reset(step)
