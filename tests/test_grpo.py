"""GRPO on the training program: the generator's log-probabilities equal the trainer's forward pass on
the same tokens (fp32, 1e-5; the bf16 gap bounded), one optimizer step per rollout has importance ratio
exactly 1, the step on 8 devices (fsdp x tensor) matches 1 device, reward functions that cannot be
loaded or raise are UserErrors naming them, and the guards: NaN and gradient-norm spikes skip in graph,
roll back (the redone rounds draw new rollouts; a resume after it is bitwise) or stop the run; a
SIGKILLed run resumes bitwise."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from maxtrain import config as config_lib
from maxtrain.data import arithmetic
from maxtrain.data.tokenizer import ByteTokenizer
from maxtrain.errors import EXIT_ABORTED, Aborted, UserError
from maxtrain.inference import sampling
from maxtrain.inference.sampling import Sampling
from maxtrain.posttrain import packing, rewards, rl_step, rollout as rollout_lib
from maxtrain.posttrain.algorithms import base as algo_base
from maxtrain.posttrain.rl import ROLLOUTS_FILE
from maxtrain.cli import train
from maxtrain.loop.rollback import ROLLBACKS_FILE, GuardPolicy, Rollback
from maxtrain.monitor import events as ev
from maxtrain.monitor.events import read_events
from maxtrain.program import build, plan as plan_lib, state as state_lib
from maxtrain.runtime import cache, faults
from test_checkpoint import REPO, assert_bitwise_equal, flat, restore_raw
from tiny import TINY_MODEL

TOK = ByteTokenizer()
P, G = 4, 4


def tiny_cfg(*extra):
  return config_lib.load(TINY_MODEL + ["--config.post.mode=grpo", f"--config.post.prompts_per_step={P}",
                                       f"--config.post.group_size={G}", f"--config.data.batch_size={P * G}",
                                       "--config.data.seq_len=16", "--config.post.max_new_tokens=6", *extra])


def rollout(program, params):
  """A round's batch (host rows) sampled by the generator at temperature 1 with these parameters."""
  examples = [e for e in arithmetic.examples("train")[:P] for _ in range(G)]
  prompt_ids = [TOK.encode(e["prompt"]).tolist() for e in examples]
  generator = sampling.for_program(program, params)
  tokens, scores, _ = generator.generate_scored(prompt_ids, 6, Sampling(temperature=1.0, seed=3),
                                                vocab_limit=TOK.vocab_size)
  rows, lengths, _ = rollout_lib.rollout_rows(prompt_ids, tokens, scores, TOK.eos_id, 16)
  rewards = np.arange(P * G, dtype=np.float32).reshape(P, G) % 3  # any fixed rewards: non-zero advantages
  mask = rows.pop("loss_mask")
  host = {k: rows[k] for k in ("inputs", "targets", "segment_ids", "positions")}
  host.update(loss_mask=mask, advantages=np.asarray(algo_base.group_advantages(rewards)).reshape(-1, 1) * mask,
              old_logp=rows["sampler_logp"], ref_logp=rows["sampler_logp"])
  return host, rows["sampler_logp"], mask


@pytest.fixture(scope="module")
def one_device():
  """The 1-device program, its initial state (on the host), a rollout batch, and the compiled pieces."""
  cache.configure_compile_cache("")  # the persistent compilation cache, as every trainer run (below) configures it
  cfg = tiny_cfg("--config.faults.spike_at_step=1000")  # drilled: its step takes the fault input (run_step)
  program = build.program_for(cfg, jax.devices()[:1])
  state = state_lib.initialize(program.state, program.mesh)
  logprobs, train = rl_step.jit_pieces(program, clip_low=0.2, clip_high=0.2, kl_coef=0.1, on_policy=True)
  with jax.set_mesh(program.mesh):
    host, sampler_logp, mask = rollout(program, state.params)
  return cfg, program, jax.device_get(state), host, sampler_logp, mask, logprobs, train


def test_sampler_and_trainer_logprobs_agree(one_device):
  _, program, state_host, host, sampler_logp, mask, logprobs, _ = one_device
  with jax.set_mesh(program.mesh):
    params = jax.device_put(state_host.params, program.state.shardings.params)
    trainer_logp = np.asarray(logprobs(params, rl_step.to_device(host, program)))
  assert mask.sum() >= P * G  # every completion has at least one token
  np.testing.assert_allclose(trainer_logp[mask > 0], sampler_logp[mask > 0], rtol=0, atol=1e-5)


def test_bf16_sampler_and_trainer_logprob_gap_is_small():
  """In bfloat16 (parameters and matmuls) the generator (one token at a time, against its KV cache) and the
  trainer's forward pass (the whole row) round differently: the gap `rl/logprob_gap` reports is no longer
  ~1e-6 but must stay far inside the objective's clip range. Bound: log(1 + clip_eps) / 4 = 0.046 nats
  (clip_eps 0.2), so that a sampler/trainer mismatch alone moves an importance ratio by at most a quarter
  of the way to the clip; a bf16 round-off of a log-probability is ~2^-8 x |logit|, well below it."""
  program = build.program_for(tiny_cfg("--config.model.compute_dtype=bfloat16", "--config.model.param_dtype=bfloat16"),
                              jax.devices()[:1])
  logprobs, _ = rl_step.jit_pieces(program, clip_low=0.2, clip_high=0.2, kl_coef=0.1, on_policy=True)
  with jax.set_mesh(program.mesh):
    state = state_lib.initialize(program.state, program.mesh)
    host, sampler_logp, mask = rollout(program, state.params)
    trainer_logp = np.asarray(logprobs(state.params, rl_step.to_device(host, program)))
  gap = rollout_lib.logprob_gap(trainer_logp, sampler_logp, mask)
  print(f"bf16 sampler/trainer logprob gap: {gap:.3e} nats (max over {int(mask.sum())} completion tokens)")
  assert np.isfinite(gap) and 0 < gap < np.log(1.2) / 4


def run_step(program, train, state_host, host, fault=faults.NONE):
  """One on-policy GRPO step of `state_host` (host arrays): (metrics, new params) on the host."""
  with jax.set_mesh(program.mesh):
    state = jax.device_put(state_host, program.state.shardings)  # a fresh copy: the step donates it
    batch = rl_step.to_device(host, program)
    if faults.in_graph_armed(program.cfg.faults):  # a drilled program's step takes the fault input
      batch = faults.attach(batch, fault, faults.replicated(batch))
    state, metrics = train(state, batch)
    return jax.device_get(metrics), jax.device_get(state.params)


def test_on_policy_ratio_is_one_and_8_devices_match_1(one_device):
  _, program, state_host, host, _, _, _, train = one_device
  metrics1, params1 = run_step(program, train, state_host, host)
  assert float(metrics1["ratio_mean"]) == 1.0 and float(metrics1["clip_fraction"]) == 0.0
  assert float(metrics1["grad_norm"]) > 0 and float(metrics1["skipped"]) == 0.0
  program8 = build.program_for(tiny_cfg("--config.mesh.fsdp=4", "--config.mesh.tensor=2"), jax.devices()[:8])
  _, train8 = rl_step.jit_pieces(program8, clip_low=0.2, clip_high=0.2, kl_coef=0.1, on_policy=True)
  metrics8, params8 = run_step(program8, train8, state_host, host)
  assert float(metrics8["ratio_mean"]) == 1.0
  for key in ("loss", "kl", "grad_norm"):
    np.testing.assert_allclose(float(metrics8[key]), float(metrics1[key]), rtol=1e-5, atol=1e-7)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params8, params1)
  # A non-finite objective (here a NaN advantage) skips the update in graph: the parameters stay.
  metrics_nan, params_nan = run_step(program, train, state_host, {**host, "advantages": host["advantages"] * np.nan})
  assert float(metrics_nan["skipped"]) == 1.0
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), params_nan, jax.device_get(state_host.params))
  # The gradient norm is the spike signal: past the warmup, x1e4 gradients (the fault seam) are a spike, skipped.
  norm = float(metrics1["grad_norm"])
  window = state_host.guard.losses.shape[0]
  warm = state_host.replace(guard=state_host.guard.replace(losses=np.linspace(0.9, 1.1, window, dtype=np.float32) * norm,
                                                           recorded=np.int32(window)))
  metrics_spike, params_spike = run_step(program, train, warm, host, fault=(0.0, 1e4))
  assert int(metrics_spike["spike"]) == 1 and float(metrics_spike["skipped"]) == 1.0
  np.testing.assert_allclose(float(metrics_spike["grad_norm"]), 1e4 * norm, rtol=1e-4)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), params_spike, jax.device_get(state_host.params))
  metrics_ok, _ = run_step(program, train, warm, host)  # the same update unscaled is inside the window: no spike
  assert int(metrics_ok["spike"]) == 0 and float(metrics_ok["skipped"]) == 0.0


def test_packed_update_batch_is_the_unpacked_one(one_device):
  """Sequence packing (post.pack_updates): 16 rows of 3-10 real tokens (of 16) packed first-fit into fewer rows
  with document ids: each token's log-probability is the unpacked batch's, and so is a GRPO step (loss, KL,
  gradient norm, parameters); the same packed rows without their document ids are far off (the mask matters)."""
  _, program, state_host, host, _, _, logprobs, train = one_device
  rng = np.random.default_rng(0)
  b, t = host["inputs"].shape
  m_B = 3 + np.arange(b) % 8  # real tokens per row
  real = np.arange(t)[None] < m_B[:, None]
  batch = {"inputs": np.where(real, rng.integers(1, 200, (b, t)), 0).astype(np.int32),
           "targets": np.where(real, rng.integers(1, 200, (b, t)), 0).astype(np.int32),
           "segment_ids": np.where(real, 1, 2).astype(np.int32), "positions": np.broadcast_to(np.arange(t), (b, t)).astype(np.int32),
           "loss_mask": (real & (np.arange(t)[None] >= m_B[:, None] // 2)).astype(np.float32)}
  batch["advantages"] = (rng.normal(0, 1, (b, 1)) * batch["loss_mask"]).astype(np.float32)
  batch["old_logp"] = batch["ref_logp"] = np.zeros((b, t), np.float32)  # set below from the unpacked pass
  packed, groups = packing.pack(batch)
  assert len(packed["inputs"]) < b and sorted(sum(groups, [])) == list(range(b))
  assert packing.padding_share(m_B, packed["inputs"].shape) < packing.padding_share(m_B, (b, t))
  with jax.set_mesh(program.mesh):
    params = jax.device_put(state_host.params, program.state.shardings.params)
    unpacked_logp = np.asarray(logprobs(params, rl_step.to_device(batch, program)))
    packed_logp = np.asarray(logprobs(params, rl_step.to_device(packed, program)))
    merged = {**packed, "segment_ids": (packed["segment_ids"] > 0).astype(np.int32)}
    merged_logp = np.asarray(logprobs(params, rl_step.to_device(merged, program)))
  back = packing.unpack(packed_logp, groups, m_B, (b, t))
  # A per-token bound, each log-prob on its own (no sum grows the error): |logp| of random targets under this random
  # model is about log(vocab) = log(384) = 5.95 (measured 5.7-6.3), where an fp32 ulp is 4.8e-7, so 2e-5 is ~40 ulps
  # of room for packed rows' other key counts and reduction orders (measured: 4.8e-7, one ulp)
  np.testing.assert_allclose(back[real], unpacked_logp[real], rtol=0, atol=2e-5)
  assert np.abs(packing.unpack(merged_logp, groups, m_B, (b, t)) - unpacked_logp)[real].max() > 1e-2
  batch["old_logp"] = batch["ref_logp"] = unpacked_logp * batch["loss_mask"]
  packed, _ = packing.pack(batch)
  metrics, params = run_step(program, train, state_host, batch)
  metrics_p, params_p = run_step(program, train, state_host, packed)
  for key in ("loss", "kl", "grad_norm", "tokens"):
    np.testing.assert_allclose(float(metrics_p[key]), float(metrics[key]), rtol=1e-5, atol=1e-7, err_msg=key)
  jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6), params_p, params)


def flags(nonfinite=0, spike=0, consecutive_bad=0, grad_norm=1.0, zscore=0.0):
  """One GRPO update's guard flags as `rl_step` returns them."""
  return {"nonfinite": nonfinite, "nonfinite_update": 0, "spike": spike, "loss_zscore": zscore,
          "consecutive_bad": consecutive_bad, "grad_norm": grad_norm}


def grpo_policy(events, *extra):
  return GuardPolicy(tiny_cfg(*extra).guards, events, rollbacks_used=0, unit="round", signal="grad_norm")


def test_guard_policy_reads_a_rounds_updates(tmp_path):
  """Pretraining's GuardPolicy over a round's updates (4 a round here): each skip is an event naming the
  round and update; max_consecutive_bad in a row (across rounds) rolls back to before the round where
  the streak began; the budget spent, and a spike with spike_action=abort, stop the run (exit 3)."""
  events = ev.EventLog(tmp_path / "events.jsonl")
  policy = grpo_policy(events, "--config.guards.max_consecutive_bad=3", "--config.guards.max_rollbacks=1")
  assert policy.after_updates(1, [flags(), flags(1, consecutive_bad=1), flags(), flags(1, consecutive_bad=1)], 4) is None
  rollback = policy.after_updates(2, [flags(1, consecutive_bad=2), flags(1, consecutive_bad=3), flags()], 4)
  assert rollback == Rollback(step=2, first_bad=1, reason="3 non-finite updates in a row") and policy.rollbacks == 1
  skips = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
  assert [(e["kind"], e["step"], e["update"], e["consecutive"]) for e in skips] == [
      ("nan_skip", 1, 2, 1), ("nan_skip", 1, 4, 1), ("nan_skip", 2, 1, 2), ("nan_skip", 2, 2, 3)]
  with pytest.raises(Aborted, match="3 non-finite updates in a row at round 5, and guards.max_rollbacks=1"):
    policy.after_updates(5, [flags(1, consecutive_bad=3)], 4)
  abort = grpo_policy(events, "--config.guards.spike_action=abort")
  assert abort.after_updates(6, [flags(spike=0, grad_norm=0.9, zscore=2.0)], 4) is None
  with pytest.raises(Aborted, match=r"grad_norm spike at round 6, update 2: grad_norm 90.0000, z-score 700.0 > "
                                    r"guards.spike_zscore=6.0 \(guards.spike_action=abort\)"):
    abort.after_updates(6, [flags(), flags(spike=1, grad_norm=90.0, zscore=700.0)], 4)
  spike = json.loads((tmp_path / "events.jsonl").read_text().splitlines()[-1])
  assert (spike["kind"], spike["step"], spike["update"], spike["grad_norm"], spike["action"]) == (
      "spike", 6, 2, 90.0, "abort")


def boom(prompt, completion, meta):
  raise ValueError("no answer")


def test_reward_function_errors_name_it():
  with pytest.raises(UserError, match="post.reward='no_such_module:f' cannot be loaded"):
    rewards.load_reward("no_such_module:f")
  with pytest.raises(UserError, match="expected module:function"):
    rewards.load_reward("maxtrain.data.arithmetic")
  fn = rewards.load_reward("test_grpo:boom")
  with pytest.raises(UserError, match="post.reward='test_grpo:boom' raised ValueError: no answer"):
    rewards.score(fn, "test_grpo:boom", [{"prompt": "1+1=", "meta": {}}], ["2"])
  assert rewards.load_reward("maxtrain.data.arithmetic:reward") is arithmetic.reward


def test_batch_size_must_match_the_round():
  with pytest.raises(UserError, match="data.batch_size=8 must be post.prompts_per_step x post.group_size"):
    plan_lib.validate(tiny_cfg("--config.data.batch_size=8"), 1)
  plan_lib.validate(tiny_cfg("--config.guards.spike_action=rollback"), 1)  # GRPO rolls back like pretraining


def digit_reward(prompt, completion, meta):
  """Varied rewards from any model (the tiny one never answers right): the completion's digit count."""
  return float(sum(c.isdigit() for c in completion))


# configs/grpo.py on the tiny model, 2 epochs x 2 minibatches a round (old log-probs kept): the end-to-end
# runs below share it, so the processes after the first hit the persistent compilation cache.
RUN_ARGS = ["--config=configs/grpo.py", *TINY_MODEL, "--config.data.seq_len=16", f"--config.post.prompts_per_step={P}",
            f"--config.post.group_size={G}", f"--config.data.batch_size={P * G // 2}", "--config.post.eval_prompts=0",
            "--config.post.reward=test_grpo:digit_reward", "--config.post.log_rollouts=true",
            "--config.checkpoint.every_steps=2", "--config.eval.every_steps=0", "--config.log_every=1",
            "--config.optimizer.lr=1e-3"]


def rounds(out):
  return [json.loads(line) for line in (out / ROLLOUTS_FILE).read_text().splitlines()]


def guard_events(out):
  return [(r["kind"], r["step"], r.get("update", r.get("from_step"))) for r in read_events(out / "events.jsonl")
          if r["kind"] in ("nan_skip", "spike", "rollback")]


@pytest.fixture(scope="module")
def rolled_back(tmp_path_factory):
  """A run (7 rounds, checkpoints every 2) whose round 3 is NaN (every update; 2 in a row roll back) and
  whose round 6's gradients are x1e4 (a gradient-norm spike, spike_action=rollback): its output dir. (x1e4:
  a round whose groups all have equal rewards has a KL-only gradient ~100x smaller than usual.)"""
  out = tmp_path_factory.mktemp("grpo") / "run"
  assert train.main(RUN_ARGS + ["--config.steps=7", "--config.faults.nan_at_step=3", "--config.guards.max_consecutive_bad=2",
                                "--config.faults.spike_at_step=6", "--config.faults.spike_factor=1e4",
                                "--config.guards.spike_action=rollback",
                                f"--config.output_dir={out}"]) == 0
  return out


def test_nan_and_spike_roll_back_and_the_redone_rounds_draw_new_rollouts(rolled_back):
  out = rolled_back
  assert guard_events(out) == [("nan_skip", 3, 1), ("nan_skip", 3, 2), ("rollback", 2, 3),  # to round 2, from 3
                               ("spike", 6, 1), ("rollback", 4, 6)]
  spike = next(r for r in read_events(out / "events.jsonl") if r["kind"] == "spike")
  assert spike["zscore"] > 6.0 and spike["action"] == "rollback"
  assert json.loads((out / "checkpoints" / ROLLBACKS_FILE).read_text())["rollbacks"] == 2
  done = rounds(out)
  assert [r["round"] for r in done] == [1, 2, 3, 3, 4, 5, 6, 5, 6, 7]
  assert [r["position"] for r in done] == list(range(10))  # the prompt position only moves forward
  faulty, redone = (done[2], done[6]), (done[3], done[7])  # rounds 3 and 6 as faulted, then as redone
  for bad, again in zip(faulty, redone):
    assert bad["prompts"] != again["prompts"] and bad["completions"] != again["completions"]
  assert json.loads((out / "summary.json").read_text())["steps"] == 7


def test_utilisation_reaches_tensorboard_and_the_event_log(rolled_back):
  """Every logged round: an `rl_round` event with the utilisation its TensorBoard scalars hold; rollout
  tokens/s x sampling seconds = the completion tokens generated (response length x rows)."""
  from test_async_rl import scalars

  out = rolled_back
  logged = [e for e in read_events(out / "events.jsonl") if e["kind"] == "rl_round"]
  assert sorted({e["step"] for e in logged}) == list(range(1, 8))
  for e in logged:
    assert 0 < e["trainer_busy"] <= 1 and e["updates_per_s"] > 0 and e["rollout_tokens_per_s"] > 0, e
    assert e["trainer_idle_s"] > 0 and e["rollout_idle_s"] > 0, e
  last = {e["step"]: e for e in logged}
  busy = scalars(out, "rl/trainer_busy")
  assert all(abs(busy[k] - last[k]["trainer_busy"]) < 1e-6 for k in busy), (busy, last)
  per_s, sampling_s, length = (scalars(out, f"rl/{k}") for k in ("rollout_tokens_per_s", "rollout_s", "response_length"))
  for k in per_s:
    np.testing.assert_allclose(per_s[k] * sampling_s[k], length[k] * P * G, rtol=1e-5)


def test_packed_updates_and_continuous_batching_through_the_entry_point(tmp_path):
  """post.pack_updates and post.continuous_batching in a run (2 batch shards: packing can drop rows): less
  padding in the update batch than unpacked, in TensorBoard and the rl_round events; the continuous
  generator's log-probs are the trainer's (float noise)."""
  from test_async_rl import scalars

  out = tmp_path / "run"
  assert train.main(RUN_ARGS + ["--config.steps=2", "--config.data.seq_len=32", "--config.mesh.fsdp=2",
                                "--config.mesh.tensor=4", "--config.post.pack_updates=true",
                                "--config.post.continuous_batching=4", f"--config.output_dir={out}"]) == 0
  share, unpacked = scalars(out, "rl/padding_share"), scalars(out, "rl/padding_share_unpacked")
  assert sorted(share) == [1, 2] and all(share[k] < unpacked[k] - 0.2 for k in share), (share, unpacked)
  logged = [e for e in read_events(out / "events.jsonl") if e["kind"] == "rl_round"]
  assert [round(e["padding_share"], 5) for e in logged] == [round(share[k], 5) for k in (1, 2)]
  assert max(scalars(out, "rl/logprob_gap").values()) < 1e-4
  assert [r["round"] for r in rounds(out)] == [1, 2]


def test_resume_after_a_rollback_is_exact(rolled_back, tmp_path):
  """Resumed from the round-6 checkpoint written after both rollbacks: round 7 draws the same rollouts
  (position 9, from the checkpoint's data state) and ends bit for bit where the uninterrupted run did."""
  out = tmp_path / "resumed"
  shutil.copytree(rolled_back, out)
  shutil.rmtree(out / "checkpoints" / "7")
  (out / ROLLOUTS_FILE).write_text("")
  assert train.main(RUN_ARGS + ["--config.steps=7", "--config.faults.nan_at_step=3", "--config.guards.max_consecutive_bad=2",
                                "--config.faults.spike_at_step=6", "--config.faults.spike_factor=1e4",
                                "--config.guards.spike_action=rollback",
                                f"--config.output_dir={out}"]) == 0
  assert rounds(out) == rounds(rolled_back)[-1:] and rounds(out)[0]["position"] == 9
  assert_bitwise_equal(restore_raw(rolled_back / "checkpoints", 7), restore_raw(out / "checkpoints", 7))


def test_a_skipped_spike_goes_on_and_a_spent_budget_stops_the_run(tmp_path):
  """spike_action=skip: round 6's x1e4 gradients are spikes, skipped in graph, and the run goes on; then
  round 7's NaNs need a rollback but guards.max_rollbacks=0: exit 3."""
  out = tmp_path / "run"
  code = train.main(RUN_ARGS + ["--config.steps=8", "--config.faults.spike_at_step=6", "--config.faults.spike_factor=1e4",
                                "--config.faults.nan_at_step=7",
                                "--config.guards.max_consecutive_bad=4", "--config.guards.max_rollbacks=0",
                                f"--config.output_dir={out}"])
  assert code == EXIT_ABORTED == 3
  assert guard_events(out) == [("spike", 6, u) for u in (1, 2, 3, 4)] + [("nan_skip", 7, u) for u in (1, 2, 3, 4)]
  assert [r["round"] for r in rounds(out)] == [1, 2, 3, 4, 5, 6, 7]
  exit_record = read_events(out / "events.jsonl")[-1]
  assert (exit_record["kind"], exit_record["code"]) == ("exit", 3)


def test_resume_after_sigkill_mid_run_is_bitwise_and_samples_the_same(tmp_path, caplog):
  """configs/grpo.py on the tiny model (2 epochs x 2 minibatches a round: old log-probs kept), killed
  (SIGKILL) after round 3 with the newest checkpoint at round 2, resumed: the round-4 state equals an
  uninterrupted run's bit for bit, and the rounds redone after the resume sample the same completions
  (sampling seed, prompt position and the rebuilt reference restored)."""
  args = RUN_ARGS + ["--config.steps=4"]
  # conftest's matmul precision in the child too: the same programs as this process's runs (compile cache hits).
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ["PYTHONPATH"]]),
         "JAX_DEFAULT_MATMUL_PRECISION": str(jax.config.jax_default_matmul_precision)}
  kill = [f"--config.output_dir={tmp_path / 'killed'}", "--config.faults.kill_at_step=3"]
  # Only the killed run needs a process of its own; the others run here (the same compiled programs).
  assert train.main(args + [f"--config.output_dir={tmp_path / 'straight'}"]) == 0
  run = subprocess.run([sys.executable, "-m", "maxtrain.train", *args, *kill], cwd=REPO, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
  assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="maxtrain"):
    assert train.main(args + kill) == 0  # the fault fires once
  assert "restored step 2 (8 optimizer updates)" in caplog.text and "killed/checkpoints/2" in caplog.text  # 2 rounds x 4

  straight, killed = rounds(tmp_path / "straight"), rounds(tmp_path / "killed")
  assert [r["round"] for r in straight] == [1, 2, 3, 4] and [r["round"] for r in killed] == [1, 2, 3, 3, 4]
  assert killed[:3] == straight[:3] and killed[3:] == straight[2:]  # round 3 sampled again, the same
  assert len({c for r in straight for c in r["completions"]}) > 1 and len({x for r in straight for x in r["rewards"]}) > 1
  a, b = restore_raw(tmp_path / "straight/checkpoints", 4), restore_raw(tmp_path / "killed/checkpoints", 4)
  assert int(flat(a)["step"]) == 4 * 4  # rounds x (ppo_epochs x minibatches)
  assert_bitwise_equal(a, b)
  before = flat(restore_raw(tmp_path / "killed/checkpoints", 2))
  assert any(v.tobytes() != before[k].tobytes() for k, v in flat(a).items() if k.startswith("params"))  # it trained
