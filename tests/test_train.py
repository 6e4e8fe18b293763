"""The real entry point: a short run end to end, and bad input rejected with exit 2 before compiling."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from maxtrain import config as config_lib
from maxtrain.cli import train
from maxtrain.data.store import StoreWriter
from maxtrain.models.llama import CONFIG_KEYS, Llama, ModelConfig
from maxtrain.monitor import goodput
from maxtrain.monitor.events import read_events
from maxtrain.sharding.layout import check_divisible
from maxtrain.sharding.mesh import DCN_AXES
from maxtrain.program.plan import validate
from tiny import TINY_MODEL, cpu_env

REPO = Path(__file__).resolve().parent.parent
TINY = TINY_MODEL + ["--config.model.num_kv_heads=2", "--config.log_every=2"]  # GQA


def run_main(args, capsys):
  code = train.main(args)
  captured = capsys.readouterr()
  return code, captured.out + captured.err


def test_train_end_to_end_writes_tensorboard(store, tmp_path, capsys, caplog, monkeypatch):
  # Muon, WSD and z-loss here; AdamW, the default, goes through the same step in test_sharding.
  # A relative output_dir, like the default `runs/default`: checkpoints must still be written.
  monkeypatch.chdir(tmp_path)
  out = tmp_path / "run"
  code, output = run_main(TINY + [f"--config.data.path={store}", "--config.steps=6", "--config.eval.every_steps=3",
                                  "--config.optimizer.name=muon", "--config.optimizer.lr=0.02",
                                  "--config.optimizer.schedule=wsd", "--config.optimizer.warmup_steps=2",
                                  "--config.optimizer.z_loss=1e-4", "--config.output_dir=run",
                                  "--config.profile.start_step=3", "--config.profile.num_steps=2"], capsys)
  assert code == 0, output
  assert "optimizer muon: adam: 5 tensors" in caplog.text and "muon: 7 tensors" in caplog.text
  resolved = json.loads((out / "config.json").read_text())
  assert resolved["steps"] == 6 and resolved["model"]["d_model"] == 32
  events = EventAccumulator(str(out / "tensorboard"))
  events.Reload()
  tags = set(events.Tags()["scalars"])
  assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/step_time_s",
          "eval/loss"} <= tags
  assert {"train/mfu", "train/data_wait_s", "train/param_norm", "train/skipped_steps", "memory/host_in_use_gib", "checkpoint/blocking_s",
          "checkpoint/save_s"} <= tags
  assert all(0 < e.value < 1 for e in events.Scalars("train/mfu"))
  assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6]
  assert [e.step for e in events.Scalars("eval/loss")] == [3, 6]
  assert all(np.isfinite(e.value) for e in events.Scalars("train/loss"))
  for tag in ("train/update_norm/muon", "train/update_norm/adam", "train/z_loss", "train/adam_lr"):
    values = [e.value for e in events.Scalars(tag)]
    assert len(values) == 3 and all(np.isfinite(values)) and all(v > 0 for v in values), (tag, values)
  summary = json.loads((out / "summary.json").read_text())
  assert summary["steps"] == 6 and np.isfinite(summary["final_eval_loss"])
  assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["6"]
  assert "unigram entropy" in caplog.text
  # The profiler trace of steps 3-4 is in the TensorBoard log dir, for the profile plugin.
  assert list((out / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
  # The event log tells the run's story, and the goodput report accounts for its wall time.
  kinds = [r["kind"] for r in read_events(out / "events.jsonl")]
  for kind in ("job_start", "compile_start", "compile_end", "first_step", "steps", "eval",
               "checkpoint_save_start", "checkpoint_save_end", "exit"):
    assert kind in kinds, kind
  assert kinds[0] == "job_start" and kinds[-1] == "exit"
  report = goodput.compute(read_events(out / "events.jsonl"))
  assert report["steps"]["kept"] == 6 and report["steps"]["lost"] == 0
  assert sum(report["seconds"].values()) == pytest.approx(report["total_s"], rel=1e-9)
  assert report["seconds"]["other"] <= 0.01 * report["total_s"] + 0.5


def write_store(prefix, docs, vocab_size=259):
  with StoreWriter(prefix, vocab_size, "byte-v1") as writer:
    for doc in docs:
      writer.add(np.asarray(doc, np.int32))


@pytest.mark.parametrize("args, expected", [
    (["--config.model.num_layer=3"], "unknown config key config.model.num_layer. Did you mean config.model.num_layers"),
    (["--config.steps=ten"], "config.steps='ten': expected a int"),
    (["--config.mesh.data=3", "--config.mesh.fsdp=1"], "mesh: data(3) x fsdp(1) x tensor(1) = 3 devices, but 8"),
    (["--config.mesh.tensor=8", "--config.mesh.fsdp=1"], "config.model.num_heads=4 is not divisible by mesh.tensor=8"),
    (["--config.model.vocab_size=128"], "more than config.model.vocab_size=128"),
    (["--config=configs/nope.py"], "no such file"),
    (["--config.optimizer.name=adam"], "config.optimizer.name='adam': choose one of adamw, muon. Did you mean 'adamw'?"),
    (["--config.optimizer.schedule=linear"], "config.optimizer.schedule='linear': choose one of cosine, wsd, constant"),
    (["--config.optimizer.lr=0"], "config.optimizer.lr=0.0: out of range, must be a finite number > 0"),
    (["--config.optimizer.name=muon", "--config.optimizer.adam_lr=-1e-3"], "config.optimizer.adam_lr=-0.001: out of range"),
    (["--config.optimizer.muon_ns_dtype=float16"],
     "config.optimizer.muon_ns_dtype='float16': choose one of float32, bfloat16"),
    (["--config.optimizer.grad_accum_steps=3"],
     "config.optimizer.grad_accum_steps=3 does not divide the batch: data.batch_size=8 is 8 sequences per process"),
    (["--config.optimizer.grad_accum_steps=2"],  # 8 sequences over fsdp=8 shards: one per shard
     "and 1 per batch shard (data x fsdp = 8, mesh data=1 x fsdp=8 x tensor=1)"),
    (["--config.mesh.fsdp=2", "--config.mesh.data=4", "--config.optimizer.microbatch_size=3"],
     "config.optimizer.microbatch_size=3 does not divide the 1 sequences per batch shard"),
    (["--config.mesh.dcn_fsdp=3"], "mesh: data(1) x fsdp(-1) x tensor(1) x dcn_fsdp(3) cannot fill 8 devices"),
])
def test_bad_config_exits_2_before_compiling(store, tmp_path, capsys, args, expected):
  code, output = run_main(TINY + [f"--config.data.path={store}", f"--config.output_dir={tmp_path}"] + args, capsys)
  assert code == 2
  assert expected in output
  assert "compiled train step" not in output


def test_bad_token_stores_exit_2(store, tmp_path, capsys):
  # Missing store.
  code, output = run_main(TINY + [f"--config.data.path={tmp_path / 'missing'}"], capsys)
  assert code == 2 and "missing.train" in output
  # Truncated .bin.
  broken = tmp_path / "broken"
  for split in ("train", "val"):
    for ext in ("bin", "idx", "json"):
      (tmp_path / f"broken.{split}.{ext}").write_bytes(Path(f"{store}.{split}.{ext}").read_bytes())
  with open(f"{broken}.train.bin", "r+b") as f:
    f.truncate(100)
  code, output = run_main(TINY + [f"--config.data.path={broken}"], capsys)
  assert code == 2 and "broken.train.bin" in output
  # Empty corpus: valid stores without a single training window.
  empty = tmp_path / "empty"
  write_store(f"{empty}.train", [])
  write_store(f"{empty}.val", [[1, 2, 3]])
  code, output = run_main(TINY + [f"--config.data.path={empty}", f"--config.output_dir={tmp_path}"], capsys)
  assert code == 2 and "empty.train" in output
  # The attempt opened the event log before the loader found the store empty: it still ends with an exit record.
  assert [(r["kind"], r.get("code")) for r in read_events(tmp_path / "events.jsonl")][-1] == ("exit", 2)


def test_entry_point_exit_code_in_a_fresh_process(tmp_path):
  env = cpu_env(8)
  proc = subprocess.run([sys.executable, "-m", "maxtrain.train", "--config.model.d_modle=64"],
                        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1].startswith("maxtrain: error: unknown config key config.model.d_modle")


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.py")), ids=lambda p: p.name)
def test_shipped_configs_parse_and_validate(path):
  """Every config file, alone and with each hardware preset it lists (and cpu), validates on one node (a
  multi-node preset: on its fewest nodes)."""
  _, model_presets = config_lib.load_file(path)
  for name in ["", *sorted({"cpu", *model_presets})]:
    cfg = config_lib.load([f"--config={path}", f"--config.hardware={name}"] if name else [f"--config={path}"])
    node = math.prod(max(1, cfg.mesh[a]) for a in ("data", "fsdp", "expert", "context", "tensor", "pipeline")
                     if a in cfg.mesh) if cfg.mesh.fsdp != -1 else 8
    nodes = math.prod(max(1, cfg.mesh[a]) for a in DCN_AXES)  # a multi-node preset: its fewest nodes
    plan = validate(cfg, num_devices=node * nodes, require_data=bool(cfg.data.corpus or cfg.data.path))
    # The model is built abstractly and its parameters divide over the layout.
    abstract = nnx.state(nnx.eval_shape(lambda: Llama(ModelConfig.from_config(cfg.model), rngs=nnx.Rngs(0))))
    check_divisible(abstract, plan.layout, CONFIG_KEYS)
