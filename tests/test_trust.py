"""Trust (issue 12): every bad input an exit 2 with one line naming the culprit, no secret on disk,
no open port, one writer per run, policy stops not restarted, non-finite updates skipped.

Each case asserts the exit code, that no traceback was printed and that the message names the key or
file. In-process `train.main` where that is enough; real subprocesses where the case is about the
process (locks, supervisor, watchdog, what reaches stdout/stderr).
"""

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from maxtrain import config as config_lib
from maxtrain.checkpoint import manifest
from maxtrain.cli import train
from maxtrain.errors import EXIT_ABORTED, EXIT_BAD_INPUT, EXIT_HANG, UserError
from maxtrain.monitor.events import read_events
from maxtrain.checkpoint.remote import staged_path
from test_checkpoint import assert_bitwise_equal, restore_raw, s3_server  # noqa: F401 (a fixture)
from tiny import TINY_MODEL, cpu_env

REPO = Path(__file__).resolve().parent.parent
TINY = TINY_MODEL + ["--config.eval.every_steps=0", "--config.log_every=1"]  # mesh.fsdp=-1: all devices
ENV = cpu_env(1)
SECRETS = ("hf_secretvalue123", "abcSECRETxyz", "AKIAQWERTYUIOPASDFGH")


def run_main(args, capsys, caplog=None):
  code = train.main(args)
  captured = capsys.readouterr()
  return code, captured.out + captured.err + (caplog.text if caplog is not None else "")


def assert_exit(code, output, expected_code, *names):
  assert code == expected_code, output[-3000:]
  assert "Traceback" not in output, output[-3000:]
  for name in names:
    assert name in output, (name, output[-3000:])


def trainer_process(args, env=ENV, launcher=("-m", "maxtrain.train"), **kwargs):
  return subprocess.Popen([sys.executable, *launcher, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env, cwd=REPO, **kwargs)


def run_process(args, env=ENV, launcher=("-m", "maxtrain.train"), timeout=300):
  proc = trainer_process(args, env, launcher)
  out, err = proc.communicate(timeout=timeout)
  return proc.returncode, out, err


def base(store, out, steps=4):
  return TINY + [f"--config.data.path={store}", f"--config.output_dir={out}", f"--config.steps={steps}"]


# ---- exit 2 before compiling ----------------------------------------------------------------

CONFIG_FILES = {
    "syntax error": ("def get_config(:\n  pass\n", "line 1"),
    "import error": ("import no_such_module_for_maxtrain\n", "ModuleNotFoundError"),
    "get_config raises": ("def get_config():\n  raise KeyError('oops')\n", "KeyError"),
    "no get_config": ("X = 1\n", "must define get_config()"),
}


@pytest.mark.parametrize("case", CONFIG_FILES)
def test_broken_config_file_exits_2(tmp_path, capsys, case):
  text, detail = CONFIG_FILES[case]
  path = tmp_path / "broken.py"
  path.write_text(text)
  code, output = run_main([f"--config={path}"], capsys)
  assert_exit(code, output, EXIT_BAD_INPUT, str(path), detail, "maxtrain: error:")


def test_output_dir_that_is_a_file_or_not_writable_exits_2(store, tmp_path, capsys, caplog):
  a_file = tmp_path / "file"
  a_file.write_text("x")
  code, output = run_main(base(store, a_file), capsys, caplog)
  assert_exit(code, output, EXIT_BAD_INPUT, f"config.output_dir={a_file} is a file")
  if os.geteuid() == 0:  # root writes through file modes; a directory nobody may create instead
    unwritable = Path("/sys/maxtrain-trust-test/run")
  else:
    (tmp_path / "ro").mkdir(mode=0o500)
    unwritable = tmp_path / "ro" / "run"
  code, output = run_main(base(store, unwritable), capsys, caplog)
  assert_exit(code, output, EXIT_BAD_INPUT, f"config.output_dir={unwritable}", "not writable")
  assert "compiled train step" not in output


def test_unwritable_compile_cache_exits_2(store, tmp_path, capsys, caplog):
  a_file = tmp_path / "cache-file"
  a_file.write_text("x")
  code, output = run_main(base(store, tmp_path / "run") + [f"--config.runtime.compile_cache_dir={a_file}"],
                          capsys, caplog)
  assert_exit(code, output, EXIT_BAD_INPUT, "config.runtime.compile_cache_dir", str(a_file))


def test_corrupt_faults_record_exits_2(store, tmp_path, capsys, caplog):
  out = tmp_path / "run"
  out.mkdir()
  (out / "faults_fired.json").write_text("{not json")
  code, output = run_main(base(store, out), capsys, caplog)
  assert_exit(code, output, EXIT_BAD_INPUT, str(out / "faults_fired.json"), "delete it")
  assert "compiled train step" not in output


def test_non_numeric_attempt_exits_2(store, tmp_path, capsys, caplog, monkeypatch):
  monkeypatch.setenv("MAXTRAIN_ATTEMPT", "two")
  code, output = run_main(base(store, tmp_path / "run"), capsys, caplog)
  assert_exit(code, output, EXIT_BAD_INPUT, "$MAXTRAIN_ATTEMPT='two'")


@pytest.mark.parametrize("args, names", [
    (["--config.monitor.prometheus_port=70000"], ["config.monitor.prometheus_port=70000", "[0, 65535]"]),
    (["--config.monitor.prometheus_port=-1"], ["config.monitor.prometheus_port=-1"]),
    (["--config.runtime.coordinator_port=65536"], ["config.runtime.coordinator_port=65536", "[0, 65535]"]),
    (["--config.optimizer.lr=inf"], ["config.optimizer.lr=inf", "finite"]),
    (["--config.guards.spike_zscore=nan"], ["config.guards.spike_zscore=nan", "finite"]),  # any float key
    (["--config.checkpoint.s3_read_timeout_s=0"], ["config.checkpoint.s3_read_timeout_s=0"]),
    (["--config.runtime.env=hf_secretvalue123"], ["config.runtime.env", "KEY=VALUE"]),
])
def test_bad_values_exit_2(store, tmp_path, capsys, caplog, args, names):
  code, output = run_main(base(store, tmp_path / "run") + args, capsys, caplog)
  assert_exit(code, output, EXIT_BAD_INPUT, *names)
  assert "hf_secretvalue123" not in output  # a malformed runtime.env is not echoed: it may hold a secret


def test_busy_prometheus_port_exits_2_before_compiling(store, tmp_path, capsys, caplog):
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    code, output = run_main(base(store, tmp_path / "run") + [f"--config.monitor.prometheus_port={port}"],
                            capsys, caplog)
  assert_exit(code, output, EXIT_BAD_INPUT, f"config.monitor.prometheus_port={port}", f"127.0.0.1:{port}")
  assert "compiled train step" not in output and "compile_start" not in (tmp_path / "run" / "events.jsonl").read_text()


def test_prometheus_binds_localhost_by_default():
  cfg = config_lib.load([])
  assert cfg.monitor.prometheus_host == "127.0.0.1"
  from maxtrain.monitor import prometheus

  server = prometheus.start(0, "run", 0) or prometheus.MetricsServer(0, {"run": "r"})
  try:
    assert server._httpd.server_address[0] == "127.0.0.1"
  finally:
    server.close()


def test_resume_with_another_optimizer_exits_2(store, tmp_path, capsys, caplog):
  out = tmp_path / "run"
  code, output = run_main(base(store, out, steps=2), capsys)
  assert code == 0, output
  caplog.clear()
  code, output = run_main(base(store, out, steps=4) + ["--config.optimizer.name=muon"], capsys, caplog)
  assert_exit(code, output, EXIT_BAD_INPUT, str(out / "checkpoints" / "2"), "optimizer.name=adamw",
              "--config.optimizer.name=adamw")
  assert "tree structures do not match" not in output


# ---- S3 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("rel", ["", "/abs/path", "a//b", "../escape", "state/../../x", "."])
def test_staged_path_rejects_keys_outside_the_staging_dir(tmp_path, rel):
  with pytest.raises(UserError, match="refusing"):
    staged_path(tmp_path, f"run/5/{rel}", rel)
  assert staged_path(tmp_path, "run/5/state/a", "state/a") == (tmp_path / "state" / "a").resolve()


def test_s3_key_outside_staging_exits_2_and_clients_have_timeouts(store, tmp_path, capsys, caplog, s3_server):  # noqa: F811
  s3_server.put_object(Bucket="ckpts", Key="runs/evil/2//abs/path", Body=b"x")
  s3_server.put_object(Bucket="ckpts", Key="runs/evil/2/_MAXTRAIN_COMPLETE", Body=b"")
  code, output = run_main(base(store, tmp_path / "run") + ["--config.checkpoint.dir=s3://ckpts/runs/evil"],
                          capsys, caplog)
  assert_exit(code, output, EXIT_BAD_INPUT, "runs/evil/2//abs/path", "refusing")
  assert not Path("/abs/path").exists()
  from maxtrain.checkpoint.remote import S3Mirror

  mirror = S3Mirror("s3://ckpts/x", connect_timeout_s=3.0, read_timeout_s=7.0, max_attempts=2)
  config = mirror._client.meta.config
  assert (config.connect_timeout, config.read_timeout, config.retries["total_max_attempts"]) == (3.0, 7.0, 2)
  mirror.close()


# ---- secrets --------------------------------------------------------------------------------

def test_redaction_rules():
  cfg = config_lib.load(["--config.runtime.env=HF_TOKEN=hf_secretvalue123,NCCL_PROTO=Simple,LL128",
                         "--config.checkpoint.dir=s3://user:pa55word@bucket/x",
                         "--config.runtime.xla_flags=--xla_foo=1 --api_key=abcSECRETxyz",
                         "--config.runtime.coordinator=AKIAQWERTYUIOPASDFGH"])
  red = config_lib.redacted(cfg)
  assert red["runtime"]["env"] == "HF_TOKEN=<redacted>,NCCL_PROTO=<redacted>"
  assert red["checkpoint"]["dir"] == "s3://user:<redacted>@bucket/x"
  assert red["runtime"]["xla_flags"] == "--xla_foo=1 --api_key=<redacted>"
  assert red["runtime"]["coordinator"] == "<redacted>"
  assert red["data"]["tokenizer"] == "byte" and red["model"]["loss_chunk_tokens"] == -1  # not credentials
  assert cfg.runtime.env.startswith("HF_TOKEN=hf_secretvalue123")  # the run itself still gets the values


def test_secrets_reach_no_file_log_or_mirror(store, tmp_path, s3_server):  # noqa: F811
  out = tmp_path / "run"
  env = ",".join(["HF_TOKEN=hf_secretvalue123", "AWS_SECRET_ACCESS_KEY_OTHER=abcSECRETxyz",
                  "MY_ID=AKIAQWERTYUIOPASDFGH"])
  code, stdout, stderr = run_process(base(store, out, steps=2) + [
      f"--config.runtime.env={env}", "--config.checkpoint.dir=s3://ckpts/runs/secret"], env=cpu_env(1))
  assert code == 0, stderr[-3000:]
  assert "HF_TOKEN=<redacted>" in stderr  # the platform log names the variable, not its value
  files = [p for p in out.rglob("*") if p.is_file()]
  assert any(p.name == "config.json" for p in files) and any("tfevents" in p.name for p in files)
  for secret in SECRETS:
    assert secret not in stdout + stderr
    for path in files:
      assert secret.encode() not in path.read_bytes(), (secret, path)
  for obj in s3_server.list_objects_v2(Bucket="ckpts", Prefix="runs/secret/")["Contents"]:
    body = s3_server.get_object(Bucket="ckpts", Key=obj["Key"])["Body"].read()
    assert not any(secret.encode() in body for secret in SECRETS), obj["Key"]
  assert json.loads((out / "config.json").read_text())["runtime"]["env"].startswith("HF_TOKEN=<redacted>")
  assert stat.S_IMODE((out / "config.json").stat().st_mode) == 0o600
  meta_files = [p for p in (out / "checkpoints" / "2" / "meta").rglob("*") if p.is_file()]
  assert meta_files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in meta_files)


# ---- one writer per run ---------------------------------------------------------------------

def test_second_trainer_on_one_directory_exits_2_and_the_first_finishes(store, tmp_path):
  out = tmp_path / "run"
  first = trainer_process(base(store, out, steps=30) + ["--config.checkpoint.every_steps=10"])
  lock = out / ".maxtrain.lock"
  deadline = time.monotonic() + 120
  while not (lock.exists() and lock.read_text().strip()) and first.poll() is None and time.monotonic() < deadline:
    time.sleep(0.1)  # polling a file another process writes; nothing to wait on instead
  # Paused while the second one tries, so that it cannot finish first however fast it trains; a
  # stopped process keeps its lock.
  os.kill(first.pid, signal.SIGSTOP)
  try:
    code, _, err = run_process(base(store, out, steps=30))
  finally:
    os.kill(first.pid, signal.SIGCONT)
  assert_exit(code, err, EXIT_BAD_INPUT, f"pid {first.pid}", "is in use by another trainer", str(lock))
  _, first_err = first.communicate(timeout=300)
  assert first.returncode == 0, first_err[-3000:]
  steps = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
  assert steps == [10, 20, 30]
  for step in steps:
    assert manifest.verify(out / "checkpoints" / str(step)).verified
  assert sum(r["kind"] == "job_start" for r in read_events(out / "events.jsonl")) == 1  # the second wrote nothing
  assert lock.read_text() == ""  # released cleanly


# ---- non-finite updates, the rollback budget, abort ------------------------------------------

def test_overflowing_update_is_skipped_and_a_stale_lock_taken_over(store, tmp_path, capsys, caplog):
  out = tmp_path / "run"
  out.mkdir()
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  (out / ".maxtrain.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": 1.0}))
  # Finite loss and gradients, but lr=1e30 overflows the parameters: every update must be skipped.
  code, output = run_main(base(store, out, steps=3) + [
      "--config.optimizer.lr=1e30", "--config.optimizer.schedule=constant", "--config.optimizer.warmup_steps=0",
      "--config.guards.max_consecutive_bad=10", "--config.checkpoint.every_steps=1",
      "--config.checkpoint.max_to_keep=0"], capsys, caplog)
  assert code == 0, output
  assert f"taking over the lock of a trainer that is gone (pid {dead.pid}" in caplog.text
  skips = [r for r in read_events(out / "events.jsonl") if r["kind"] == "nan_skip"]
  assert [r["step"] for r in skips] == [1, 2, 3] and all("update" in r["what"] for r in skips)
  first, last = restore_raw(out / "checkpoints", 1), restore_raw(out / "checkpoints", 3)
  assert_bitwise_equal(first["params"], last["params"])
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(last["params"]))
  summary = json.loads((out / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
  assert summary["steps"] == 3


def test_rollback_budget_is_kept_with_the_checkpoints(store, tmp_path, capsys, caplog):
  out = tmp_path / "run"
  args = base(store, out) + ["--config.mesh.fsdp=8", "--config.guards.spike_warmup=3", "--config.guards.spike_zscore=50",
                             "--config.checkpoint.every_steps=2", "--config.guards.max_rollbacks=1",
                             "--config.guards.max_consecutive_bad=1"]
  code, output = run_main(args + ["--config.steps=6", "--config.faults.nan_at_step=5"], capsys)
  assert code == 0, output
  assert json.loads((out / "checkpoints" / "maxtrain_rollbacks.json").read_text())["rollbacks"] == 1
  assert json.loads((out / "checkpoints" / "6" / "meta" / "metadata").read_text())["rollbacks"] == 1
  (out / "events.jsonl").unlink()  # the budget does not come from the telemetry log
  (out / "checkpoints" / "maxtrain_rollbacks.json").unlink()  # nor only from the file: the meta has it too
  code, output = run_main(args + ["--config.steps=10", "--config.faults.spike_at_step=8", "--config.guards.spike_action=rollback"],
                          capsys, caplog)
  assert_exit(code, output, EXIT_ABORTED, "guards.max_rollbacks=1", "maxtrain: aborted:")


def test_policy_abort_exits_3_and_is_not_restarted(store, tmp_path):
  code, _, err = run_process(["--backoff=0.01", "--", *base(store, tmp_path, steps=8),
                              "--config.guards.spike_warmup=3", "--config.guards.spike_zscore=50",
                              "--config.faults.spike_at_step=6", "--config.guards.spike_action=abort"],
                             launcher=("-m", "maxtrain.launch"))
  assert_exit(code, err, EXIT_ABORTED, "aborted: loss spike at step 6", "attempt 0: exit 3 (stopped by a training policy)")
  assert "attempt 1" not in err
  kinds = [r["kind"] for r in read_events(tmp_path / "events.jsonl")]
  assert kinds.count("restart") == 1 and "crash" not in kinds


# ---- corrupt newest checkpoint under the supervisor ------------------------------------------

def test_corrupt_newest_checkpoint_under_launch_resumes_from_the_previous(store, tmp_path):
  args = base(store, tmp_path, steps=4) + ["--config.checkpoint.every_steps=2", "--config.optimizer.decay_steps=6"]
  code, _, err = run_process(args)
  assert code == 0, err[-3000:]
  state_files = [p for p in (tmp_path / "checkpoints" / "4" / "state").rglob("*") if p.is_file()]
  victim = max(state_files, key=lambda p: p.stat().st_size)  # an array file
  data = bytearray(victim.read_bytes())
  data[len(data) // 2] ^= 0x01
  victim.write_bytes(bytes(data))
  code, _, err = run_process(["--backoff=0.01", "--", *args, "--config.steps=6"], launcher=("-m", "maxtrain.launch"))
  assert code == 0, err[-3000:]
  assert err.count("maxtrain.launch: attempt") == 1 and "restored step 2" in err
  corrupt = [r for r in read_events(tmp_path / "events.jsonl") if r["kind"] == "checkpoint_corrupt"]
  assert len(corrupt) == 1 and corrupt[0]["step"] == 4 and victim.name in corrupt[0]["file"]
  moved = [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("4.corrupt-")]
  assert len(moved) == 1 and (moved[0] / victim.relative_to(tmp_path / "checkpoints" / "4")).exists()
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4", "6"]


# ---- damaged checkpoints at the entry point ----------------------------------------------------

@pytest.fixture(scope="module")
def trained(store, tmp_path_factory):
  """A finished 4-step run with checkpoints at steps 2 and 4 (never modified: tests damage copies)."""
  out = tmp_path_factory.mktemp("trained") / "run"
  assert train.main(base(store, out) + ["--config.checkpoint.every_steps=2"]) == 0
  return out


def copy_run(trained, tmp_path):
  out = tmp_path / "run"
  shutil.copytree(trained, out)
  return out, out / "checkpoints" / "4"


def largest_file(step_dir, item):
  return max((p for p in (step_dir / item).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip_byte(path):
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x01
  path.write_bytes(bytes(data))


def cut_in_half(path):
  with open(path, "r+b") as f:
    f.truncate(path.stat().st_size // 2)


@pytest.mark.parametrize("damage", [flip_byte, cut_in_half], ids=["flipped", "truncated"])
@pytest.mark.parametrize("item", ["state", "data", "meta"])
def test_explicit_resume_of_a_damaged_checkpoint_exits_2(store, trained, tmp_path, capsys, caplog, item, damage):
  out, step_dir = copy_run(trained, tmp_path)
  victim = largest_file(step_dir, item)
  damage(victim)
  code, output = run_main(base(store, out) + ["--config.checkpoint.resume=4"], capsys, caplog)
  assert_exit(code, output, EXIT_BAD_INPUT, f"checkpoint {step_dir} is corrupt: {victim.relative_to(step_dir)}:",
              "checksum" if damage is flip_byte else "size")
  assert "compiled train step" not in output
  assert victim.exists() and not [p for p in step_dir.parent.iterdir() if ".corrupt-" in p.name]  # explicit: not moved


@pytest.mark.parametrize("field", ["size", "checksum"])
def test_a_manifest_that_lies_exits_2_on_explicit_resume(store, trained, tmp_path, capsys, caplog, field):
  out, step_dir = copy_run(trained, tmp_path)
  path = step_dir / manifest.MANIFEST_NAME
  recorded = json.loads(path.read_text())
  name = largest_file(step_dir, "state").relative_to(step_dir).as_posix()
  entry = recorded["files"][name]
  entry[field] = entry[field] + 1 if field == "size" else format(int(entry[field], 16) ^ 1, f"0{len(entry[field])}x")
  path.write_text(json.dumps(recorded))
  code, output = run_main(base(store, out) + [f"--config.checkpoint.resume={step_dir}"], capsys, caplog)  # by path
  assert_exit(code, output, EXIT_BAD_INPUT, f"checkpoint {step_dir} is corrupt: {name}:", field)
  assert "compiled train step" not in output


def test_cut_metadata_of_the_newest_checkpoint_is_moved_aside_under_resume_auto(store, trained, tmp_path, capsys, caplog):
  out, step_dir = copy_run(trained, tmp_path)
  cut_in_half(step_dir / "meta" / "metadata")
  code, output = run_main(base(store, out, steps=2), capsys, caplog)  # step 2 is the last: restore, evaluate
  assert code == 0 and "Traceback" not in output, output[-3000:]
  records = read_events(out / "events.jsonl")
  corrupt = [r for r in records if r["kind"] == "checkpoint_corrupt"]
  assert [(r["step"], r["file"]) for r in corrupt] == [(4, "meta/metadata")]
  assert [r["step"] for r in records if r["kind"] == "restore"] == [2]
  moved = [p for p in step_dir.parent.iterdir() if p.name.startswith("4.corrupt-")]
  assert len(moved) == 1 and (moved[0] / "meta" / "metadata").exists() and not step_dir.exists()


def test_a_checkpoint_without_manifest_restores_and_says_so(store, trained, tmp_path, capsys, caplog):
  out, step_dir = copy_run(trained, tmp_path)
  (step_dir / manifest.MANIFEST_NAME).unlink()  # as saved before manifests existed
  code, output = run_main(base(store, out), capsys, caplog)
  assert code == 0 and "Traceback" not in output, output[-3000:]
  assert f"checkpoint {step_dir} has no manifest" in output and "restoring it unverified" in output
  assert [r["step"] for r in read_events(out / "events.jsonl") if r["kind"] == "restore"] == [4]


def saved_config_edited(trained, tmp_path, edit):
  """A copy of the run whose step 4 has its saved config edited by `edit` (and no manifest, which the edit
  would otherwise fail: a checkpoint saved before manifests)."""
  out, step_dir = copy_run(trained, tmp_path)
  (step_dir / manifest.MANIFEST_NAME).unlink()
  meta_file = step_dir / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  edit(meta["config"])
  meta_file.write_text(json.dumps(meta))
  return out, step_dir


def test_a_saved_config_without_later_keys_resumes_at_their_defaults(store, trained, tmp_path, capsys, caplog):
  """A checkpoint saved before keys existed (post.mode, model.family, the MLA section, the spike window, the
  tokenizer) resumes: migrate gives each its declared default, which is what that checkpoint ran."""
  def drop(c):
    del c["post"]["mode"], c["model"]["family"], c["model"]["mla"], c["guards"]["spike_window"], c["data"]["tokenizer"]
  out, _ = saved_config_edited(trained, tmp_path, drop)
  code, output = run_main(base(store, out), capsys, caplog)
  assert code == 0 and "Traceback" not in output, output[-3000:]
  assert [r["step"] for r in read_events(out / "events.jsonl") if r["kind"] == "restore"] == [4]


def test_an_unknown_key_in_a_saved_config_exits_2_naming_it(store, trained, tmp_path, capsys, caplog):
  """Issue 42: a checkpoint's saved config is read through config/migrate.py, which knows today's keys and the
  renamed or dropped ones: any other key (a newer maxtrain's, an edit) is exit 2 naming it, before compiling."""
  out, step_dir = saved_config_edited(trained, tmp_path, lambda c: c["model"].update(num_layer=2))
  code, output = run_main(base(store, out) + ["--config.checkpoint.resume=4"], capsys, caplog)
  assert_exit(code, output, EXIT_BAD_INPUT, f"checkpoint {step_dir} (saved by maxtrain ",
              "in its saved config: unknown config key config.model.num_layer. Did you mean config.model.num_layers",
              "maxtrain/config/migrate.py")
  assert "compiled train step" not in output


def test_crafted_middle_offset_exits_2_at_the_entry_point(store, tmp_path, capsys, caplog):
  prefix = tmp_path / "crafted"
  for split in ("train", "val"):
    for ext in ("bin", "idx", "json"):
      shutil.copyfile(f"{store}.{split}.{ext}", f"{prefix}.{split}.{ext}")
  offsets = np.fromfile(f"{prefix}.train.idx", dtype="<u8")
  middle = len(offsets) // 2
  offsets[middle] = offsets[middle - 1] - 1  # a document that starts inside the one before it
  offsets.tofile(f"{prefix}.train.idx")
  code, output = run_main(base(prefix, tmp_path / "run"), capsys, caplog)
  assert_exit(code, output, EXIT_BAD_INPUT, "crafted.train.idx", f"offset {middle} (start of document {middle})")
  assert "compiled train step" not in output


# ---- the watchdog watches the exit ----------------------------------------------------------

HANG_AT_CLOSE = ("import sys, threading; from maxtrain.checkpoint import storage; from maxtrain.cli import train; "
                 "storage.Checkpointer.close = lambda self: threading.Event().wait(); "
                 "sys.exit(train.main(sys.argv[1:]))")


def test_watchdog_fires_when_the_final_checkpoint_close_hangs(store, tmp_path):
  code, _, err = run_process([*base(store, tmp_path, steps=2), "--config.watchdog.timeout_s=3"],
                             launcher=("-c", HANG_AT_CLOSE), timeout=120)
  assert code == EXIT_HANG, err[-3000:]
  hang = [r for r in read_events(tmp_path / "events.jsonl") if r["kind"] == "hang"]
  assert len(hang) == 1 and hang[0]["step"] == 2
  assert "Checkpointer" in Path(hang[0]["dump"]).read_text() or "<lambda>" in Path(hang[0]["dump"]).read_text()
