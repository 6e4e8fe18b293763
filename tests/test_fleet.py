"""Fleet resilience: stragglers, a hung process among several, coordinated preemption, distributed
start-up timeouts, lost-work accounting and the goodput picture.

The unit tests drive the protocols with an in-memory key-value store; the slow tests start real
processes (2 x 4 CPU devices joined by jax.distributed on localhost) under `maxtrain.launch
--processes 2`.
"""

import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from maxtrain.cli import launch
from maxtrain.monitor import events as ev
from maxtrain.monitor import goodput
from maxtrain.monitor.stragglers import find_stragglers
from maxtrain.runtime.preemption import StopRequest
from test_checkpoint import assert_bitwise_equal, restore_raw
from tiny import TINY_MODEL, cpu_env

REPO = Path(__file__).resolve().parent.parent


class FakeStore:
  """The coordination service's key-value store, in memory, shared by simulated processes."""

  def __init__(self):
    self.values: dict[str, str] = {}
    self.changed = threading.Condition()


class FakeKV:
  def __init__(self, store: FakeStore, process_index: int, process_count: int):
    self.store, self.process_index, self.process_count = store, process_index, process_count
    self.handlers = {}

  def set(self, key, value):
    with self.store.changed:
      self.store.values[key] = value
      self.store.changed.notify_all()

  def get(self, key, timeout_s):
    with self.store.changed:
      self.store.changed.wait_for(lambda: key in self.store.values, timeout=timeout_s)
      return self.store.values.get(key)

  def post_all(self, message, *, include_self=True):
    for kv in self.peers:
      if include_self or kv is not self:
        kind, _, payload = message.partition(":")
        kv.handlers[kind](payload)  # delivered at once: the notice thread's work, on this thread


def fake_fleet(n):
  store = FakeStore()
  kvs = [FakeKV(store, i, n) for i in range(n)]
  stops = []
  for kv in kvs:
    kv.peers = kvs
    stop = StopRequest(kv)
    kv.handlers["stop"] = stop.on_notice
    stops.append(stop)
  return stops


def test_stop_agreement_without_a_per_step_collective():
  # Process 0 is signalled after its step 5; process 1's loop has checked step 3 (its host lags),
  # process 2's step 6 (it runs ahead). Each proposes the step after its last check (the signalled one
  # its current step): all stop after step max(5, 4, 7) = 7, none has passed it.
  stops = fake_fleet(3)
  assert not stops[1].requested(3) and not stops[2].requested(6) and not stops[0].requested(4)
  stops[0].signal_name = "SIGTERM"
  assert not stops[0].requested(5)  # announces; its own proposal (5) is below the agreed step
  for stop in stops:
    assert stop._agreed.wait(10)
  assert [s._stop_step for s in stops] == [7, 7, 7]
  assert [s.requested(6) for s in stops] == [False, False, False]
  assert not stops[1].requested(4) and not stops[1].requested(5)
  assert [s.requested(7) for s in stops] == [True, True, True]
  assert stops[1].reason == "process 0's stop request" and stops[0].reason == "SIGTERM"


def test_single_process_stop_needs_no_store():
  stop = StopRequest(None)
  assert not stop.requested(1)
  stop.signal_name = "SIGINT"
  assert stop.requested(2) and stop.reason == "SIGINT"


def stats(dispatch, period):
  return {p: {"host": f"h{p}", "dispatch": times, "step_s": period} for p, times in dispatch.items()}


def test_stragglers_from_dispatch_times():
  # Five processes; 3 dispatches every step 0.3 s after the others; millisecond jitter elsewhere.
  dispatch = {p: {s: s * 1.0 + 0.001 * ((p * s) % 3) + (0.3 if p == 3 else 0.0) for s in range(10, 20)}
              for p in range(5)}
  found, scalars = find_stragglers(stats(dispatch, 1.0), threshold=0.2, min_s=0.01)
  assert [f["slow_process"] for f in found] == [3] and found[0]["host"] == "h3"
  assert found[0]["late_s"] == pytest.approx(0.3, abs=0.003) and found[0]["step_s"] == 1.0
  assert scalars["fleet/slowest_process"] == 3.0
  assert scalars["fleet/step_time_max_over_median"] == pytest.approx(1 / 0.7, rel=0.01)
  # One slow step (a hiccup) is not a straggler: the median over the interval ignores it.
  dispatch[3] = {s: t - 0.3 + (0.8 if s == 12 else 0.0) for s, t in dispatch[3].items()}
  found, scalars = find_stragglers(stats(dispatch, 1.0), threshold=0.2, min_s=0.01)
  assert found == [] and scalars["fleet/step_time_max_over_median"] < 1.01
  # Two processes: the lower median is the earlier one, so the late one's full delay counts.
  two = {0: {s: float(s) for s in range(4)}, 1: {s: s + 0.5 for s in range(4)}}
  found, _ = find_stragglers(stats(two, 1.0), threshold=0.2, min_s=0.01)
  assert [(f["slow_process"], round(f["late_s"], 6)) for f in found] == [(1, 0.5)]
  # Late by less than the threshold's share of the step, or than min_s: not flagged.
  assert find_stragglers(stats(two, 3.0), threshold=0.2, min_s=0.01)[0] == []
  assert find_stragglers(stats(two, 1.0), threshold=0.2, min_s=0.6)[0] == []


def rec(wall, kind, step=None, attempt=0, process=0, **fields):
  return {"wall": wall, "mono": wall, "process": process, "attempt": attempt, "step": step, "kind": kind, **fields}


def crash_and_hang_run():
  """Checkpoints and logs every 10 steps of 1 s; the trainer crashes after step 23 (resumes from 20) and
  hangs after step 74 (resumes from 70; watchdog timeout 5 s); 80 steps. The supervisor records a
  crash for both failed attempts, as it does."""
  sup, records, t = ev.SUPERVISOR, [], 0.0

  def attempt(a, resume, last, fail=None):
    nonlocal t
    records.append(rec(t, ev.RESTART, attempt=a, process=sup))
    records.append(rec(t + 1, ev.JOB_START, attempt=a))
    t += 5
    records.append(rec(t, ev.FIRST_STEP, resume + 1, attempt=a))
    step = resume + 1
    while step < last:
      n = min(10 - step % 10, last - step)
      t += n
      step += n
      records.append(rec(t, ev.STEPS, step, attempt=a, first=step - n + 1, count=n, seconds=float(n), data_wait_s=0.0))
    if fail == "crash":
      t += 3  # steps 21..23, never summarised
      records.append(rec(t, ev.CRASH, 23, attempt=a, code=1, reason="RuntimeError"))
      records.append(rec(t, ev.EXIT, 23, attempt=a, code=1))
    elif fail == "hang":
      t += 4 + 5  # steps 71..74, then 5 s without progress
      records.append(rec(t, ev.HANG, 74, attempt=a, idle_s=5.0))
      records.append(rec(t, ev.EXIT, 74, attempt=a, code=76))
    else:
      records.append(rec(t, ev.EXIT, last, attempt=a, code=0))
    if fail:
      records.append(rec(t + 0.5, ev.CRASH, attempt=a, process=sup, code=1 if fail == "crash" else 76))
      t += 1.5

  attempt(0, 0, 20, "crash")
  attempt(1, 20, 70, "hang")
  attempt(2, 70, 80)
  return records


def test_steps_after_the_last_summary_are_lost_progress_and_incidents_count_once():
  report = goodput.compute(crash_and_hang_run())
  assert report["steps"] == {"kept": 80, "computed": 87, "lost": 7, "last": 80}
  assert report["seconds"]["lost_progress"] == pytest.approx(3.0 + 4.0)
  assert report["seconds"]["hang"] == pytest.approx(5.0)
  assert report["seconds"]["other"] <= 0.01 * report["total_s"]
  assert report["events"]["crash"] == 1 and report["events"]["hang"] == 1 and report["events"]["restart"] == 3


def test_plot_draws_the_reports_intervals(tmp_path):
  records = crash_and_hang_run()
  data = goodput.timeline(records)
  (label, intervals), = data["rows"]
  drawn = {c: sum((e - s) * parts.get(c, 0.0) for s, e, parts in intervals) for c in goodput.CATEGORIES}
  assert drawn == pytest.approx(data["report"]["seconds"], abs=1e-9)
  path = tmp_path / ev.FILENAME
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  png = tmp_path / "goodput.png"
  result = subprocess.run([sys.executable, str(REPO / "tools" / "goodput_report.py"), str(tmp_path), "--plot", str(png)],
                          capture_output=True, text=True, cwd=REPO)
  assert result.returncode == 0, result.stderr
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 100_000


def test_attempt_code_of_several_processes():
  # Codes in the order the processes exited: the first failure is the cause.
  assert launch.attempt_code([0, 0]) == 0
  assert launch.attempt_code([75, 75]) == 75
  assert launch.attempt_code([76, -6]) == 76  # a hang; a peer aborted as the coordinator left
  assert launch.attempt_code([1, 76]) == 1  # a crash; the blocked peer's watchdog fired later
  assert launch.attempt_code([1, -9]) == 1  # a crash; the peer killed after the grace period
  assert launch.attempt_code([76, 2]) == 2  # a bad input is never restarted


def test_a_collective_failing_after_a_peers_watchdog_fired_ends_as_a_hang(tmp_path):
  # The peer's watchdog fired and left before its notice reached this process: the failed collective is
  # part of that hang (dump, hang event, exit 76), not a crash. Nobody fired: the error's own code.
  script = f"""
import sys
sys.path.insert(0, {str(REPO / 'tests')!r})
from pathlib import Path
from test_fleet import FakeKV, FakeStore
from maxtrain.monitor import events as ev
from maxtrain.monitor.watchdog import FIRED_KEY, Watchdog
out = Path({str(tmp_path)!r})
kv = FakeKV(FakeStore(), 1, 2)
with ev.EventLog(out / ev.FILENAME, 1) as events:
  dog = Watchdog(out, events, timeout_s=0, startup_timeout_s=0, kv=kv)
  print("crash code", dog.exit_code_for(RuntimeError("a bug")), flush=True)
  kv.set(FIRED_KEY, "0:5")
  dog.exit_code_for(RuntimeError("collective failed: peer gone"))
  print("returned", flush=True)
"""
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
  assert result.returncode == 76, result.stderr[-3000:]
  assert result.stdout.splitlines() == ["crash code 1"]
  hang = [r for r in ev.read_events(tmp_path / ev.FILENAME) if r["kind"] == ev.HANG]
  assert len(hang) == 1 and hang[0]["peer"] == "process 0 saw no progress after step 5"
  assert "Python stacks of all threads" in Path(hang[0]["dump"]).read_text()


def test_unanswering_coordinator_is_a_clear_restartable_error(tmp_path):
  # A socket that accepts connections and never answers: jax would wait, then abort with a bare
  # DEADLINE_EXCEEDED; the trainer names the address and the key within the configured timeout.
  with socket.socket() as listener:
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    env = cpu_env(1)
    t0 = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "maxtrain.train", f"--config.output_dir={tmp_path}",
                             "--config.runtime.num_processes=2", "--config.runtime.process_id=1",
                             f"--config.runtime.coordinator={address}", "--config.runtime.init_timeout_s=3"],
                            capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    elapsed = time.monotonic() - t0
  assert result.returncode == 1, result.stderr[-2000:]
  assert f"the coordinator at {address} (process 0) did not answer within config.runtime.init_timeout_s=3s" \
      in result.stderr
  assert elapsed < 3 + 30  # the timeout plus the interpreter's and jax's start on a busy machine


FLEET = TINY_MODEL + ["--config.eval.every_steps=0", "--config.mesh.fsdp=4", "--config.mesh.dcn_fsdp=2",
                      "--config.steps=8", "--config.log_every=2", "--config.runtime.shutdown_timeout_s=60"]
ENV4 = cpu_env(4)


def supervise(train_args, timeout=600) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "maxtrain.launch", "--processes=2", "--backoff=0.1", "--max-restarts=2",
                         "--peer-grace=60", "--", *train_args], capture_output=True, text=True, env=ENV4,
                        timeout=timeout, cwd=REPO)


def attempt_codes(stderr: str) -> list[str]:
  return [line.split("(processes, in exit order: ")[1].rstrip(")") for line in stderr.splitlines()
          if line.startswith("maxtrain.launch: attempt")]


@pytest.mark.slow
def test_two_processes_straggler_hang_and_preemption(store, tmp_path):
  """One undisturbed 2-process run, then the same run with process 1 slowed by 0.5 s per step, SIGTERM
  to process 0 alone after step 2 and process 1 hung after step 5: stragglers flagged, one stop step,
  both watchdogs fire, the launcher restarts both, and the final parameters are bitwise the same."""
  clean, faulty, timeout_s = tmp_path / "clean", tmp_path / "faulty", 8.0
  result = supervise(FLEET + [f"--config.data.path={store}", f"--config.output_dir={clean}",
                              "--config.checkpoint.every_steps=0"])
  assert result.returncode == 0 and attempt_codes(result.stderr) == ["0, 0"], result.stderr[-3000:]
  assert not [r for r in ev.read_events(clean / ev.FILENAME) if r["kind"] == ev.STRAGGLER]

  result = supervise(FLEET + [f"--config.data.path={store}", f"--config.output_dir={faulty}",
                              "--config.checkpoint.every_steps=2", f"--config.watchdog.timeout_s={timeout_s}",
                              "--config.faults.process=1", "--config.faults.slow_step_s=0.5",
                              "--config.faults.hang_at_step=5", "--config.faults.sigterm_process=0",
                              "--config.faults.sigterm_at_step=2"])
  assert result.returncode == 0, result.stderr[-3000:]
  # The hang's attempt is a hang (76) whichever way its processes end: process 0, which hosts the coordinator,
  # leaves once process 1 has recorded leaving, and jax may abort process 1 (-6) in the moment between that
  # record and its own exit 76 (launch.attempt_code reads both as 76; seen on a loaded machine).
  assert re.findall(r"attempt \d+: exit (\d+)", result.stderr) == ["75", "76", "0"], result.stderr[-3000:]
  codes = attempt_codes(result.stderr)
  assert codes[0] == "75, 75" and codes[1] in ("76, 76", "76, -6") and codes[2] == "0, 0", result.stderr[-3000:]
  records = ev.read_events(faulty / ev.FILENAME)

  # Stragglers: process 1, flagged at the first log step (step 2: its interval times step 2, after the
  # compile step), within two log intervals; 0.5 s late per step.
  stragglers = [r for r in records if r["kind"] == ev.STRAGGLER]
  assert stragglers and {r["slow_process"] for r in stragglers} == {1}
  assert (stragglers[0]["attempt"], stragglers[0]["step"]) == (0, 2)
  assert 0.4 < stragglers[0]["late_s"] < 0.6  # a one-step interval (later ones mix in steps after a save)
  scalars = EventAccumulator(str(faulty / "tensorboard"))
  scalars.Reload()
  assert {e.value for e in scalars.Scalars("fleet/slowest_process")} == {1.0}
  # With two processes the median is their mean: (t + 0.5) / (t + 0.25) for a fast step time t, so 1.2 at t = 1 s
  # and less on a slower (loaded) machine. The 0.5 s itself is checked by late_s above.
  assert min(e.value for e in scalars.Scalars("fleet/step_time_max_over_median")) > 1.0

  # Preemption: both processes saved the same step, and the next attempt resumed from it.
  stops = {r["process"]: r["step"] for r in records if r["kind"] == ev.PREEMPTION}
  assert set(stops) == {0, 1} and stops[0] == stops[1] >= 2
  assert [r["step"] for r in records if r["kind"] == ev.RESTORE and r["attempt"] == 1 and r["process"] == 0] == [stops[0]]

  # Hang: both watchdogs fired and left a dump, within the timeout + 20 s of process 1's last step.
  hangs = {r["process"]: r for r in records if r["kind"] == ev.HANG and r["attempt"] == 1}
  assert set(hangs) == {0, 1}
  hung_at = max(r["wall"] for r in records if r["attempt"] == 1 and r["process"] == 1 and r["kind"] == ev.STEPS)
  for r in hangs.values():
    assert "Python stacks of all threads" in Path(r["dump"]).read_text()
    assert r["wall"] - hung_at < timeout_s + 20
  assert "faults.py" in Path(hangs[1]["dump"]).read_text()  # where process 1 hangs

  assert_bitwise_equal(restore_raw(faulty / "checkpoints", 8), restore_raw(clean / "checkpoints", 8))
  report = goodput.compute(records)
  assert report["events"]["hang"] == 1 and report["events"]["preemption"] == 1 and "crash" not in report["events"]
  assert [s["process"] for s in report["stragglers"]] == [1]

  # The example picture in docs/fleet.md (docs/goodput_fleet.png) is this run's timeline: a row per process
  # under the job's, the job's row drawing the report's seconds, a dashed line per supervisor start.
  data = goodput.timeline(records)
  assert [label for label, _ in data["rows"]] == ["job", "process 0", "process 1"] and len(data["restarts"]) == 3
  drawn = {c: sum((e - s) * parts.get(c, 0.0) for s, e, parts in data["rows"][0][1]) for c in goodput.CATEGORIES}
  assert drawn == pytest.approx(report["seconds"], abs=1e-6)
  png = tmp_path / "goodput.png"
  result = subprocess.run([sys.executable, str(REPO / "tools" / "goodput_report.py"), str(faulty), "--plot", str(png)],
                          capture_output=True, text=True, cwd=REPO)
  assert result.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", result.stderr


def test_grafana_dashboard_uses_the_exporters_metrics_and_labels():
  import re

  from maxtrain.monitor.prometheus import metric_name

  dashboard = json.loads((REPO / "tools" / "grafana_dashboard.json").read_text())
  exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
  exported = {metric_name(n) for n in ("train/loss", "train/tokens_per_s", "train/step_time_s", "train/mfu",
                                       "train/data_wait_s", "fleet/step_time_max_over_median",
                                       "fleet/slowest_process", "memory/host_in_use_gib", "memory/device_in_use_gib")}
  exported.add("maxtrain_last_update_seconds")
  for expr in exprs:
    assert set(re.findall(r"maxtrain_\w+", expr)) <= exported, expr
    assert {m for m in re.findall(r"(\w+)=~?\"", expr)} <= {"run", "process"}, expr  # the exporter's labels only
