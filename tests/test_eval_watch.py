"""The evaluation sidecar: killed with SIGKILL in the middle of an evaluation (the fault seam, after its
first scored batch) and restarted while the trainer also restarts, it ends with each checkpoint
evaluated exactly once (results files and events counted), and exits 0 when the run has finished."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval", reason="evaluation tests need the test extra: pip install -e '.[test]'")

from maxtrain.evaluation import watch  # noqa: E402
from maxtrain.monitor import events as ev  # noqa: E402
from tiny import TINY_MODEL  # noqa: E402

TASK = """task: tiny_code
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{prefix}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
"""
ROWS = [{"prefix": "import", "choices": [" os", " 12"], "label": 0},
        {"prefix": "def f(x):\n  return", "choices": [" x", " )("], "label": 0},
        {"prefix": "for i in", "choices": [" range(3):", " :"], "label": 0}]


def sidecar(run, tasks, **env):
  return [sys.executable, "-m", "maxtrain.eval", "--watch", str(run), "--tasks", "tiny_code", "--include-path",
          str(tasks), "--batch-size", "2", "--poll-seconds", "0.2"], {**os.environ, "HF_DATASETS_OFFLINE": "1", **env}


def test_sidecar_survives_sigkill_and_trainer_restart(store, tmp_path):
  from maxtrain.cli import train as train_cli

  tasks, run = tmp_path / "tasks", tmp_path / "run"
  tasks.mkdir()
  (tasks / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))  # a user's JSONL task
  (tasks / "tiny_code.yaml").write_text(TASK.format(data=tasks / "rows.jsonl"))
  train = [*TINY_MODEL, f"--config.data.path={store}", "--config.steps=6", f"--config.output_dir={run}",
           "--config.checkpoint.every_steps=2", "--config.checkpoint.max_to_keep=0"]  # trainers run in this process
  assert train_cli.main(train + ["--config.faults.sigterm_at_step=3"]) == 75  # preempted: checkpoints 2 and 3
  cmd, env = sidecar(run, tasks, **{watch.KILL_AT_STEP_ENV: "2"})
  killed = subprocess.run(cmd, env=env, capture_output=True, text=True)
  assert killed.returncode == -9, killed.stderr[-2000:]
  assert not watch.results_path(run, 2).exists()  # killed mid-evaluation: nothing recorded for step 2
  cmd, env = sidecar(run, tasks, **{watch.KILL_AT_STEP_ENV: "2"})  # the drill fired once: not again
  second = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  assert train_cli.main(train) == 0  # the trainer restarts meanwhile
  out, err = second.communicate(timeout=600)
  assert second.returncode == 0, err[-2000:]
  steps = watch.checkpoint_steps(run)
  assert steps == [2, 3, 4, 6]
  records = ev.read_events(run / "eval" / ev.FILENAME)
  done = [r["step"] for r in records if r["kind"] == watch.EVAL_DONE]
  started = [r["step"] for r in records if r["kind"] == watch.EVAL_START]
  assert sorted(done) == steps  # each checkpoint's evaluation completed exactly once
  assert sorted(started) == [2, 2, 3, 4, 6]  # step 2 began twice: the killed try left no results
  for step in steps:
    results = json.loads(watch.results_path(run, step).read_text())
    assert 0 <= results["results"]["tiny_code"]["acc,none"] <= 1
  assert sorted(p.name for p in (run / "eval").iterdir() if p.name.isdigit()) == [str(s) for s in steps]


def test_in_loop_tasks_and_a_failing_task(store, tmp_path, caplog):
  """`eval.tasks` runs at each eval inside the trainer: a good task's scalars reach TensorBoard and the
  event log; a task that fails (its data file does not parse) is an event and a warning, and the run
  ends 0. A task whose data file does not exist is refused before compiling (exit 2, the file named)."""
  from maxtrain.cli import train

  tasks, run = tmp_path / "tasks", tmp_path / "run"
  tasks.mkdir()
  (tasks / "tiny_code.yaml").write_text(TASK.format(data=tasks / "rows.jsonl"))
  (tasks / "rows.jsonl").write_text("{not json\n")  # exists (the start-up check passes), fails to load
  args = [*TINY_MODEL, f"--config.data.path={store}", "--config.steps=2", f"--config.output_dir={run}",
          "--config.eval.every_steps=0", "--config.eval.tasks=pycode_mc,tiny_code",
          f"--config.eval.tasks_include_path={tasks}"]
  with caplog.at_level("WARNING", logger="maxtrain"):
    assert train.main(args) == 0
  records = ev.read_events(run / ev.FILENAME)
  failed = [r for r in records if r["kind"] == "eval_task_failed"]
  done = [r for r in records if r["kind"] == "eval_tasks"]
  assert [(r["step"], r["task"]) for r in failed] == [(2, "tiny_code")]
  assert len(done) == 1 and 0 <= done[0]["scalars"]["eval/pycode_mc/acc"] <= 1
  assert "eval task tiny_code failed" in caplog.text
  assert train.main([*args[:-2], "--config.eval.tasks=no_such_task"]) == 2  # checked before compiling
  (tasks / "rows.jsonl").unlink()
  assert train.main(args) == 2  # its data file is missing: refused before compiling


def test_sidecar_skips_a_corrupt_checkpoint_and_exits_when_the_run_finished(tmp_path):
  """A checkpoint whose manifest does not verify is a `checkpoint_eval_skipped` record, not a dead
  sidecar; one without a manifest (being written) is not looked at; the finished run ends the loop."""
  from maxtrain.evaluation import run as run_lib

  run = tmp_path / "run"
  for step in (2, 4):
    (run / "checkpoints" / str(step) / "state").mkdir(parents=True)
  (run / "checkpoints" / "2" / "maxtrain_manifest.json").write_text("{not json")
  with ev.EventLog(run / ev.FILENAME) as log:
    log.emit(ev.JOB_START, hosts=1)
    assert not watch.run_finished(run)
    log.emit(ev.EXIT, 4, code=0)
  assert watch.run_finished(run)
  sidecar = watch.Sidecar(run, ["pycode_mc"], run_lib.task_manager(), [], 2)
  assert sidecar.pending() == [2]  # 4 has no manifest yet
  assert sidecar.loop(0.01) == 0
  records = ev.read_events(run / "eval" / ev.FILENAME)
  assert [(r["kind"], r["step"]) for r in records] == [(watch.EVAL_START, 2), (watch.EVAL_SKIPPED, 2)]
  with pytest.raises(Exception, match="another evaluation sidecar"):
    watch.Sidecar(run, ["pycode_mc"], run_lib.task_manager(), [], 2)  # the first still holds the lock
