"""Two JAX processes on localhost (2 x 4 CPU devices, jax.distributed over gloo) train exactly like
one process with 8 devices, the two-level (per-node x across-node) mesh included."""

import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from test_checkpoint import TINY, flat, losses, restore_raw
from tiny import cpu_env

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start(args, devices, **env) -> subprocess.Popen:
  env = cpu_env(devices, **env)
  return subprocess.Popen([sys.executable, "-m", "maxtrain.train", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)


@pytest.mark.slow
def test_two_processes_match_one(store, tmp_path):
  # Adam eps=1e-2 (test_sharding.opt_config's reasoning): at the default 1e-8 a gradient entry near 1e-8 (a rare
  # token's embedding row) turns the fp32 reduction-order noise of 2 processes vs 1 into an O(1) change of its
  # update (one of 12288 embed entries moved 5.8e-7 on one CPU); at 1e-2 Adam's slope in g is at most 100.
  base = TINY + ["--config.mesh.fsdp=-1", f"--config.data.path={store}", "--config.steps=4",
                 "--config.checkpoint.every_steps=0", "--config.optimizer.eps=1e-2"]
  single = start(base + [f"--config.output_dir={tmp_path / 'one'}"], devices=8)
  port = free_port()
  # The two processes stand for two nodes: FSDP over 4 devices inside each x 2 across them (mesh.dcn_fsdp).
  procs = [start(base + [f"--config.output_dir={tmp_path / 'two'}", "--config.mesh.fsdp=4", "--config.mesh.dcn_fsdp=2",
                         "--config.runtime.num_processes=2",
                         f"--config.runtime.process_id={i}", f"--config.runtime.coordinator=127.0.0.1:{port}"],
                 devices=4) for i in range(2)]
  outputs = [p.communicate(timeout=600)[0] for p in [single, *procs]]
  for p, out in zip([single, *procs], outputs):
    assert p.returncode == 0, out[-3000:]
  assert "process 1 of 2" in outputs[2] and "8 global devices" in outputs[2]

  one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
  assert sorted(one) == sorted(two) == [1, 2, 3, 4]
  np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(one)], rtol=1e-6)
  final_one, final_two = flat(restore_raw(tmp_path / "one/checkpoints", 4)), flat(restore_raw(tmp_path / "two/checkpoints", 4))
  assert sorted(final_one) == sorted(final_two)
  for key in final_one:
    np.testing.assert_allclose(final_two[key], final_one[key], rtol=1e-5, atol=1e-7, err_msg=key)


def one_and_two(args: list[str], out: Path) -> list[subprocess.Popen]:
  """`args` in one process of 4 CPU devices (out/one) and in 2 processes x 2 of one jax.distributed job (out/two)."""
  env = {"PYTHONPATH": f"{Path(__file__).parent}:{REPO}"}
  port = free_port()
  run = lambda extra, devices: subprocess.Popen([sys.executable, "-m", "maxtrain.train", *args, *extra],  # noqa: E731
                                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                                env=cpu_env(devices, **env), cwd=REPO)
  return [run([f"--config.output_dir={out / 'one'}"], 4)] + [
      run([f"--config.output_dir={out / 'two'}", "--config.runtime.num_processes=2", f"--config.runtime.process_id={i}",
           f"--config.runtime.coordinator=127.0.0.1:{port}"], 2) for i in range(2)]


@pytest.mark.slow
def test_post_training_over_two_processes_matches_one(tmp_path):
  """Synchronous GRPO and SFT with the trainer's mesh over 2 processes x 2 CPU devices are the one-process
  runs on 4: every process builds the whole batch (SFT's rows; the round's prompts, seeds and completions)
  and places only its devices' slices (`program/batch.py` global_to_device); the generator's and the
  log-prob passes' outputs come back whole on every process (to_host). GRPO: the same completions, the
  losses and round-2 parameters to rtol 1e-5 (not bitwise: the reductions span 2 processes; measured
  1.1e-6). SFT: the losses to rtol 1e-5 (bitwise when measured). Before the fix each process's copy of the
  batch counted as its own rows (a batch 2x too large: SFT crashed) and the rollout crashed reading
  non-addressable tokens."""
  from test_grpo import RUN_ARGS, rounds
  from tiny import TINY_MODEL

  # Adam eps=1e-2: test_two_processes_match_one's reasoning (fp32 reduction-order noise near eps)
  common = ["--config.mesh.fsdp=-1", "--config.optimizer.eps=1e-2", "--config.steps=2"]
  sft = [f"--config={REPO / 'configs/sft.py'}", *TINY_MODEL, *common, "--config.optimizer.name=adamw",
         "--config.optimizer.warmup_steps=0", "--config.eval.every_steps=0", "--config.log_every=1",
         "--config.checkpoint.every_steps=0", "--config.post.eval_prompts=0"]
  procs = one_and_two(RUN_ARGS + common, tmp_path / "rl") + one_and_two(sft, tmp_path / "sft")
  outputs = [p.communicate(timeout=600)[0] for p in procs]
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
  assert "process 1 of 2" in outputs[2] and "4 global devices" in outputs[2]

  rl = tmp_path / "rl"
  assert rounds(rl / "two") == rounds(rl / "one")  # prompts, completions, rewards
  for run in (rl, tmp_path / "sft"):
    one, two = losses(run / "one"), losses(run / "two")
    assert sorted(one) == sorted(two) == [1, 2], run
    np.testing.assert_allclose([two[s] for s in (1, 2)], [one[s] for s in (1, 2)], rtol=1e-5, err_msg=str(run))
  final_one, final_two = flat(restore_raw(rl / "one/checkpoints", 2)), flat(restore_raw(rl / "two/checkpoints", 2))
  assert sorted(final_one) == sorted(final_two)
  for key in final_one:
    np.testing.assert_allclose(final_two[key], final_one[key], rtol=1e-5, atol=1e-7, err_msg=key)
