"""Event log and goodput report: hand-written event logs with answers worked out by hand.

Times are wall seconds. In each log the comment beside a record says what the time it covers is.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from maxtrain.errors import UserError

from maxtrain.monitor import events as ev
from maxtrain.monitor import goodput

REPO = Path(__file__).resolve().parent.parent


def rec(wall, kind, step=None, attempt=0, process=0, **fields):
  return {"wall": wall, "mono": wall + 1e6 * attempt, "process": process, "attempt": attempt, "step": step,
          "kind": kind, **fields}


def write_log(path: Path, records) -> Path:
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


def check(report, total, **seconds):
  """Every category not named must be zero; all must sum to the total."""
  assert report["total_s"] == pytest.approx(total)
  expected = {name: seconds.get(name, 0.0) for name in goodput.CATEGORIES}
  assert report["seconds"] == pytest.approx(expected, abs=1e-9)
  assert sum(report["seconds"].values()) == pytest.approx(total)


def clean_run(process=0):
  return [
      rec(100, ev.JOB_START, process=process, hosts=1, devices=8, config_hash="abc"),
      rec(101, ev.COMPILE_START, process=process),
      rec(110, ev.COMPILE_END, process=process, seconds=9.0),
      rec(112, ev.FIRST_STEP, 1, process=process),  # 100..112 start-up
      rec(121, ev.STEPS, 10, process=process, first=2, count=9, seconds=9.0, data_wait_s=0.9),  # 112..121
      rec(121, ev.CHECKPOINT_SAVE_START, 10, process=process),
      rec(125, ev.CHECKPOINT_SAVE_END, 10, process=process, blocking_s=1.0, save_s=4.0),  # 121..122 blocked
      rec(134, ev.STEPS, 20, process=process, first=11, count=10, seconds=12.0, data_wait_s=1.0,
          step_times=[1.0] * 9 + [3.0]),  # 122..134
      rec(136, ev.EVAL, 20, process=process, seconds=2.0, loss=2.5),  # 134..136
      rec(136.5, ev.EXIT, 20, process=process, code=0),  # 136..136.5 other
  ]


@pytest.mark.parametrize("num_processes", [1, 2])
def test_clean_run(num_processes):
  # A second process reporting the same intervals must not count anything twice.
  records = [r for p in range(num_processes) for r in clean_run(p)]
  report = goodput.compute(records)
  check(report, 36.5, productive=8.1 + 11.0, startup_compile=12.0, data_wait=1.9, checkpoint=1.0, eval=2.0,
        other=0.5)
  assert report["goodput"] == pytest.approx(19.1 / 36.5)
  assert report["steps"] == {"kept": 20, "computed": 20, "lost": 0, "last": 20}
  # Samples: 9 steps at the interval mean 1.0 s, then 9 x 1.0 s and one 3.0 s straggler.
  assert report["step_time_s"] == {"p50": 1.0, "p90": 1.0, "p99": 3.0, "max": 3.0}
  assert report["processes"] == num_processes and report["attempts"] == 1


def test_restart_with_downtime_loses_steps_past_the_checkpoint():
  sup = ev.SUPERVISOR
  records = [
      rec(0, ev.JOB_START),
      rec(10, ev.FIRST_STEP, 1),  # 0..10 start-up
      rec(19, ev.STEPS, 10, first=2, count=9, seconds=9.0, data_wait_s=0.0),  # 10..19 kept
      rec(19, ev.CHECKPOINT_SAVE_START, 10),
      rec(20, ev.CHECKPOINT_SAVE_END, 10, blocking_s=1.0, save_s=1.0),  # 19..20
      rec(30, ev.STEPS, 20, first=11, count=10, seconds=10.0, data_wait_s=0.0),  # 20..30 lost
      rec(35, ev.STEPS, 25, first=21, count=5, seconds=5.0, data_wait_s=0.0),  # 30..35 lost
      rec(40, ev.CRASH, attempt=0, process=sup, code=-9),  # 35..40: unrecorded steps 26.., other
      rec(50, ev.RESTART, attempt=1, process=sup, backoff_s=10.0),  # 40..50 downtime
      rec(52, ev.JOB_START, attempt=1),
      rec(55, ev.RESTORE, 10, attempt=1, seconds=2.0),
      rec(60, ev.FIRST_STEP, 11, attempt=1),  # 50..60 start-up
      rec(69, ev.STEPS, 20, attempt=1, first=12, count=9, seconds=9.0, data_wait_s=0.0),  # 60..69
      rec(79, ev.STEPS, 30, attempt=1, first=21, count=10, seconds=10.0, data_wait_s=0.0),  # 69..79
      rec(80, ev.EXIT, 30, attempt=1, code=0),  # 79..80 other
  ]
  report = goodput.compute(records)
  check(report, 80.0, productive=9.0 + 9.0 + 10.0, startup_compile=20.0, checkpoint=1.0, lost_progress=15.0,
        downtime=10.0, other=6.0)
  assert report["steps"] == {"kept": 30, "computed": 45, "lost": 15, "last": 30}
  assert report["attempts"] == 2 and report["events"]["crash"] == 1 and report["events"]["restart"] == 1


def test_overlapping_attempts_are_not_double_counted():
  # Attempt 1 starts at 25 while attempt 0 still runs (a zombie) until 35. Per-attempt spans sum to 51 s.
  records = [
      rec(0, ev.JOB_START),
      rec(10, ev.FIRST_STEP, 1),  # 0..10 start-up
      rec(20, ev.STEPS, 10, first=2, count=9, seconds=10.0, data_wait_s=0.0),  # 10..20 kept
      rec(30, ev.STEPS, 20, first=11, count=10, seconds=10.0, data_wait_s=0.0),  # 20..30 lost (redone below)
      rec(35, ev.EXIT, 20, code=76),
      rec(25, ev.RESTART, attempt=1, process=ev.SUPERVISOR),
      rec(28, ev.RESTORE, 10, attempt=1),
      rec(32, ev.FIRST_STEP, 11, attempt=1),  # 25..32 start-up, but 25..30 is already attempt 0's lost step time
      rec(41, ev.STEPS, 20, attempt=1, first=12, count=9, seconds=9.0, data_wait_s=0.0),  # 32..41 kept
      rec(41, ev.EXIT, 20, attempt=1, code=0),
  ]
  report = goodput.compute(records)
  check(report, 41.0, productive=10.0 + 9.0, startup_compile=10.0 + 2.0, lost_progress=10.0)
  assert report["steps"]["lost"] == 10 and report["steps"]["kept"] == 20


def test_rollback_loses_the_steps_past_its_target():
  records = [
      rec(0, ev.JOB_START),
      rec(10, ev.FIRST_STEP, 1),  # 0..10 start-up
      rec(20, ev.STEPS, 10, first=2, count=9, seconds=10.0, data_wait_s=0.0),  # 10..20 kept
      rec(30, ev.STEPS, 20, first=11, count=10, seconds=10.0, data_wait_s=0.0),  # 20..30 lost
      rec(30, ev.SPIKE, 20, loss=9.0, threshold=4.0),
      rec(32, ev.ROLLBACK, 10, from_step=20, to_step=10, seconds=2.0),  # 30..32 lost (restore)
      rec(42, ev.STEPS, 20, first=11, count=10, seconds=10.0, data_wait_s=0.0),  # 32..42 kept
      rec(43, ev.EXIT, 20, code=0),  # 42..43 other
  ]
  report = goodput.compute(records)
  check(report, 43.0, productive=20.0, startup_compile=10.0, lost_progress=12.0, other=1.0)
  assert report["steps"] == {"kept": 20, "computed": 30, "lost": 10, "last": 20}
  assert report["events"]["rollback"] == 1 and report["events"]["spike"] == 1


def test_partial_interval_loss_is_split_by_step_times():
  # Resuming from step 15 loses steps 16..20 of an interval; with step_times the split is by their times.
  records = [
      rec(0, ev.JOB_START),
      rec(10, ev.FIRST_STEP, 10),  # 0..10 start-up
      rec(30, ev.STEPS, 20, first=11, count=10, seconds=20.0, data_wait_s=0.0,
          step_times=[1.0] * 5 + [3.0] * 5),  # 10..30: 5 s kept, 15 s lost
      rec(31, ev.EXIT, 20, code=1),
      rec(32, ev.JOB_START, attempt=1),
      rec(33, ev.RESTORE, 15, attempt=1),
      rec(35, ev.FIRST_STEP, 16, attempt=1),  # 32..35 start-up
      rec(35, ev.EXIT, 16, attempt=1, code=0),
  ]
  report = goodput.compute(records)
  check(report, 35.0, productive=5.0, startup_compile=13.0, lost_progress=15.0, other=1.0, downtime=1.0)
  assert report["steps"]["lost"] == 5 and report["steps"]["last"] == 16


def test_teardown_after_the_trainers_own_crash_record_is_downtime():
  records = [
      rec(0, ev.JOB_START),
      rec(10, ev.FIRST_STEP, 10),  # 0..10 start-up
      rec(20, ev.STEPS, 20, first=11, count=10, seconds=10.0, data_wait_s=0.0),  # 10..20 lost (resume from 10)
      rec(21, ev.CRASH, 20, code=1, reason="RuntimeError"),  # 20..21 other: after the last record of progress
      rec(24, ev.EXIT, 20, code=1),  # 21..24: the dead trainer closing files: downtime
      rec(25, ev.JOB_START, attempt=1),
      rec(26, ev.RESTORE, 10, attempt=1),
      rec(30, ev.FIRST_STEP, 11, attempt=1),  # 25..30 start-up; 24..25 downtime
      rec(30, ev.EXIT, 11, attempt=1, code=0),
  ]
  report = goodput.compute(records)
  check(report, 30.0, startup_compile=15.0, lost_progress=10.0, other=1.0, downtime=4.0)


@pytest.mark.parametrize("idle_s,hang,other", [(None, 60.0, 1.0), (50.0, 50.0, 11.0)])
def test_hang_then_fresh_restart(idle_s, hang, other):
  records = [
      rec(0, ev.JOB_START),
      rec(5, ev.FIRST_STEP, 1),  # 0..5 start-up
      rec(15, ev.STEPS, 10, first=2, count=9, seconds=10.0, data_wait_s=0.0),  # 5..15 lost
      rec(75, ev.HANG, 10, **({} if idle_s is None else {"idle_s": idle_s})),  # from the last step (or idle_s)
      rec(76, ev.EXIT, 10, code=76),
      rec(80, ev.RESTART, attempt=1, process=ev.SUPERVISOR),  # 76..80 downtime
      rec(81, ev.JOB_START, attempt=1),
      rec(90, ev.FIRST_STEP, 1, attempt=1),  # no checkpoint: starts over; 80..90 start-up
      rec(100, ev.STEPS, 10, attempt=1, first=2, count=9, seconds=10.0, data_wait_s=0.0),  # 90..100 kept
  ]
  report = goodput.compute(records)
  check(report, 100.0, productive=10.0, startup_compile=15.0, lost_progress=10.0, hang=hang, downtime=4.0,
        other=other)
  assert report["steps"] == {"kept": 10, "computed": 20, "lost": 10, "last": 10}


def test_truncated_last_line_and_fragment_mid_file(tmp_path):
  path = write_log(tmp_path / "events.jsonl", clean_run())
  lines = path.read_text().splitlines(keepends=True)
  # A writer killed mid-record leaves a fragment; the next writer's record continues the same line.
  lines[3] = lines[3][:20] + lines[3]
  path.write_text("".join(lines) + '{"wall": 137, "mono": 5, "kind": "ex')  # crash mid-write
  records = ev.read_events(path)
  assert [r["kind"] for r in records] == [r["kind"] for r in clean_run()]
  check(goodput.compute(records), 36.5, productive=19.1, startup_compile=12.0, data_wait=1.9, checkpoint=1.0,
        eval=2.0, other=0.5)


def test_event_log_records_and_attempt(tmp_path, monkeypatch):
  monkeypatch.setenv(ev.ATTEMPT_ENV, "3")
  assert ev.current_attempt() == 3
  with ev.EventLog(tmp_path / "run" / ev.FILENAME, process_index=1) as log:
    log.emit(ev.JOB_START, hosts=1, devices=8, config_hash=ev.config_hash({"b": 1, "a": [1, 2]}))
    log.emit(ev.EXIT, 7, code=0)
    with pytest.raises(ValueError, match="reserved"):
      log.emit(ev.STEPS, 1, wall=0.0)
  first, last = ev.read_events(tmp_path / "run" / ev.FILENAME)
  assert first["kind"] == ev.JOB_START and first["step"] is None and first["attempt"] == 3
  assert first["process"] == 1 and first["config_hash"] == ev.config_hash({"a": [1, 2], "b": 1})
  assert last["step"] == 7 and last["code"] == 0 and last["wall"] >= first["wall"] and last["mono"] >= first["mono"]
  assert ev.config_hash({"a": 1}) != ev.config_hash({"a": 2})
  monkeypatch.setenv(ev.ATTEMPT_ENV, "x")
  with pytest.raises(UserError, match="MAXTRAIN_ATTEMPT"):  # exit 2 in the trainer, not a traceback
    ev.current_attempt()


def test_concurrent_writers_never_interleave(tmp_path):
  # Records larger than PIPE_BUF (4 KiB), from 4 processes at once: every line must parse.
  path = tmp_path / ev.FILENAME
  script = ("import sys; from maxtrain.monitor.events import EventLog\n"
            "log = EventLog(sys.argv[1], process_index=int(sys.argv[2]))\n"
            "for i in range(300): log.emit('steps', i, pad='x' * 6000)\n")
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  procs = [subprocess.Popen([sys.executable, "-c", script, str(path), str(p)], env=env) for p in range(4)]
  assert [p.wait() for p in procs] == [0] * 4
  lines = path.read_bytes().splitlines()
  assert len(lines) == 1200
  records = [json.loads(line) for line in lines]
  for p in range(4):
    assert [r["step"] for r in records if r["process"] == p] == list(range(300))


def test_cli_table_and_json(tmp_path):
  write_log(tmp_path / ev.FILENAME, clean_run())
  tool = [sys.executable, str(REPO / "tools" / "goodput_report.py"), str(tmp_path)]
  table = subprocess.run(tool, capture_output=True, text=True, check=True).stdout
  assert "goodput 52.3%" in table and "startup_compile" in table and "p99 3.0000" in table
  report = json.loads(subprocess.run(tool + ["--json"], capture_output=True, text=True, check=True).stdout)
  assert report["goodput"] == pytest.approx(19.1 / 36.5)
  missing = subprocess.run(tool[:2] + [str(tmp_path / "nope")], capture_output=True, text=True)
  assert missing.returncode == 2 and "no event log" in missing.stderr


class FakeClock:
  """Stands in for the `time` module inside maxtrain.monitor.events: simulated work advances it."""

  def __init__(self):
    self.now = 1_000.0

  def time(self):
    return self.now

  def monotonic(self):
    return self.now - 900.0

  def advance(self, seconds):
    self.now += seconds


def test_simulated_run_with_crash_and_rollback(tmp_path, monkeypatch):
  """The loop as the trainer should drive EventLog + StepsSummary, on a simulated clock: steps of 1 s
  (0.1 s of it waiting for data), a summary every 5 steps, a 0.5 s blocking checkpoint every 10; a
  crash at step 23 (restart from the checkpoint at 20) and a loss spike at 33 (rollback to 30)."""
  clock = FakeClock()
  monkeypatch.setattr(ev, "time", clock)
  path = tmp_path / ev.FILENAME
  supervisor = ev.EventLog(path, ev.SUPERVISOR, attempt=0)

  def run_attempt(attempt, resume_step, crash_at=None, spike_at=None, last=40):
    log = ev.EventLog(path, 0, attempt=attempt)
    clock.advance(1.0)
    log.emit(ev.JOB_START, hosts=1, devices=8, config_hash="c0ffee")
    if resume_step:
      clock.advance(2.0)
      log.emit(ev.RESTORE, resume_step, seconds=2.0)
    else:
      clock.advance(3.0)
    log.emit(ev.COMPILE_START)
    clock.advance(5.0)
    log.emit(ev.COMPILE_END, seconds=5.0)
    clock.advance(1.0)
    step = resume_step + 1
    log.emit(ev.FIRST_STEP, step)
    summary = ev.StepsSummary(log, step)
    while step < last:
      clock.advance(0.1)
      summary.add_data_wait(0.1)
      clock.advance(0.9)
      step += 1
      if step == crash_at:
        return  # The process dies: nothing more from it.
      if step == spike_at:
        with summary.outside(step):
          log.emit(ev.SPIKE, step, loss=9.0, threshold=4.0)
          clock.advance(1.0)
          log.emit(ev.ROLLBACK, 30, from_step=step, to_step=30, seconds=1.0)
        step, spike_at = 30, None
        summary.reset(step)
        continue
      if step % 5 == 0:
        summary.flush(step)
      if step % 10 == 0:
        with summary.outside(step):
          log.emit(ev.CHECKPOINT_SAVE_START, step)
          clock.advance(0.5)
          log.emit(ev.CHECKPOINT_SAVE_END, step, blocking_s=0.5, save_s=0.5)
    log.emit(ev.EXIT, step, code=0)

  supervisor.emit(ev.RESTART, reason="start")
  run_attempt(0, 0, crash_at=23)
  clock.advance(2.0)
  supervisor.emit(ev.CRASH, code=-11)
  clock.advance(5.0)
  supervisor.attempt = 1
  supervisor.emit(ev.RESTART, reason="crash", backoff_s=5.0)
  run_attempt(1, 20, spike_at=33)

  report = goodput.compute(ev.read_events(path))
  # Hand count: start-up 10 + 9; downtime 35..40; 4 checkpoints x 0.5; data wait 0.1 x (19 + 22) recorded
  # steps; lost: steps 31..33 (3 x 0.9) + the rollback's 1 s restore; other: steps 21..23, never summarised
  # before the crash, and the 2 s until the supervisor saw it; kept: 19 + 9 + 10 steps x 0.9.
  check(report, 73.0, productive=34.2, startup_compile=19.0, downtime=5.0, checkpoint=2.0, data_wait=4.1,
        lost_progress=3.7, other=5.0)
  assert report["goodput"] == pytest.approx(34.2 / 73.0)
  assert report["steps"] == {"kept": 40, "computed": 43, "lost": 3, "last": 40}
  assert report["events"] == {"spike": 1, "rollback": 1, "crash": 1, "restart": 2, "checkpoint_save_end": 4}
  assert report["step_time_s"]["p50"] == pytest.approx(1.0) and report["step_time_s"]["max"] == pytest.approx(1.0)
