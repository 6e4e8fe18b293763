"""Checkpoints: bitwise resume (normal end and SIGTERM), resharding restore, SIGKILL during a save,
and bad checkpoint input. Trainer runs are real subprocesses of `python -m maxtrain.train`."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from maxtrain import config as config_lib
from maxtrain.optim import optimizer as optim
from maxtrain.program import state as state_lib
from maxtrain.cli import train
from maxtrain.errors import EXIT_PREEMPTED
from maxtrain.checkpoint.storage import Checkpointer
from maxtrain.models.llama import ModelConfig
from maxtrain.sharding.mesh import make_mesh
from tiny import TINY_MODEL, cpu_env

REPO = Path(__file__).resolve().parent.parent
TINY = TINY_MODEL + ["--config.eval.every_steps=0", "--config.log_every=1", "--config.checkpoint.every_steps=4"]
MESHES = {
    "1 device": (1, ["--config.mesh.fsdp=1"]),
    "fsdp=4 x tensor=2": (8, ["--config.mesh.fsdp=4", "--config.mesh.tensor=2"]),
    # The circular pipeline through the entry point: 2 stages of 1 layer, 2 microbatches.
    "pipeline=2 x fsdp=2 x tensor=2": (8, ["--config.mesh.pipeline=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
                                          "--config.pipeline.microbatches=2"]),
}


def trainer(args, devices=8) -> subprocess.CompletedProcess:
  env = cpu_env(devices)
  return subprocess.run([sys.executable, "-m", "maxtrain.train", *args], capture_output=True, text=True,
                        env=env, timeout=300, cwd=REPO)


def restore_raw(ckpt_dir: Path, step: int):
  """The saved TrainState as host arrays, whatever devices saved it (restored onto one device)."""
  path = ckpt_dir / str(step)
  meta = ocp.StandardCheckpointer().metadata(path / "state").item_metadata
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), meta,
                        is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
  restored = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
      path, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
  return jax.tree.map(np.asarray, restored.state)


def flat(tree) -> dict[str, np.ndarray]:
  """Leaves by a path of plain names, so a TrainState and the raw restored dicts compare."""
  def name(k):
    return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))

  return {"/".join(name(k) for k in path if name(k) != "value"): np.asarray(leaf)
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def assert_bitwise_equal(a, b):
  flat_a, flat_b = flat(a), flat(b)
  assert sorted(flat_a) == sorted(flat_b)
  for key, x in flat_a.items():
    y = flat_b[key]
    assert x.dtype == y.dtype and x.shape == y.shape, key
    assert x.tobytes() == y.tobytes(), f"{key} differs"


def losses(out: Path) -> dict[int, float]:
  events = EventAccumulator(str(out / "tensorboard"))
  events.Reload()
  return {e.step: e.value for e in events.Scalars("train/loss")}


OPTIMIZERS = {"adamw": [], "muon": ["--config.optimizer.name=muon", "--config.optimizer.lr=0.02"]}


# Two mesh x optimizer pairs: each optimizer once, and the pipelined, sharded mesh with Muon, whose per-stage
# Newton-Schulz state is the harder one to restore; that mesh also shards over fsdp and tensor (other pairs add
# five trainer starts each and no new path).
@pytest.mark.slow
@pytest.mark.parametrize("mesh,optimizer", [("1 device", "adamw"), ("pipeline=2 x fsdp=2 x tensor=2", "muon")])
def test_resume_is_bitwise_identical(store, tmp_path, mesh, optimizer):
  devices, mesh_args = MESHES[mesh]
  base = TINY + mesh_args + OPTIMIZERS[optimizer] + [f"--config.data.path={store}"]
  # B's first process stops at step 4 of the same 8-step LR schedule (optimizer.decay_steps).

  def run(name, steps, *extra):
    return trainer(base + [f"--config.output_dir={tmp_path / name}", f"--config.steps={steps}", *extra], devices)

  a = run("a", 8)
  assert a.returncode == 0, a.stderr
  # B: stops at the end of step 4, then a second process resumes and trains to 8.
  b1, b2 = run("b", 4, "--config.optimizer.decay_steps=8"), run("b", 8)
  assert b1.returncode == 0 and b2.returncode == 0, b1.stderr + b2.stderr
  assert "restored step 4" in b2.stderr
  # C: SIGTERM after step 4 -> checkpoint + exit 75; the restart trains to 8.
  c1 = run("c", 8, "--config.faults.sigterm_at_step=4")
  assert c1.returncode == EXIT_PREEMPTED, c1.stderr
  assert "stopped by SIGTERM after step 4" in c1.stderr
  assert sorted(int(p.name) for p in (tmp_path / "c/checkpoints").iterdir() if p.name.isdigit()) == [4]
  c2 = run("c", 8, "--config.faults.sigterm_at_step=4")  # fault already fired: does not fire again
  assert c2.returncode == 0, c2.stderr
  assert "restored step 4" in c2.stderr and "first step (5) done" in c2.stderr

  final_a = restore_raw(tmp_path / "a/checkpoints", 8)
  for other in ("b", "c"):
    assert_bitwise_equal(final_a, restore_raw(tmp_path / other / "checkpoints", 8))
    # Same loss at every step, resumed steps included: the resumed run saw the same batches.
    assert losses(tmp_path / other) == losses(tmp_path / "a")
  assert sorted(losses(tmp_path / "a")) == list(range(1, 9))


def test_restore_reshards_onto_other_meshes(store, tmp_path):
  out = tmp_path / "run"
  code = train.main(TINY + ["--config.mesh.fsdp=8", f"--config.data.path={store}", "--config.steps=2",
                            f"--config.output_dir={out}"])
  assert code == 0
  cfg = config_lib.load(TINY)
  model_cfg = ModelConfig.from_config(cfg.model)
  tx = optim.make(cfg.optimizer, 2).tx
  saved = restore_raw(out / "checkpoints", 2)
  ckpt = Checkpointer(cfg.checkpoint, str(out / "checkpoints"))
  for sizes, devices in (({"data": 2, "fsdp": 1, "tensor": 4}, jax.devices()),
                         ({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])):
    mesh = make_mesh(sizes, devices)
    spec = state_lib.spec(model_cfg, tx, mesh, seed=0)
    restored = ckpt.restore(out / "checkpoints" / "2", spec.abstract, spec.shardings)
    assert restored.step == 2 and restored.meta["mesh"] == {"pipeline": 1, "data": 1, "fsdp": 8, "expert": 1, "context": 1,
                                                                 "tensor": 1}
    wq = restored.state.params["blocks"]["attn"]["wq"][...]
    assert wq.sharding.mesh.shape == mesh.shape
    assert_bitwise_equal(jax.tree.map(np.asarray, restored.state), saved)
  ckpt.close()


@pytest.mark.slow
def test_sigkill_during_save_resumes_from_previous_checkpoint(store, tmp_path):
  args = TINY + ["--config.mesh.fsdp=8", f"--config.data.path={store}", "--config.steps=10",
                 f"--config.output_dir={tmp_path}", "--config.checkpoint.every_steps=3",
                 "--config.faults.kill_during_save_at_step=6"]
  killed = trainer(args)
  assert killed.returncode == -9
  ckpt_dir = tmp_path / "checkpoints"
  complete = [p.name for p in ckpt_dir.iterdir() if p.name.isdigit()]
  assert complete == ["3"], sorted(os.listdir(ckpt_dir))
  resumed = trainer(args)
  assert resumed.returncode == 0, resumed.stderr
  assert "restored step 3" in resumed.stderr
  assert {"3", "6", "9", "10"} <= set(os.listdir(ckpt_dir)) | {"3"}  # 3 may be rotated out by max_to_keep
  assert sorted(losses(tmp_path))[-1] == 10


def test_bad_checkpoint_input_exits_2(store, tmp_path, capsys):
  out = tmp_path / "run"
  base = TINY + ["--config.mesh.fsdp=8", f"--config.data.path={store}", f"--config.output_dir={out}"]
  assert train.main(base + ["--config.steps=4"]) == 0
  capsys.readouterr()

  def bad(*args):
    code = train.main(base + list(args))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "compiled train step" not in err
    return err

  assert "no complete checkpoint at step 7" in bad("--config.checkpoint.resume=7") and "found steps [4]" in bad(
      "--config.checkpoint.resume=7")
  err = bad("--config.model.d_model=64", "--config.steps=8")
  assert "does not fit this model" in err and "blocks/attn/wq: checkpoint [2, 32, 4, 8] vs model [2, 64, 4, 16]" in err
  assert "is not writable" in bad("--config.checkpoint.dir=/proc/maxtrain-ckpt")
  assert "already holds checkpoints at steps [4]" in bad("--config.checkpoint.resume=never")
  assert "not a complete maxtrain checkpoint" in bad(f"--config.checkpoint.resume={tmp_path}")


def test_rerunning_a_finished_run_trains_nothing(store, tmp_path, caplog):
  args = TINY + ["--config.mesh.fsdp=8", f"--config.data.path={store}", f"--config.output_dir={tmp_path}",
                 "--config.steps=2"]
  assert train.main(args) == 0
  caplog.clear()
  assert train.main(args) == 0
  assert "already at step 2 of 2: nothing to train" in caplog.text
  assert "compiled train step" not in caplog.text and "eval loss" in caplog.text


@pytest.fixture()
def s3_server(monkeypatch):
  """A real S3-compatible server (moto) on localhost, with the standard AWS variables pointing at it."""
  import boto3
  from moto.server import ThreadedMotoServer

  server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
  server.start()
  host, port = server.get_host_and_port()
  for key, value in {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test",
                     "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}.items():
    monkeypatch.setenv(key, value)
  client = boto3.client("s3")
  client.create_bucket(Bucket="ckpts")
  yield client
  server.stop()


def test_s3_round_trip(store, tmp_path, s3_server):
  out = tmp_path / "run"
  base = TINY + ["--config.mesh.fsdp=8", f"--config.data.path={store}", f"--config.output_dir={out}",
                 "--config.checkpoint.dir=s3://ckpts/runs/one", "--config.checkpoint.every_steps=2",
                 "--config.checkpoint.max_to_keep=2", "--config.optimizer.decay_steps=6"]
  assert train.main(base + ["--config.steps=4"]) == 0
  keys = {o["Key"] for o in s3_server.list_objects_v2(Bucket="ckpts", Prefix="runs/one/")["Contents"]}
  assert {"runs/one/2/_MAXTRAIN_COMPLETE", "runs/one/4/_MAXTRAIN_COMPLETE"} <= keys
  assert any(k.startswith("runs/one/4/state/") for k in keys)
  uploaded = restore_raw(out / "checkpoints", 4)

  # A new machine: the local staging copy is gone; the run resumes from object storage.
  import shutil
  shutil.rmtree(out / "checkpoints")
  assert train.main(base + ["--config.steps=6"]) == 0
  assert_bitwise_equal(restore_raw(out / "checkpoints", 4), uploaded)
  keys = {o["Key"] for o in s3_server.list_objects_v2(Bucket="ckpts", Prefix="runs/one/")["Contents"]}
  markers = sorted(k for k in keys if k.endswith("_MAXTRAIN_COMPLETE"))
  assert markers == ["runs/one/4/_MAXTRAIN_COMPLETE", "runs/one/6/_MAXTRAIN_COMPLETE"]  # max_to_keep=2
  assert not any(k.startswith("runs/one/2/") for k in keys)


def test_unreachable_bucket_exits_2(store, tmp_path, s3_server, capsys):
  code = train.main(TINY + ["--config.mesh.fsdp=8", f"--config.data.path={store}", f"--config.output_dir={tmp_path}",
                            "--config.checkpoint.dir=s3://no-such-bucket/x"])
  assert code == 2
  assert "bucket 'no-such-bucket' is not reachable" in capsys.readouterr().err


# A real write failure (EFBIG, like a full disk): files may not grow past 100 kB, which the
# checkpoint's tensor files exceed while logs and TensorBoard events stay below it. Set in a tiny
# launcher that then execs the trainer (limits and ignored signals survive exec), not in a
# preexec_fn, which would run Python between fork and exec in a multithreaded process.
LIMITED = ("import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
           "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000)); "
           "os.execv(sys.executable, [sys.executable, '-m', 'maxtrain.train', *sys.argv[1:]])")


@pytest.mark.slow
def test_failed_saves_keep_the_last_good_checkpoint(store, tmp_path):
  args = TINY + ["--config.mesh.fsdp=1", f"--config.data.path={store}", f"--config.output_dir={tmp_path}",
                 "--config.checkpoint.every_steps=2", "--config.optimizer.decay_steps=6"]
  env = cpu_env(1)
  first = trainer(args + ["--config.steps=2"], devices=1)
  assert first.returncode == 0, first.stderr
  good = restore_raw(tmp_path / "checkpoints", 2)
  limited = subprocess.run([sys.executable, "-c", LIMITED, *args, "--config.steps=6"], capture_output=True,
                           text=True, env=env, timeout=300, cwd=REPO)
  assert "checkpoint save at step 4 failed" in limited.stderr and "File too large" in limited.stderr
  assert "step 6/6" in limited.stderr  # training went on after the failed save
  assert limited.returncode == 1 and "the final checkpoint (step 6) could not be written" in limited.stderr
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
  assert_bitwise_equal(restore_raw(tmp_path / "checkpoints", 2), good)
  resumed = trainer(args + ["--config.steps=6"], devices=1)
  assert resumed.returncode == 0 and "restored step 2" in resumed.stderr, resumed.stderr
