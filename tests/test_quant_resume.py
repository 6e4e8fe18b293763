"""FP8 training end to end (CPU emulation) through the real trainer: bitwise resume after SIGKILL (Muon),
 a checkpoint changing quantization at resume (none -> fp8 -> none, logged), and a bad scale
recipe (overflowing, unsaturated) that the guards skip instead of training on."""

import numpy as np
import pytest

from maxtrain.cli import train
from test_checkpoint import OPTIMIZERS, assert_bitwise_equal, flat, losses, restore_raw, trainer
from test_guards import kinds
from tiny import TINY_MODEL

# The tiny model's matmuls are 32..64 wide: min_dim 16 quantizes all of them.
FP8 = ["--config.model.quantization=fp8", "--config.model.quant_min_dim=16",
       "--config.model.quant_kinds=attention,mlp,head"]
BASE = TINY_MODEL + ["--config.eval.every_steps=0", "--config.log_every=1", "--config.mesh.fsdp=8",
                     "--config.optimizer.decay_steps=6"]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["muon"])  # fp8 keeps no scaling state, so the optimizer adds no new path;
def test_fp8_resume_after_sigkill_is_bitwise(store, tmp_path, optimizer):  # Muon's state is the larger one
  def run(name, *extra):
    return trainer(BASE + FP8 + OPTIMIZERS[optimizer] + [
        f"--config.data.path={store}", f"--config.output_dir={tmp_path / name}", "--config.steps=6",
        "--config.checkpoint.every_steps=3", *extra])

  straight = run("a")
  assert straight.returncode == 0, straight.stderr
  assert "fp8 on CPU: emulated" in straight.stderr
  killed = run("b", "--config.faults.kill_during_save_at_step=6")
  assert killed.returncode == -9, killed.stderr
  resumed = run("b", "--config.faults.kill_during_save_at_step=6")  # the fault fires once
  assert resumed.returncode == 0, resumed.stderr
  assert "restored step 3" in resumed.stderr and "quantization changes" not in resumed.stderr
  assert_bitwise_equal(restore_raw(tmp_path / "a/checkpoints", 6), restore_raw(tmp_path / "b/checkpoints", 6))
  assert losses(tmp_path / "b") == losses(tmp_path / "a")


@pytest.mark.slow
def test_quantization_can_change_at_resume_and_says_so(store, tmp_path):
  out = tmp_path / "run"

  def run(steps, *extra):
    return trainer(BASE + [f"--config.data.path={store}", f"--config.output_dir={out}", f"--config.steps={steps}",
                           "--config.checkpoint.every_steps=2", *extra])

  plain = run(2)
  assert plain.returncode == 0, plain.stderr
  to_fp8 = run(4, *FP8)
  assert to_fp8.returncode == 0, to_fp8.stderr
  assert "restored step 2" in to_fp8.stderr
  assert "the checkpoint trained with none, this run uses fp8 on attention,mlp,head" in to_fp8.stderr
  back = run(6)
  assert back.returncode == 0, back.stderr
  assert "the checkpoint trained with fp8 on attention,mlp,head, this run uses none" in back.stderr
  assert sorted(losses(out)) == list(range(1, 7)) and all(np.isfinite(list(losses(out).values())))


def test_overflowing_scale_recipe_is_skipped_by_the_guards(store, tmp_path):
  """margin -1 puts each tensor's amax above E4M3's max; unsaturated, it casts to NaN: every step's loss is
  NaN, the guards skip every update, and the parameters stay the initial ones."""
  out = tmp_path / "bad"
  args = BASE + FP8 + [f"--config.data.path={store}", f"--config.output_dir={out}", "--config.steps=3",
                       "--config.model.quant_margin=-1", "--config.model.quant_saturate=false",
                       "--config.checkpoint.every_steps=1", "--config.checkpoint.max_to_keep=0",
                       "--config.guards.max_consecutive_bad=10"]
  train.main(args)
  first, last = restore_raw(out / "checkpoints", 1), restore_raw(out / "checkpoints", 3)
  assert int(flat(last)["guard/skipped"]) == 3
  assert_bitwise_equal(first["params"], last["params"])
  assert_bitwise_equal(first["opt_state"], last["opt_state"])
  assert "nan_skip" in kinds(out)
