"""Smoke tests: every entry point starts, every shipped config loads and validates, and one resume is
bitwise. They need only the package and pytest (no test extras), so `.ci/run` also runs them on
Python 3.12 with the newest jax the dependency ranges allow: API drift shows up in CI."""

import math
import subprocess
import sys

import pytest

from maxtrain import config as config_lib
from maxtrain.program.plan import validate
from test_checkpoint import REPO, assert_bitwise_equal, restore_raw, trainer
from tiny import TINY_MODEL

CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.py"))
ENTRY_POINTS = {"train": "usage: python -m maxtrain.train", "launch": "usage: python -m maxtrain.launch",
                "compile": "python -m maxtrain.compile", "convert": "usage: python -m maxtrain.convert",
                "generate": "usage: python -m maxtrain.generate", "eval": "usage: python -m maxtrain.eval"}


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_entry_point_starts(module):
  proc = subprocess.run([sys.executable, "-m", f"maxtrain.{module}", "--help"], cwd=REPO, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert ENTRY_POINTS[module] in proc.stdout


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_config_loads_and_validates(name):
  """On the devices its hardware preset describes (one node, or a multi-node preset's fewest nodes), or the
  CPU's 8 test devices."""
  cfg = config_lib.load([f"--config=configs/{name}"])
  sizes = [cfg.mesh[k] for k in ("data", "fsdp", "tensor", "context", "expert", "pipeline") if k in cfg.mesh]
  nodes = math.prod(max(1, cfg.mesh[k]) for k in ("dcn_pipeline", "dcn_data", "dcn_fsdp") if k in cfg.mesh)
  devices = 8 if -1 in sizes else math.prod(sizes) * nodes  # a multi-node preset: its fewest nodes
  plan = validate(cfg, devices, require_data=False)
  assert plan.batch.global_size == cfg.data.batch_size


def test_resume_is_bitwise(store, tmp_path):
  """Four steps in one process equal two steps, a restart, and two more, bit for bit."""
  base = TINY_MODEL + ["--config.mesh.fsdp=1", "--config.eval.every_steps=0", "--config.checkpoint.every_steps=2",
                       f"--config.data.path={store}", "--config.optimizer.decay_steps=4"]

  def run(name: str, steps: int) -> subprocess.CompletedProcess:
    return trainer(base + [f"--config.output_dir={tmp_path / name}", f"--config.steps={steps}"], devices=1)

  straight = run("straight", 4)
  first, resumed = run("resumed", 2), run("resumed", 4)
  assert straight.returncode == first.returncode == resumed.returncode == 0, straight.stderr + resumed.stderr
  assert "restored step 2" in resumed.stderr
  assert_bitwise_equal(restore_raw(tmp_path / "straight" / "checkpoints", 4),
                       restore_raw(tmp_path / "resumed" / "checkpoints", 4))

