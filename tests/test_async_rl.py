"""Asynchronous RL (`maxtrain/posttrain/async_rollout.py`, `correction.py`): bad settings are exit 2
before compiling; the corrections' weights and the weighted loss against NumPy (float64); a run with
rollouts one version behind on their own 4 devices trains on exactly the fixed interleaving's versions
and checkpoints its queue; a SIGKILL mid-run resumes bitwise; a hung rollout side and a stalled publish
end as hangs (exit 76) with their event, a rollout side that dies as a crash (exit 1) with its event."""

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.cli import train
from maxtrain.errors import UserError
from maxtrain.monitor.events import read_events
from maxtrain.posttrain import correction
from maxtrain.posttrain.algorithms import base as algo_base
from maxtrain.program import plan as plan_lib
from test_checkpoint import REPO, assert_bitwise_equal, flat, restore_raw
from test_grpo import RUN_ARGS, rounds, tiny_cfg
from tiny import cpu_env

ASYNC = RUN_ARGS + ["--config.post.max_staleness=1"]


@pytest.mark.parametrize("overrides, message", [
    (["--config.post.rollout_devices=8"], "post.rollout_devices=8 leaves 8 - 8 = 0 devices for the trainer"),
    (["--config.post.max_staleness=-1"], "config.post.max_staleness=-1"),
    (["--config.post.correction=tis", "--config.post.temperature=0.7"], "no rollout log-probs to correct by"),
    (["--config.post.correction=ips"], "config.post.correction='ips': choose one of none, tis, mis, decoupled"),
    (["--config.post.algorithm=dapo", "--config.post.mode=rl", "--config.post.max_staleness=2"],
     "dynamic sampling draws a variable number"),
    (["--config.post.algorithm=gspo", "--config.post.mode=rl", "--config.post.pack_updates=true"],
     "post.pack_updates=True with post.algorithm=gspo: its loss reads whole rows"),
])
def test_bad_async_settings_exit_2_before_compiling(overrides, message, tmp_path, capsys):
  code = train.main(RUN_ARGS + overrides + ["--config.steps=1", f"--config.output_dir={tmp_path}"])
  err = capsys.readouterr().err
  assert code == 2 and message in err, err
  assert "Traceback" not in err and "compiled" not in err


def test_rollout_devices_are_for_rl_and_leave_the_trainer_the_rest():
  with pytest.raises(UserError, match="a rollout mesh is for RL only"):
    plan_lib.validate(tiny_cfg("--config.post.mode=", "--config.post.rollout_devices=2"), 8)
  plan = plan_lib.validate(tiny_cfg("--config.post.rollout_devices=6"), 8)
  assert plan.mesh.describe() == "data=1 x fsdp=2 x tensor=1"  # the trainer's mesh over the first 2


def test_rollout_devices_across_processes_are_whole_processes():
  # 2 processes x 4 devices: the rollout side is the last process (its 4 devices), the trainer the first
  with pytest.raises(UserError, match=r"rollout_devices=2 with 2 processes of 4 devices: .* a multiple of 4"):
    plan_lib.validate(tiny_cfg("--config.post.rollout_devices=2"), 8, 2)
  with pytest.raises(UserError, match="leaves 8 - 8 = 0 devices for the trainer"):
    plan_lib.validate(tiny_cfg("--config.post.rollout_devices=8"), 8, 2)
  plan = plan_lib.validate(tiny_cfg("--config.post.rollout_devices=4"), 8, 2)
  assert plan.mesh.describe() == "data=1 x fsdp=4 x tensor=1"  # the trainer's mesh: process 0's devices only


def np_weights(old, sampler, mask, kind, cap):
  r = np.exp(old.astype(np.float64) - sampler)
  w = {"none": np.ones_like(r), "tis": np.minimum(r, cap), "mis": ((r >= 1 / cap) & (r <= cap)).astype(float),
       "decoupled": np.where(r <= cap, r, 0.0)}[kind]
  return np.where(mask > 0, w, 1.0)


def np_weighted_grpo_loss(logp, old, ref, adv, w, mask, hp):
  """sum_t mask (kl_coef k3 - w min(ratio A, clip(ratio) A)) / sum mask: the weight outside the min."""
  logp, old, ref, adv = (np.asarray(a, np.float64) for a in (logp, old, ref, adv))
  ratio = np.exp(logp - old)
  surrogate = np.minimum(ratio * adv, np.clip(ratio, 1 - hp.clip_low, 1 + hp.clip_high) * adv)
  d = ref - logp
  kl = np.exp(d) - d - 1
  return np.sum(mask * (hp.kl_coef * kl - w * surrogate)) / mask.sum()


@pytest.mark.parametrize("kind", ["none", "tis", "mis", "decoupled"])
def test_correction_weights_and_weighted_loss_match_numpy(kind):
  rng = np.random.default_rng(0)
  B, T, cap = 6, 9, 1.5
  mask = (rng.random((B, T)) < 0.7).astype(np.float32)
  old = rng.normal(-2.0, 0.5, (B, T)).astype(np.float32)
  sampler = (old + rng.normal(0, 0.5, (B, T))).astype(np.float32)  # ratios on both sides of cap and 1/cap
  logp = (old + rng.normal(0, 0.3, (B, T))).astype(np.float32)
  ref = (old + rng.normal(0, 0.2, (B, T))).astype(np.float32)
  adv = (rng.normal(0, 1, (B, 1)) * mask).astype(np.float32)
  w, scalars = correction.weights(old, sampler, mask, kind, cap)
  expected = np_weights(old, sampler, mask, kind, cap)
  np.testing.assert_allclose(w, expected, rtol=1e-6)
  d = (old.astype(np.float64) - sampler)[mask > 0]
  np.testing.assert_allclose(scalars["rl/mismatch_kl"], np.mean(np.exp(d) - d - 1), rtol=1e-6)
  r = np.exp(d)
  share = {"tis": np.mean(r > cap), "mis": np.mean((r > cap) | (r < 1 / cap)), "decoupled": np.mean(r > cap)}
  if kind != "none":
    assert 0 < share[kind] < 1  # the case exercises the cap
    key = "rl/is_clipped_share" if kind == "tis" else "rl/is_masked_share"
    np.testing.assert_allclose(scalars[key], share[kind], rtol=1e-6)
  # The weight on the advantages is the weighted surrogate (KL unweighted), value and gradient.
  hp = algo_base.Hyper(clip_low=0.2, clip_high=0.28, kl_coef=0.05)
  loss_fn = lambda lp: algo_base.token_mean_loss(lp, jnp.asarray(old), jnp.asarray(ref), jnp.asarray(adv * w),
                                                 jnp.asarray(mask), hp)[0]
  loss, grad = jax.value_and_grad(loss_fn)(jnp.asarray(logp))
  np.testing.assert_allclose(float(loss), np_weighted_grpo_loss(logp, old, ref, adv, expected, mask, hp), rtol=1e-5)
  eps = 1e-6  # central differences of the float64 reference, per token
  x = logp.astype(np.float64)
  for b, t in [(0, 0), (1, 3), (4, 2)]:
    up, down = x.copy(), x.copy()
    up[b, t] += eps
    down[b, t] -= eps
    numeric = (np_weighted_grpo_loss(up, old, ref, adv, expected, mask, hp)
               - np_weighted_grpo_loss(down, old, ref, adv, expected, mask, hp)) / (2 * eps)
    np.testing.assert_allclose(float(grad[b, t]), numeric, rtol=1e-4, atol=1e-7)


def scalars(out, tag):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  acc = EventAccumulator(str(out / "tensorboard"))
  acc.Reload()
  return {e.step: e.value for e in acc.Scalars(tag)}


SPLIT = ASYNC + ["--config.post.rollout_devices=4", "--config.post.correction=tis"]  # every run below: one compile


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  out = tmp_path_factory.mktemp("async") / "straight"
  assert train.main(SPLIT + ["--config.steps=4", f"--config.output_dir={out}"]) == 0
  return out


def test_rollouts_on_their_own_devices_one_version_behind(straight):
  """8 devices: the trainer on 4, the rollout side on the other 4, max_staleness=1: round k trains on the
  batch version max(0, k - 2) sampled (rl/version), the sampler/trainer log-prob gap is float noise in
  round 1 and 2 (version 0 = the starting parameters) and not after, tis weighs the stale tokens, and
  the checkpoint's data state holds the batch of round 3 (made by version 1) for a resume."""
  out = straight
  assert scalars(out, "rl/version") == {1: 0.0, 2: 0.0, 3: 1.0, 4: 2.0}
  assert scalars(out, "rl/staleness_mean") == {1: 0.0, 2: 1.0, 3: 1.0, 4: 1.0}
  kl = scalars(out, "rl/mismatch_kl")
  assert kl[1] < 1e-9 and min(kl[3], kl[4]) > 1e-5, kl  # fp32 on both meshes: only staleness makes a gap
  assert scalars(out, "rl/dropped_rollouts") == {k: 0.0 for k in (1, 2, 3, 4)}
  busy = scalars(out, "rl/trainer_busy")
  assert all(0 < b <= 1 for b in busy.values()), busy
  logged = {e["step"]: e for e in read_events(out / "events.jsonl") if e["kind"] == "rl_round"}
  assert sorted(logged) == [1, 2, 3, 4] and [logged[k]["staleness_mean"] for k in (1, 2, 3, 4)] == [0, 1, 1, 1]
  assert all(abs(logged[k]["trainer_busy"] - busy[k]) < 1e-6 and logged[k]["updates_per_s"] > 0 for k in busy)
  state = json.loads((out / "checkpoints/2/data/metadata").read_text())  # the data state (Orbax JsonSave)
  [made] = state["in_flight"]
  assert (made["round"], made["position"], made["version"], state["step"]) == (3, 2, 1, 2)


def test_resume_after_sigkill_mid_run_is_bitwise(straight, tmp_path, caplog):
  """Killed (SIGKILL) after round 3 with the newest checkpoint at round 2, whose data state holds round
  3's batch (made by version 1, which no checkpoint has): resumed, the run trains on it and samples round
  4 with version 2, as the run that never stopped did: the round-4 state is that run's bit for bit."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ["PYTHONPATH"]]),
         "JAX_DEFAULT_MATMUL_PRECISION": str(jax.config.jax_default_matmul_precision)}
  args = SPLIT + ["--config.steps=4", f"--config.output_dir={tmp_path / 'killed'}", "--config.faults.kill_at_step=3"]
  run = subprocess.run([sys.executable, "-m", "maxtrain.train", *args], cwd=REPO, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
  assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="maxtrain"):
    assert train.main(args) == 0  # the fault fires once
  assert "restored step 2 (8 optimizer updates)" in caplog.text and "killed/checkpoints/2" in caplog.text  # 2 rounds x 4
  a, b = restore_raw(straight / "checkpoints", 4), restore_raw(tmp_path / "killed/checkpoints", 4)
  assert_bitwise_equal(a, b)
  want, got = rounds(straight), rounds(tmp_path / "killed")
  assert [r["round"] for r in got] == [1, 2, 3, 3, 4] and got[3:] == want[2:]  # round 3's batch restored, not redrawn
  before = flat(restore_raw(tmp_path / "killed/checkpoints", 2))
  assert any(v.tobytes() != before[k].tobytes() for k, v in flat(a).items() if k.startswith("params"))  # it trained


@pytest.mark.parametrize("fault, phase", [("rollout_hang_at_step=2", "rollout"), ("publish_stall_at_step=1", "publish")])
def test_a_hung_rollout_side_or_publish_ends_as_a_hang(fault, phase, tmp_path):
  out = tmp_path / "run"
  code = train.main(SPLIT + ["--config.steps=3", "--config.post.sync_timeout_s=2", f"--config.faults.{fault}",
                             f"--config.output_dir={out}"])
  assert code == 76
  events = read_events(out / "events.jsonl")
  [stall] = [e for e in events if e["kind"] == "rollout_stall"]
  assert stall["phase"] == phase and stall["waited_s"] >= 2, stall
  assert (events[-1]["kind"], events[-1]["code"]) == ("exit", 76)


def test_a_rollout_worker_that_dies_is_a_crash_naming_it(tmp_path, capsys):
  """The producer thread raises before round 2: a `rollout_died` event naming the error, then exit 1 (a crash:
  restarted with backoff) with a crash event that says the rollout side died; round 1 trained."""
  out = tmp_path / "run"
  code = train.main(SPLIT + ["--config.steps=3", "--config.faults.rollout_die_at_step=2", f"--config.output_dir={out}"])
  err = capsys.readouterr().err
  assert code == 1 and "crash: RuntimeError: the rollout producer thread died at round 2" in err, err[-2000:]
  events = read_events(out / "events.jsonl")
  [died] = [e for e in events if e["kind"] == "rollout_died"]
  assert died["round"] == 2 and died["version"] == 0 and "fault injection" in died["error"], died
  [crash] = [e for e in events if e["kind"] == "crash"]
  assert "the rollout producer thread died at round 2" in crash["reason"], crash
  assert (events[-1]["kind"], events[-1]["code"]) == ("exit", 1)
  assert [r["round"] for r in rounds(out)] == [1]


def test_an_error_in_the_rollout_thread_ends_the_run_as_in_a_synchronous_round(tmp_path, capsys):
  """A reward that raises, called by the producer thread: exit 2 naming it, as in the synchronous loop."""
  code = train.main(SPLIT + ["--config.steps=2", "--config.post.reward=test_grpo:boom", f"--config.output_dir={tmp_path}"])
  err = capsys.readouterr().err
  assert code == 2 and "post.reward='test_grpo:boom' raised ValueError: no answer" in err, err[-2000:]



def test_a_rollback_drops_the_batches_of_the_abandoned_versions(tmp_path):
  """Round 3 NaN (every update; 2 in a row roll back to round 2): the queued batches made by versions the
  rollback abandoned are dropped and counted (a `rollout_drop` event), never trained on; the redone round 3
  samples with the restored version 2 at the next prompt position, and the run finishes."""
  out = tmp_path / "run"
  assert train.main(SPLIT + ["--config.steps=4", "--config.faults.nan_at_step=3", "--config.guards.max_consecutive_bad=2",
                             f"--config.output_dir={out}"]) == 0
  done = rounds(out)
  assert [r["round"] for r in done] == [1, 2, 3, 3, 4] and [r["position"] for r in done] == [0, 1, 2, 3, 4]
  drops = [e for e in read_events(out / "events.jsonl") if e["kind"] == "rollout_drop"]
  assert len(drops) == 1 and drops[0]["count"] >= 1 and set(drops[0]["versions"]) <= {2, 3}, drops
  version = scalars(out, "rl/version")
  assert version[3] == 2.0 and version[4] == 2.0  # the redone round 3 and round 4: max(floor 2, k - 2)


@pytest.mark.slow  # a 4-device process of its own compiles everything once more
def test_staleness_0_on_its_own_devices_is_bitwise_the_synchronous_run(tmp_path):
  """max_staleness=0 with 4 of 8 devices for rollouts (the producer thread, the versioned publish onto
  the rollout mesh, the queue) is bitwise today's synchronous run on 4 devices (a process of its own):
  the same parameters at round 2 and the same completions."""
  env = cpu_env(4, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ["PYTHONPATH"]]),
                JAX_DEFAULT_MATMUL_PRECISION=str(jax.config.jax_default_matmul_precision))
  args = RUN_ARGS + ["--config.steps=2"]
  run = subprocess.run([sys.executable, "-m", "maxtrain.train", *args, f"--config.output_dir={tmp_path / 'sync'}"],
                       cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  assert train.main(args + ["--config.post.rollout_devices=4", f"--config.output_dir={tmp_path / 'split'}"]) == 0
  assert rounds(tmp_path / "sync") == rounds(tmp_path / "split")
  assert_bitwise_equal(restore_raw(tmp_path / "sync/checkpoints", 2), restore_raw(tmp_path / "split/checkpoints", 2))


# Across hosts (posttrain/remote_rollout.py): 2 processes x 2 CPU devices, process 1 the rollout side.
CROSS = RUN_ARGS + ["--config.post.rollout_devices=2", "--config.steps=3", "--config.post.sync_timeout_s=120",
                    "--config.runtime.shutdown_timeout_s=30"]


def _run(out: Path, extra: list[str], processes: int, restarts: int = 0, devices: int = 4) -> subprocess.CompletedProcess:
  env = {**cpu_env(devices // processes), "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ["PYTHONPATH"]]),
         "JAX_DEFAULT_MATMUL_PRECISION": str(jax.config.jax_default_matmul_precision)}
  args = [*CROSS, *extra, f"--config.output_dir={out}"]
  command = (["-m", "maxtrain.launch", f"--processes={processes}", f"--max-restarts={restarts}", "--backoff=0.1",
              "--peer-grace=30", "--", *args] if processes > 1 else ["-m", "maxtrain.train", *args])
  return subprocess.run([sys.executable, *command], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def stale_two(tmp_path_factory):
  """max_staleness=1 on two processes, 3 rounds."""
  out = tmp_path_factory.mktemp("cross") / "stale"
  result = _run(out, ["--config.post.max_staleness=1"], 2)
  assert result.returncode == 0, result.stderr[-5000:]
  return out


@pytest.mark.slow
def test_rollout_side_on_a_process_of_its_own(tmp_path, stale_two):
  """One trainer process and one rollout process of one jax.distributed job (post.rollout_devices=2 = the
  second process's devices): each version goes over by a cross-process jax.device_put, each batch back
  through the coordination service. max_staleness=0 is bit for bit the one-process run with the same split
  (4 devices, the last 2 rolling out): the same completions every round and the same final state. With
  max_staleness=1 round k trains on version max(0, k - 2), as on one host."""
  one, two = _run(tmp_path / "one", ["--config.post.max_staleness=0"], 1), \
      _run(tmp_path / "two", ["--config.post.max_staleness=0"], 2)
  assert one.returncode == 0, one.stderr[-3000:]
  assert two.returncode == 0 and "(processes, in exit order: 0, 0)" in two.stderr, two.stderr[-5000:]
  assert "async: 2 rollout devices on processes [1]" in two.stderr
  assert "rollout process 1: the trainer ended (exit 0) after" in two.stderr
  assert rounds(tmp_path / "two") == rounds(tmp_path / "one")
  assert_bitwise_equal(restore_raw(tmp_path / "one/checkpoints", 3), restore_raw(tmp_path / "two/checkpoints", 3))
  assert scalars(stale_two, "rl/version") == {1: 0.0, 2: 0.0, 3: 1.0}
  assert scalars(stale_two, "rl/staleness_mean") == {1: 0.0, 2: 1.0, 3: 1.0}
  assert scalars(stale_two, "rl/dropped_rollouts") == {1: 0.0, 2: 0.0, 3: 0.0}


@pytest.mark.slow
def test_across_processes_a_sigkill_mid_run_resumes_bitwise(tmp_path, stale_two):
  """The trainer process SIGKILLed after round 3 (the newest checkpoint at round 2 holds round 3's batch,
  made by version 1 on the rollout process); the launcher restarts both processes and the resumed run
  trains on that batch: its round-3 state is the uninterrupted run's bit for bit."""
  killed = tmp_path / "killed"
  result = _run(killed, ["--config.post.max_staleness=1", "--config.faults.kill_at_step=3"], 2, restarts=1)
  assert "attempt 1: exit 0 (finished)" in result.stderr, result.stderr[-5000:]
  assert_bitwise_equal(restore_raw(stale_two / "checkpoints", 3), restore_raw(killed / "checkpoints", 3))
  want, got = rounds(stale_two), rounds(killed)
  assert [r["round"] for r in got] == [1, 2, 3, 3] and got[3:] == want[2:]  # round 3's batch restored, not redrawn


def reward_service_down(prompt, completion, meta):
  """A reward that fails (on the rollout process: across hosts the rollout side scores its batches)."""
  raise RuntimeError("reward service down")


@pytest.mark.slow
def test_a_rollout_process_that_fails_ends_the_trainer_with_rollout_died(tmp_path):
  """The rollout process's error reaches the trainer's producer: a `rollout_died` event naming the process
  and the error, and the error's exit code on both processes (a reward that raises is exit 2, as in a
  synchronous round), within seconds (no timeout waited out)."""
  result = _run(tmp_path / "died", ["--config.post.reward=test_async_rl:reward_service_down", "--config.steps=1"], 2)
  assert "(processes, in exit order: 2, 2)" in result.stderr, result.stderr[-5000:]
  [died] = [e for e in read_events(tmp_path / "died/events.jsonl") if e["kind"] == "rollout_died"]
  assert "rollout process 1: UserError: config.post.reward='test_async_rl:reward_service_down' raised RuntimeError: " \
      "reward service down" in died["error"] and died["round"] == 1
  assert not [e for e in read_events(tmp_path / "died/events.jsonl") if e["kind"] == "rollout_stall"]


@pytest.mark.slow
def test_a_trainer_over_two_processes_with_a_rollout_process(tmp_path):
  """3 processes x 2 CPU devices, post.rollout_devices=2: the trainer's mesh over processes 0-1 (4 devices),
  the rollout side process 2. Each publish gathers the parameters on the trainer's 4 devices and sends 2 of
  the replicas (one from each trainer process) to the rollout's 2 devices (jax refuses a 4-to-2 device
  transfer); every round's batch reaches both trainer processes through the store and is deleted once both
  took it (4 rounds: round 1's key goes at round 4). max_staleness=0 against one process with the same split
  (6 devices, the last 2 rolling out): the same completions every round, the parameters to rtol 1e-5 (the
  trainer's reductions span 2 processes: not bitwise, as test_multiprocess's synchronous run; measured 1.1e-8
  absolute at round 4). Before the fix the first publish crashed: `CopyArrays only supports destination device
  list of the same size`."""
  extra = ["--config.post.max_staleness=0", "--config.steps=4", "--config.mesh.fsdp=-1", "--config.optimizer.eps=1e-2"]
  one = _run(tmp_path / "one", extra, 1, devices=6)
  assert one.returncode == 0, one.stderr[-3000:]
  three = _run(tmp_path / "three", extra, 3, devices=6)
  assert three.returncode == 0 and "(processes, in exit order: 0, 0, 0)" in three.stderr, three.stderr[-5000:]
  assert "async: 2 rollout devices on processes [2]" in three.stderr
  assert "rollout process 2: the trainer ended (exit 0) after" in three.stderr
  assert rounds(tmp_path / "three") == rounds(tmp_path / "one")  # prompts, completions, rewards
  a, b = flat(restore_raw(tmp_path / "one/checkpoints", 4)), flat(restore_raw(tmp_path / "three/checkpoints", 4))
  assert sorted(a) == sorted(b)
  for key in a:
    np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-7, err_msg=key)
  before = flat(restore_raw(tmp_path / "three/checkpoints", 2))
  assert any(not np.array_equal(v, before[k]) for k, v in b.items() if k.startswith("params"))  # it trained
