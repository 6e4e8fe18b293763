"""Trust (issue 23), the checkpoint and run-identity families: a run never continues from a state other
than the newest good one without saying so, one lock per checkpoint directory, every read of a
checkpoint verified (a checksum that tells every file apart), the tokenizer part of a run's identity.

Every case goes through a real entry point (`train.main`, or `python -m maxtrain.X` where the case is
about a process) and asserts the exit code, no traceback, the culprit's name, and what is on disk after.
One trained run (steps 2 and 4 saved) is copied for each case.
"""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from maxtrain.checkpoint import manifest
from maxtrain.cli import train
from maxtrain.monitor.events import read_events
from test_checkpoint import s3_server  # noqa: F401 (a fixture)
from test_trust import ENV, REPO, TINY, assert_exit, run_main

SAVE_EVERY_2 = ["--config.checkpoint.every_steps=2", "--config.checkpoint.max_to_keep=0"]


def args(store, out, steps=4, *extra):
  return TINY + SAVE_EVERY_2 + [f"--config.data.path={store}", f"--config.output_dir={out}",
                                f"--config.steps={steps}", *extra]


@pytest.fixture(scope="module")
def trained_run(store, tmp_path_factory) -> Path:
  out = tmp_path_factory.mktemp("trained") / "run"
  assert train.main(args(store, out)) == 0
  assert entries(out / "checkpoints") == ["2", "4"]
  return out


@pytest.fixture
def run(trained_run, tmp_path) -> Path:
  copy = tmp_path / "run"
  shutil.copytree(trained_run, copy)
  return copy


def entries(ckpt: Path) -> list[str]:
  """The step-like directories (steps and the ones moved aside), sorted."""
  return sorted(p.name for p in ckpt.iterdir() if p.name[0].isdigit())


def fingerprint(step_dir: Path) -> dict[str, bytes]:
  return {p.relative_to(step_dir).as_posix(): p.read_bytes() for p in sorted(step_dir.rglob("*")) if p.is_file()}


def flip(path: Path) -> None:
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0xFF
  path.write_bytes(bytes(data))


def largest_data_file(step_dir: Path) -> Path:
  return max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


# ---- resume: the newest good state, or say so ------------------------------------------------------


def test_resume_of_an_older_step_while_newer_exist_exits_2_and_changes_nothing(store, run, capsys, caplog):
  ckpt = run / "checkpoints"
  before = {s: fingerprint(ckpt / s) for s in ("2", "4")}
  code, out = run_main(args(store, run, 4, "--config.checkpoint.resume=2"), capsys, caplog)
  assert_exit(code, out, 2, "checkpoint.resume=2", "newer steps [4]", "checkpoint.branch")
  assert entries(ckpt) == ["2", "4"] and {s: fingerprint(ckpt / s) for s in ("2", "4")} == before


def test_branch_moves_the_newer_steps_aside_and_records_it(store, run, capsys, caplog):
  ckpt = run / "checkpoints"
  old4 = fingerprint(ckpt / "4")
  code, out = run_main(args(store, run, 4, "--config.checkpoint.resume=2", "--config.checkpoint.branch=True"),
                       capsys, caplog)
  assert_exit(code, out, 0, "restored step 2")
  branched = [n for n in entries(ckpt) if n.startswith("4.branched-")]
  assert len(branched) == 1 and fingerprint(ckpt / branched[0]) == old4  # renamed, never deleted
  assert "4" in entries(ckpt) and manifest.verify(ckpt / "4").verified  # the branch's own step 4
  events = [e for e in read_events(run / "events.jsonl") if e["kind"] == "checkpoint_branch"]
  assert events and events[-1]["step"] == 2 and events[-1]["newer_steps"] == [4]


def test_all_corrupt_exits_2_moving_nothing_unless_told_to_start_over(store, run, capsys, caplog):
  ckpt = run / "checkpoints"
  for step in ("2", "4"):
    flip(largest_data_file(ckpt / step))
  damaged = {s: fingerprint(ckpt / s) for s in ("2", "4")}
  code, out = run_main(args(store, run, 6), capsys, caplog)
  assert_exit(code, out, 2, "no checkpoint verifies", "checkpoint.start_over_if_corrupt")
  assert entries(ckpt) == ["2", "4"] and {s: fingerprint(ckpt / s) for s in ("2", "4")} == damaged  # nothing trained
  code, out = run_main(args(store, run, 2, "--config.checkpoint.start_over_if_corrupt=True"), capsys, caplog)
  assert_exit(code, out, 0)
  names = entries(ckpt)
  assert "2" in names and sum(n.startswith(("2.corrupt-", "4.corrupt-")) for n in names) == 2, names
  assert "4" not in names  # a fresh run of 2 steps: nothing restored from the damaged ones


def same_size_pair(ckpt: Path) -> tuple[Path, Path]:
  """A file of step 4 and a same-size, different file of step 2 (array data files and OCDBT manifests
  end in their own CRC-32C)."""
  older = {}
  for p in (ckpt / "2").rglob("*"):
    if p.is_file() and p.name != manifest.MANIFEST_NAME:
      older.setdefault(p.stat().st_size, []).append(p)
  for p in sorted((ckpt / "4" / "state").rglob("*"), key=lambda p: -p.stat().st_size if p.is_file() else 0):
    for q in older.get(p.stat().st_size if p.is_file() else -1, []):
      if q.read_bytes() != p.read_bytes():
        return p, q
  raise AssertionError("no same-size pair of files in steps 2 and 4")


def test_a_same_size_file_swapped_in_from_another_step_is_caught(store, run, capsys, caplog):
  ckpt = run / "checkpoints"
  target, donor = same_size_pair(ckpt)
  shutil.copyfile(donor, target)
  swapped = fingerprint(ckpt / "4")
  name = target.relative_to(ckpt / "4").as_posix()
  code, out = run_main(args(store, run, 4, "--config.checkpoint.resume=4"), capsys, caplog)
  assert_exit(code, out, 2, name)
  code, out = run_main(args(store, run, 4), capsys, caplog)  # auto: moved aside, resumed from 2, step 4 again
  assert_exit(code, out, 0, "restored step 2")
  moved = [n for n in entries(ckpt) if n.startswith("4.corrupt-")]
  assert len(moved) == 1 and fingerprint(ckpt / moved[0]) == swapped
  assert manifest.verify(ckpt / "4").verified and fingerprint(ckpt / "4") != swapped


def test_a_manifestless_step_that_does_not_restore_is_moved_aside_and_an_older_one_restored(store, run, capsys,
                                                                                            caplog):
  """Issue 37, case 10: a step without a manifest (saved before manifests, or its process died before writing
  it) with its largest data file removed: before, a traceback and step 2 never tried. Now it is restored
  once, onto the run's devices, to check it: corrupt like a step that fails its manifest (resume=auto's rule)."""
  ckpt = run / "checkpoints"
  (ckpt / "4" / manifest.MANIFEST_NAME).unlink()
  largest = largest_data_file(ckpt / "4")
  largest.unlink()
  damaged = fingerprint(ckpt / "4")
  code, out = run_main(args(store, run, 4), capsys, caplog)
  assert_exit(code, out, 0, f"checkpoint {ckpt / '4'} is corrupt: state/", "no manifest, and it does not restore",
              "restored step 2")
  moved = [n for n in entries(ckpt) if n.startswith("4.corrupt-")]
  assert len(moved) == 1 and fingerprint(ckpt / moved[0]) == damaged
  assert manifest.verify(ckpt / "4").verified  # saved again from step 2
  corrupt = [e for e in read_events(run / "events.jsonl") if e["kind"] == "checkpoint_corrupt"]
  assert [(e["step"], e["file"].split("/")[0]) for e in corrupt] == [(4, "state")]
  assert [e["step"] for e in read_events(run / "events.jsonl") if e["kind"] == "restore"][-1] == 2


def test_incomplete_step_directories_are_skipped(store, run, capsys, caplog):
  ckpt = run / "checkpoints"
  (ckpt / "6").mkdir()  # empty
  (ckpt / "8").mkdir()  # partial: a copy cut short
  shutil.copytree(ckpt / "4" / "state", ckpt / "8" / "state")
  code, out = run_main(args(store, run, 6), capsys, caplog)
  assert_exit(code, out, 0, "incomplete", "restored step 4")
  names = entries(ckpt)
  assert {"2", "4", "6"} <= set(names) and "8" not in names
  assert any(n.startswith("6.incomplete-") for n in names) and any(n.startswith("8.incomplete-") for n in names)
  assert manifest.verify(ckpt / "6").verified


def test_a_symlinked_step_directory_is_refused(store, run, capsys, caplog):
  ckpt = run / "checkpoints"
  (ckpt / "6").symlink_to(ckpt / "4")
  code, out = run_main(args(store, run, 8), capsys, caplog)
  assert_exit(code, out, 2, "step directory 6 is a symlink")
  assert entries(ckpt) == ["2", "4", "6"] and not (ckpt / "4" / "8").exists()
  assert manifest.verify(ckpt / "4").verified


# ---- every read verified -----------------------------------------------------------------------------


def test_rollback_never_restores_a_corrupt_checkpoint(store, run, capsys, caplog):
  """Step 6 is damaged once its save is complete (the bit-rot drill); the NaN at step 7 rolls back: to 4,
  not to 6."""
  ckpt = run / "checkpoints"
  code, out = run_main(args(store, run, 8, "--config.faults.nan_at_step=7", "--config.guards.max_consecutive_bad=1",
                            "--config.faults.corrupt_checkpoint_at_step=6"), capsys, caplog)
  assert_exit(code, out, 0, "restored step 4")
  events = read_events(run / "events.jsonl")
  rollback = [e for e in events if e["kind"] == "rollback"]
  corrupt = [e for e in events if e["kind"] == "checkpoint_corrupt"]
  assert rollback[-1]["to_step"] == 4 and corrupt[-1]["step"] == 6
  assert any(n.startswith("6.corrupt-") for n in entries(ckpt))


@pytest.mark.parametrize("tool", ["generate", "convert"])
def test_generate_and_convert_verify_what_they_read(run, tmp_path, tool):
  step = run / "checkpoints" / "4"
  bad = largest_data_file(step)
  flip(bad)
  cmd = {"generate": ["--checkpoint", str(step), "--prompt", "def ", "--max-new-tokens", "2"],
         "convert": ["to-hf", str(step), str(tmp_path / "hf")]}[tool]
  proc = subprocess.run([sys.executable, "-m", f"maxtrain.{tool}", *cmd], capture_output=True, text=True, env=ENV,
                        cwd=REPO, timeout=300)
  assert_exit(proc.returncode, proc.stdout + proc.stderr, 2, "is corrupt", bad.name)
  assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").glob("*.safetensors"))


# ---- one lock per checkpoint directory ----------------------------------------------------------------


def test_two_runs_sharing_a_checkpoint_dir_the_second_exits_2_and_saves_nothing(store, tmp_path, capsys, caplog):
  shared = tmp_path / "shared"
  shared.mkdir()
  holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from maxtrain.runtime.lock import RunLock; "
                             f"RunLock({str(shared)!r}, 'checkpoint.dir').acquire(); print('held', flush=True); "
                             "time.sleep(600)"], stdout=subprocess.PIPE, text=True, cwd=REPO)
  try:
    assert holder.stdout.readline().strip() == "held"
    code, out = run_main(args(store, tmp_path / "second", 2, f"--config.checkpoint.dir={shared}"), capsys, caplog)
    assert_exit(code, out, 2, f"checkpoint.dir={shared}", "in use by another trainer", f"pid {holder.pid}")
    assert entries(shared) == [] and not (tmp_path / "second" / "checkpoints").exists()
  finally:
    holder.kill()
    holder.wait()
  code, out = run_main(args(store, tmp_path / "second", 2, f"--config.checkpoint.dir={shared}"), capsys, caplog)
  assert_exit(code, out, 0)
  assert entries(shared) == ["2"]


def test_s3_checkpoint_dir_lease(store, tmp_path, capsys, caplog, s3_server):  # noqa: F811
  live = {"host": "other-host", "pid": 4242, "token": "t", "expires": time.time() + 300}
  s3_server.put_object(Bucket="ckpts", Key="runs/shared/.maxtrain.lease", Body=json.dumps(live).encode())
  url = "--config.checkpoint.dir=s3://ckpts/runs/shared"
  code, out = run_main(args(store, tmp_path / "b", 2, url), capsys, caplog)
  assert_exit(code, out, 2, "s3://ckpts/runs/shared", "pid 4242 on host other-host")
  assert "Contents" not in s3_server.list_objects_v2(Bucket="ckpts", Prefix="runs/shared/2/")
  stale = {**live, "expires": time.time() - 1}
  s3_server.put_object(Bucket="ckpts", Key="runs/shared/.maxtrain.lease", Body=json.dumps(stale).encode())
  code, out = run_main(args(store, tmp_path / "c", 2, url), capsys, caplog)
  assert_exit(code, out, 0, "expired lease")
  keys = {o["Key"] for o in s3_server.list_objects_v2(Bucket="ckpts", Prefix="runs/shared/")["Contents"]}
  assert "runs/shared/2/_MAXTRAIN_COMPLETE" in keys and "runs/shared/.maxtrain.lease" not in keys  # released


# ---- the run's identity: tokenizer, guard window, model shape ------------------------------------------


@pytest.fixture(scope="module")
def hf_store(tmp_path_factory) -> tuple[str, str]:
  from hf_models import make_tokenizer
  from maxtrain.data.indexing import index_files

  root = tmp_path_factory.mktemp("hfstore")
  tok = str(make_tokenizer(root / "tokenizer.json"))
  index_files([str(REPO / "maxtrain" / "data")], str(root / "code"), tok, val_fraction=0.2, workers=1,
              progress=False)
  return str(root / "code"), tok


def test_a_store_of_another_tokenizer_than_the_config_exits_2(hf_store, tmp_path, capsys, caplog):
  prefix, tok = hf_store
  code, out = run_main(args(prefix, tmp_path / "run", 2), capsys, caplog)  # data.tokenizer=byte (the default)
  assert_exit(code, out, 2, "config.data.tokenizer='byte'", "byte-v1", "hf:")
  assert not (tmp_path / "run" / "checkpoints").exists() or entries(tmp_path / "run" / "checkpoints") == []


def test_resuming_on_stores_of_another_tokenizer_exits_2(hf_store, run, capsys, caplog):
  prefix, tok = hf_store
  code, out = run_main(args(prefix, run, 6, f"--config.data.tokenizer={tok}"), capsys, caplog)
  assert_exit(code, out, 2, "checkpoint", "byte-v1", "hf:")
  assert entries(run / "checkpoints") == ["2", "4"]


def test_a_changed_spike_window_on_resume_exits_2(store, run, capsys, caplog):
  code, out = run_main(args(store, run, 6, "--config.guards.spike_window=16"), capsys, caplog)
  assert_exit(code, out, 2, "guards.spike_window=16", "spike_window=32")
  assert entries(run / "checkpoints") == ["2", "4"]


def test_a_resume_under_other_model_math_exits_2_unless_asked(store, run, capsys, caplog):
  # Same parameter tree, another function: a sliding window switched on (DESIGN rule 1).
  code, out = run_main(args(store, run, 6, "--config.model.sliding_window=8"), capsys, caplog)
  assert_exit(code, out, 2, "model.sliding_window: 0 -> 8", "checkpoint.resume_new_model=True", "init_from")
  assert entries(run / "checkpoints") == ["2", "4"]
  # Asked for: it resumes at step 4, on the record; a key of how it is computed (the kernel) needs nothing.
  code, out = run_main(args(store, run, 6, "--config.model.sliding_window=8", "--config.model.attention=dot",
                            "--config.checkpoint.resume_new_model=True"), capsys, caplog)
  assert code == 0, out
  changes = [e for e in read_events(run / "events.jsonl") if e["kind"] == "resume_model_change"]
  assert [c["changes"] for c in changes] == [["model.sliding_window: 0 -> 8"]]
  assert entries(run / "checkpoints") == ["2", "4", "6"]


def test_resuming_a_dense_checkpoint_as_moe_blames_the_model(store, run, capsys, caplog):
  code, out = run_main(args(store, run, 6, "--config.model.moe.num_experts=4"), capsys, caplog)
  assert_exit(code, out, 2, "does not fit this model", "parameters differ", "blocks/", "vs model")
  assert "optimizer" not in out.split("does not fit this model")[0][-300:]
  assert entries(run / "checkpoints") == ["2", "4"]
