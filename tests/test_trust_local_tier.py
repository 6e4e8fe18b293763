"""Trust (issue 37), the local checkpoint tier: it follows the durable tier's rules. A local step carries its
run's identity and is used (restored, promoted, rotated) only by that run; one live trainer per local
directory; a step without a manifest is corrupt, never "verified" nor promoted; all local steps corrupt with
no durable step is exit 2 unless `checkpoint.start_over_if_corrupt`; resume=N, symlinked steps, leftover
temporary folders and an unusable `local_dir` behave as in the durable tier.

Each case asserts the exit code, no traceback, the culprit named and what both tiers hold after. One run,
killed after step 5 with a local save every step (local steps 1-4 and no durable step), is put back in place
before each case (a local step's identity includes its run's absolute directories, so copies would be
another run's). Trainers run as `python -m maxtrain.train` where the case is about the process (a kill,
what reaches stderr), in-process `train.main` where it exits 2 before compiling.
"""

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from maxtrain.checkpoint import manifest
from maxtrain.monitor.events import read_events
from test_trust import REPO, TINY, assert_exit, run_main, run_process, trainer_process

LOCAL_EVERY_STEP = ["--config.checkpoint.local_every_steps=1", "--config.checkpoint.every_steps=100",
                    "--config.checkpoint.local_max_to_keep=0"]  # 0: keeps all, as checkpoint.max_to_keep=0


def args(store, out: Path, local: Path, steps: int, *extra: str) -> list[str]:
  return TINY + LOCAL_EVERY_STEP + [f"--config.data.path={store}", f"--config.output_dir={out}",
                                    f"--config.checkpoint.local_dir={local}", f"--config.steps={steps}", *extra]


def listing(directory: Path) -> list[str]:
  """Step-like entries (steps, and the ones moved aside), sorted."""
  return sorted(p.name for p in directory.iterdir() if p.name[0].isdigit()) if directory.is_dir() else []


def fingerprint(directory: Path) -> dict[str, bytes]:
  return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def steps_of(local: Path) -> dict[str, dict[str, bytes]]:
  p0 = local / "process_0"
  return {name: fingerprint(p0 / name) for name in listing(p0)}


def restores(out: Path) -> list[tuple[str, int]]:
  return [(r["tier"], r["step"]) for r in read_events(out / "events.jsonl") if r["kind"] == "restore"]


def flip(path: Path) -> None:
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0xFF
  path.write_bytes(bytes(data))


def cut_in_half(path: Path) -> None:
  os.truncate(path, path.stat().st_size // 2)


def run(argv) -> tuple[int, str]:
  code, out, err = run_process(argv)
  return code, out + err


def copy_store(store: str, prefix: str) -> None:
  for name in Path(store).parent.iterdir():
    if name.name.startswith(Path(store).name + "."):
      shutil.copyfile(name, prefix + name.name[len(Path(store).name):])


@pytest.fixture(scope="module")
def data(store, tmp_path_factory) -> str:
  """This module's copy of the token store (a case replaces its tokens; `run_a` puts them back)."""
  prefix = str(tmp_path_factory.mktemp("data") / "code")
  copy_store(store, prefix)
  return prefix


@pytest.fixture(scope="module")
def killed_run(data, tmp_path_factory) -> tuple[Path, Path, Path]:
  root = tmp_path_factory.mktemp("local_tier")
  a, local = root / "a", root / "L"
  code, output = run(args(data, a, local, 6, "--config.faults.kill_at_step=5"))
  assert code == -9, output[-3000:]
  assert listing(local / "process_0") == ["1", "2", "3", "4"] and listing(a / "checkpoints") == []
  pristine = root / "pristine"
  for d in (a, local):
    shutil.copytree(d, pristine / d.name, symlinks=True)
  return a, local, pristine


@pytest.fixture
def run_a(killed_run, store, data) -> tuple[Path, Path]:
  """Run a, killed after step 5 (local steps 1-4), in place as it was left, on its data."""
  a, local, pristine = killed_run
  copy_store(store, data)
  for d in (a, local):
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(pristine / d.name, d, symlinks=True)
  return a, local


def test_another_run_never_restores_nor_promotes_a_local_step(data, run_a, tmp_path):
  """Case 1: run b (another output_dir, another lr) on run a's local_dir starts fresh and leaves a's steps alone;
  run a restarted as it was resumes its own newest local step and promotes it. A leftover temporary folder
  of a save cut short is removed, never a step."""
  a, local = run_a
  before = steps_of(local)
  leftover = local / "process_0" / "5.orbax-checkpoint-tmp-1764806400"
  leftover.mkdir()
  b = tmp_path / "b"
  code, output = run(args(data, b, local, 3, "--config.optimizer.lr=3e-3",
                          "--config.checkpoint.local_every_steps=100"))  # no local save of b's: a's steps as they were
  assert_exit(code, output, 0, f"process_0/4 not used: another run's (output_dir {a.resolve()}",
              "resume: the local tier holds no usable step")
  assert restores(b) == [] and listing(b / "checkpoints") == ["3"]  # its own final step; nothing promoted
  assert steps_of(local) == before and not leftover.exists()  # a's steps untouched
  code, output = run(args(data, a, local, 6))
  assert_exit(code, output, 0, "resume: local step 4 is complete and verified on all 1 processes")
  assert restores(a) == [("local", 4)] and listing(a / "checkpoints") == ["4", "6"]
  assert manifest.verify(a / "checkpoints" / "4").verified
  assert listing(local / "process_0") == ["1", "2", "3", "4", "5"]  # keep=0; 6 went to the durable tier


def test_two_live_trainers_on_one_local_dir_the_second_exits_2(store, tmp_path, capsys, caplog):
  """Case 2: the second trainer (another output_dir) exits 2 naming the holder, and writes nothing there."""
  local = tmp_path / "L"
  first = trainer_process(args(store, tmp_path / "first", local, 100000))
  try:
    lock, deadline = local / "process_0" / ".maxtrain.lock", time.monotonic() + 300
    while not (lock.exists() and f'"pid": {first.pid}' in lock.read_text()):
      if first.poll() is not None or time.monotonic() > deadline:
        first.kill()
        pytest.fail(f"the first trainer did not take the local tier's lock: {first.communicate()[1][-3000:]}")
      time.sleep(0.2)
    code, output = run_main(args(store, tmp_path / "second", local, 2), capsys, caplog)
    assert_exit(code, output, 2, f"checkpoint.local_dir={local / 'process_0'} is in use by another trainer",
                f"pid {first.pid}")
    assert listing(tmp_path / "second" / "checkpoints") == []
    for step in listing(local / "process_0"):  # every local step is the first trainer's
      meta = json.loads((local / "process_0" / step / "meta.json").read_text())
      assert meta["identity"]["output_dir"] == str((tmp_path / "first").resolve())
  finally:
    first.kill()
    first.wait()


def test_a_local_step_without_its_manifest_is_moved_aside_and_never_promoted(data, run_a):
  """Case 3: the newest local step's manifest deleted and a byte of its state flipped: before, restored,
  logged "complete and verified" and promoted with a fresh manifest. Now corrupt: moved aside (an event),
  the next older step restored and promoted."""
  a, local = run_a
  newest = local / "process_0" / "4"
  (newest / manifest.MANIFEST_NAME).unlink()
  flip(newest / "state.bin")
  damaged = fingerprint(newest)
  code, output = run(args(data, a, local, 6))
  assert_exit(code, output, 0, "process_0/4 is corrupt: maxtrain_manifest.json: missing",
              "resume: local step 3 is complete and verified")
  assert "local step 4 is complete" not in output
  moved = [n for n in listing(local / "process_0") if n.startswith("4.corrupt-")]
  assert len(moved) == 1 and fingerprint(local / "process_0" / moved[0]) == damaged
  assert restores(a) == [("local", 3)] and listing(a / "checkpoints") == ["3", "6"]  # 3 promoted, never 4
  corrupt = [(r["step"], r["tier"], r["file"]) for r in read_events(a / "events.jsonl")
             if r["kind"] == "checkpoint_corrupt"]
  assert corrupt == [(4, "local", manifest.MANIFEST_NAME)]


def test_a_local_step_is_promoted_only_once_the_run_accepted_it(data, run_a):
  """Run a's data store now holds other tokens (rebuilt at the same path): the restored local step's data
  state is refused (exit 2). Before, the step had already been promoted into the durable tier by then."""
  from maxtrain.data.indexing import index_files

  a, local = run_a
  before = steps_of(local)
  index_files([str(REPO / "maxtrain" / "checkpoint")], data, val_fraction=0.2, workers=1, progress=False)
  code, output = run(args(data, a, local, 6))
  assert_exit(code, output, 2, data, "tokens, the checkpoint's store held")
  assert restores(a) == [("local", 4)] and listing(a / "checkpoints") == []  # restored, refused, never promoted
  assert steps_of(local) == before


def test_all_local_steps_corrupt_and_no_durable_step_is_exit_2_unless_told_to_start_over(data, run_a):
  """Case 3: every local step damaged (a manifest deleted and a byte flipped, a manifest deleted and the state
  cut in half, the state cut in half, the index changed) and no durable step: before, a silent fresh start
  (and a cut file without its manifest a traceback). Now exit 2 naming each, nothing moved; with
  start_over_if_corrupt, all moved aside and a fresh start."""
  a, local = run_a
  p0 = local / "process_0"
  (p0 / "4" / manifest.MANIFEST_NAME).unlink()
  flip(p0 / "4" / "state.bin")
  (p0 / "3" / manifest.MANIFEST_NAME).unlink()
  cut_in_half(p0 / "3" / "state.bin")
  cut_in_half(p0 / "2" / "state.bin")
  flip(p0 / "1" / "index.json")
  damaged = steps_of(local)
  code, output = run(args(data, a, local, 6))
  assert_exit(code, output, 2, "no local step verifies (steps [4, 3, 2, 1]", "checkpoint.start_over_if_corrupt",
              "process_0/4 is corrupt: maxtrain_manifest.json: missing",
              "process_0/3 is corrupt: maxtrain_manifest.json",
              "process_0/2 is corrupt: state.bin: size", "process_0/1 is corrupt: index.json")
  assert steps_of(local) == damaged and listing(a / "checkpoints") == []
  code, output = run(args(data, a, local, 2, "--config.checkpoint.start_over_if_corrupt=True"))
  assert_exit(code, output, 0, "a fresh start")
  names = listing(p0)
  assert sorted(n.split(".")[0] for n in names if ".corrupt-" in n) == ["1", "2", "3", "4"]
  assert [n for n in names if "." not in n] == ["1"] and restores(a) == [] and listing(a / "checkpoints") == ["2"]


def test_resume_n_and_symlinked_local_steps_follow_the_durable_rules(data, run_a, capsys, caplog):
  """resume=N while this run's local tier holds newer steps: exit 2 naming them, nothing moved; a symlinked
  local step: exit 2 (rotation would delete through it); resume=N with checkpoint.branch: the newer local steps
  moved aside (an event) and local step N, which the durable tier does not hold, restored (and promoted)."""
  a, local = run_a
  before = steps_of(local)
  code, output = run_main(args(data, a, local, 6, "--config.checkpoint.resume=2"), capsys, caplog)
  assert_exit(code, output, 2, "checkpoint.resume=2", "newer local steps [3, 4]", "checkpoint.branch=True")
  assert steps_of(local) == before
  (local / "process_0" / "7").symlink_to(local / "process_0" / "4")
  code, output = run_main(args(data, a, local, 6), capsys, caplog)
  assert_exit(code, output, 2, f"checkpoint.local_dir={local}", "process_0/7 is a symlink")
  assert listing(local / "process_0") == ["1", "2", "3", "4", "7"] and listing(a / "checkpoints") == []
  (local / "process_0" / "7").unlink()
  code, output = run(args(data, a, local, 4, "--config.checkpoint.resume=2", "--config.checkpoint.branch=True"))
  assert_exit(code, output, 0, "newer local steps [3, 4] moved aside")
  assert restores(a) == [("local", 2)] and listing(a / "checkpoints") == ["2", "4"]  # 2 held only locally
  names = listing(local / "process_0")
  assert [n for n in names if "." not in n] == ["1", "2", "3"]  # the branch's own 3 (4 went to the durable tier)
  assert sorted(n.split(".")[0] for n in names if ".branched-" in n) == ["3", "4"]
  branch = [(r["step"], r["newer_steps"], r["tier"]) for r in read_events(a / "events.jsonl")
            if r["kind"] == "checkpoint_branch"]
  assert branch == [(2, [3, 4], "local")]


def test_an_unusable_local_dir_exits_2_naming_it(store, tmp_path, capsys, caplog):
  """Case 13: under a regular file, or in the proc filesystem: before, a traceback."""
  regular = tmp_path / "file"
  regular.write_text("not a directory")
  for local in (regular / "L", Path("/proc/maxtrain-local")):
    code, output = run_main(args(store, tmp_path / "run", local, 2), capsys, caplog)
    assert_exit(code, output, 2, f"checkpoint.local_dir={local} is not writable")
    assert "compiled train step" not in output
  assert regular.read_text() == "not a directory" and listing(tmp_path / "run" / "checkpoints") == []
