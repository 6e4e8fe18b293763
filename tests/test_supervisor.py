"""The supervisor and the watchdog, end to end with injected faults: real processes, real signals."""

import subprocess
import sys
from pathlib import Path

import pytest

from maxtrain.monitor import goodput
from maxtrain.monitor.events import read_events
from tiny import TINY_MODEL, cpu_env

REPO = Path(__file__).resolve().parent.parent
TINY = TINY_MODEL + ["--config.eval.every_steps=0", "--config.log_every=1", "--config.mesh.fsdp=1"]
ENV = cpu_env(1)


def launch(launcher_args, train_args, env=ENV, timeout=600) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "maxtrain.launch", *launcher_args, "--", *train_args],
                        capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


@pytest.mark.slow
def test_crash_hang_rollback_and_preemption_are_recovered(store, tmp_path):
  timeout_s = 4.0
  train_args = TINY + [f"--config.data.path={store}", f"--config.output_dir={tmp_path}", "--config.steps=10",
                       "--config.checkpoint.every_steps=2", f"--config.watchdog.timeout_s={timeout_s}",
                       "--config.faults.crash_at_step=3", "--config.faults.hang_at_step=5",
                       "--config.faults.nan_at_step=6", "--config.guards.max_consecutive_bad=1",
                       "--config.faults.sigterm_at_step=8"]
  result = launch(["--backoff=0.1", "--max-restarts=2"], train_args)
  assert result.returncode == 0, result.stderr[-3000:]
  codes = [line.split("exit ")[1].split()[0] for line in result.stderr.splitlines()
           if line.startswith("maxtrain.launch: attempt")]
  assert codes == ["1", "76", "75", "0"], result.stderr[-3000:]  # crash, hang, (rollback,) preemption, finished

  records = read_events(tmp_path / "events.jsonl")
  hang = next(r for r in records if r["kind"] == "hang")
  assert hang["step"] == 5 and timeout_s < hang["idle_s"] <= timeout_s + 1.5
  dump = Path(hang["dump"]).read_text()
  assert "Python stacks of all threads" in dump and "faults.py" in dump and "last events" in dump
  restores = [r["step"] for r in records if r["kind"] == "restore"]
  assert restores == [2, 4, 8]  # newest checkpoint before each fault (8: saved on SIGTERM)
  rollback = next(r for r in records if r["kind"] == "rollback")
  assert (rollback["from_step"], rollback["to_step"]) == (6, 4)

  report = goodput.compute(records)
  assert report["attempts"] == 4 and report["steps"]["kept"] == 10
  # Lost: step 3 (crash, resumed from 2), step 5 (hang, resumed from 4), steps 5-6 (rolled back to 4).
  assert report["steps"]["lost"] >= 4 and report["events"]["rollback"] == 1
  assert report["seconds"]["downtime"] > 0 and report["seconds"]["hang"] >= timeout_s
  assert report["seconds"]["lost_progress"] > 0
  assert sum(report["seconds"].values()) == pytest.approx(report["total_s"], rel=1e-9)
  assert report["seconds"]["other"] <= 0.01 * report["total_s"]


def test_crash_loop_gives_up_with_a_summary(tmp_path):
  # A backend that cannot start: every attempt crashes the same way (exit 1), quickly. No hardware
  # preset: the detected `cpu` one would set JAX_PLATFORMS=cpu over the environment's.
  env = {**ENV, "JAX_PLATFORMS": "no-such-platform"}
  result = launch(["--backoff=0.01", "--max-restarts=2", "--window=600"],
                  [f"--config.output_dir={tmp_path}", "--config.hardware="], env=env, timeout=300)
  assert result.returncode == 1
  assert "giving up: 3 failed attempts within 600s exceed --max-restarts=2" in result.stderr
  for n in range(3):
    assert f"attempt {n}: exit 1 (crash)" in result.stderr
  kinds = [r["kind"] for r in read_events(tmp_path / "events.jsonl") if r["process"] == -1]
  assert kinds.count("restart") == 3 and kinds.count("crash") == 3


def test_bad_config_is_not_restarted(tmp_path):
  result = launch([], [f"--config.output_dir={tmp_path}", "--config.steps=0"], timeout=300)
  assert result.returncode == 2
  # The supervisor loads the config as the trainer does (ranges included): refused before any attempt.
  assert result.stderr.count("maxtrain.launch: attempt") == 0 and "config.steps=0: out of range" in result.stderr
