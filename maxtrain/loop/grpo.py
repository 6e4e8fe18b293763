"""GRPO in the training loop (`post.mode=grpo`): the pretraining Trainer (checkpoints, resume, events,
metrics, watchdog, preemption, evals) with its step replaced by a rollout -> score -> train round.

Each round k (a `steps` unit; each makes post.ppo_epochs x post.minibatches optimizer steps, so
the state's step is k x that):
- rollout: the post.prompts_per_step prompts of the data position q (`PromptData`, a function of seed
  and q), each repeated post.group_size times, sampled by the project's KV-cache generator
  (`inference/sampling.py`) on the training mesh with the current parameters (the same arrays: no
  copy), seed derived from (seed, q), so a resumed run samples the same completions. q counts the
  rounds drawn and only moves forward (the checkpoint's data state): it equals k until a rollback,
  after which the redone rounds draw new prompts and seeds, as pretraining's loader does;
- score: the reward function `post.reward` (module:function(prompt, completion, meta) -> float) on the
  host, per completion (cut at its first EOS);
- train: rows prompt + completion (+ EOS) with the loss mask on completion tokens, group-normalised
  advantages, reference log-probs from the frozen reference (the initial parameters: checkpoint.init_from,
  else the seed's initialisation, rebuilt on resume), the old log-probs from the trainer's forward pass
  before the first update; then the optimizer steps (`program/rl_step.py`);
- guards: each update's flags (non-finite, gradient-norm spike) go to pretraining's `GuardPolicy` in
  rounds (`loop/rollback.py`): events, and a rollback, skip or abort as guards.* say.
Scalars (TensorBoard `rl/*`): reward mean/std, KL, entropy, clip fraction, response length, the
fraction of zero-advantage groups, `rl/logprob_gap` (max |sampler - trainer| log-prob on the round's
completion tokens) and the rollout / score / train seconds.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np

from maxtrain.errors import require
from maxtrain.loop import sft as sft_loop
from maxtrain.loop.rl_data import score
from maxtrain.loop.rollback import Rollback
from maxtrain.loop.trainer import Trainer
from maxtrain.program import rl_loss, rl_step
from maxtrain.program import state as state_lib

log = logging.getLogger("maxtrain")
ROLLOUTS_FILE = "rollouts.jsonl"  # post.log_rollouts
GUARD_FLAGS = ("nonfinite", "nonfinite_update", "spike", "loss_zscore", "consecutive_bad", "grad_norm")


def rollout_rows(prompt_ids: Sequence[Sequence[int]], tokens_BN: np.ndarray, scores_BN2: np.ndarray, eos_id: int,
                 seq_len: int) -> tuple[dict[str, np.ndarray], np.ndarray, list[list[int]]]:
  """(rows of KEYS + "sampler_logp" + "entropy", completion lengths [B], completion ids without EOS):
  each row is prompt + completion (through its first EOS, kept), one segment, padded; the loss mask
  and the sampler's log-probs sit at the positions whose target is a completion token."""
  B = len(prompt_ids)
  rows = {k: np.zeros((B, seq_len), np.float32 if k in ("loss_mask", "sampler_logp", "entropy") else np.int32)
          for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask", "sampler_logp", "entropy")}
  lengths, texts = np.zeros(B, np.int32), []
  for b, prompt in enumerate(prompt_ids):
    row = tokens_BN[b].tolist()
    n = next((i + 1 for i, t in enumerate(row) if t == eos_id), len(row))  # through the EOS
    seq = list(prompt) + row[:n]
    require(len(seq) <= seq_len + 1, f"a prompt of {len(prompt)} tokens + post.max_new_tokens does not fit "
            f"config.data.seq_len={seq_len} + 1: raise data.seq_len")
    m = len(seq) - 1
    rows["inputs"][b, :m], rows["targets"][b, :m] = seq[:-1], seq[1:]
    rows["positions"][b] = np.arange(seq_len)
    rows["segment_ids"][b, :m], rows["segment_ids"][b, m:] = 1, 2
    first = len(prompt) - 1  # the position whose target is completion token 0
    rows["loss_mask"][b, first:first + n] = 1.0
    rows["sampler_logp"][b, first:first + n] = scores_BN2[b, :n, 0]
    rows["entropy"][b, first:first + n] = scores_BN2[b, :n, 1]
    lengths[b] = n
    texts.append(row[:n - 1] if row[n - 1:n] == [eos_id] else row[:n])
  return rows, lengths, texts


def logprob_gap(trainer_logp: np.ndarray, sampler_logp: np.ndarray, mask: np.ndarray) -> float:
  """`rl/logprob_gap`: the max |trainer - sampler| log-probability over the completion tokens (mask > 0)."""
  return float(np.max(np.abs(trainer_logp - sampler_logp) * mask))


def check_config(cfg: ml_collections.ConfigDict) -> None:
  """The GRPO keys, before anything is built (UserError naming the key)."""
  p, b = cfg.post, cfg.data.batch_size
  for key in ("prompts_per_step", "group_size", "ppo_epochs", "minibatches", "max_new_tokens"):
    require(p[key] >= 1, f"config.post.{key}={p[key]}: must be >= 1")
  require(p.group_size >= 2, f"config.post.group_size={p.group_size}: GRPO needs >= 2 completions per prompt")
  rows = p.prompts_per_step * p.group_size
  require(rows % p.minibatches == 0 and b == rows // p.minibatches,
          f"config.data.batch_size={b} must be post.prompts_per_step x post.group_size / post.minibatches = "
          f"{p.prompts_per_step} x {p.group_size} / {p.minibatches}: the optimizer step's batch")
  require(p.temperature > 0, f"config.post.temperature={p.temperature}: GRPO samples, it must be > 0")
  require(p.clip_eps > 0 and p.kl_coef >= 0, f"config.post.clip_eps={p.clip_eps}, post.kl_coef={p.kl_coef}: "
          "need clip_eps > 0 and kl_coef >= 0")


class GrpoTrainer(Trainer):
  """Trainer whose loop is GRPO rounds (module docstring); everything else is the Trainer's."""

  def __init__(self, cfg: ml_collections.ConfigDict, t_process_start: float | None = None):
    check_config(cfg)
    super().__init__(cfg, t_process_start)
    p = cfg.post
    self.updates_per_round = p.ppo_epochs * p.minibatches
    self.logprobs, self.grpo_step = rl_step.jit_pieces(self.program, clip_eps=p.clip_eps, kl_coef=p.kl_coef,
                                                       on_policy=self.updates_per_round == 1)
    self.rollbacks.policy.unit, self.rollbacks.policy.signal = "round", "grad_norm"  # loop/rollback.py, per round

  def _reference(self, state: state_lib.TrainState) -> Any:
    """The frozen reference: the run's starting parameters (rebuilt, not saved: also after a resume)."""
    if self.cfg.checkpoint.init_from:
      from maxtrain.interop import init_from
      from maxtrain.sharding.layout import with_shardings

      spec = self.program.state
      return init_from.load_params(self.cfg.checkpoint.init_from, self.program.model_cfg,
                                   with_shardings(spec.abstract.params, spec.shardings.params))
    if int(state.step) == 0:
      return jax.tree.map(lambda x: x.copy(), state.params)  # the state is donated to the step
    return state_lib.initialize(self.program.state, self.program.mesh).params

  def _loop(self, state: state_lib.TrainState) -> float:
    cfg, eval_loss = self.cfg, float("nan")
    step = self.step = int(state.step) // self.updates_per_round
    if step >= cfg.steps:
      return self._evaluate(state, step)
    reference = self._reference(state)
    generator = sft_loop.make_generator(self.program, state.params)
    if step == 0:
      self._evaluate(state, 0)
    with jax.set_mesh(self.program.mesh):
      while step < cfg.steps:
        position = self.data.get_state()["step"]  # rounds of prompts drawn: only moves forward (rollbacks)
        state, metrics, scalars, flags = self._round(state, step, position, reference, generator)
        step = self.step = step + 1
        self.data.set_state({"step": position + 1})
        self.faults.in_graph_ran(step)  # before a rollback: the round redone after it runs clean
        rollback = self.rollbacks.after_updates(step, flags, self.updates_per_round)
        if rollback is not None:
          state, step = self._rollback(rollback)
          self.watchdog.beat(step)
          continue
        data_state = self.data.get_state()
        if self.metrics.summary is None:
          self.metrics.first_step(step, metrics, self.t_start)
        if step % cfg.log_every == 0 or step == cfg.steps:
          self.metrics.train(step, metrics)
          self.metrics.scalars(step, scalars)
          log.info("round %d  reward %.3f +- %.3f  kl %.4f  logprob_gap %.2e  rollout %.2fs score %.2fs train %.2fs",
                   step, scalars["rl/reward_mean"], scalars["rl/reward_std"], scalars["rl/kl"],
                   scalars["rl/logprob_gap"], scalars["rl/rollout_s"], scalars["rl/score_s"], scalars["rl/train_s"])
        eval_loss = self._after_step(state, step, data_state, eval_loss)
    self.checkpoints.check_final(step)
    return eval_loss

  def _rollback(self, rollback: Rollback) -> tuple[state_lib.TrainState, int]:
    """Pretraining's rollback (loop/rollback.py) in rounds."""
    state = self.rollbacks.perform(rollback, self.program.state, self._starting_state, per_step=self.updates_per_round)
    step = self.step = int(state.step) // self.updates_per_round
    self.metrics.restart_interval(step)
    return state, step

  def _rollout(self, state: state_lib.TrainState, q: int, generator: Any) -> tuple[list[dict], np.ndarray, np.ndarray, list]:
    """Position q's prompts, each group_size times, sampled with a seed derived from (seed, q)."""
    from maxtrain.inference.sampling import Sampling

    p, tok = self.cfg.post, self.data.tokenizer
    examples = [e for e in self.data.prompts(q) for _ in range(p.group_size)]
    prompt_ids = [tok.encode(e["prompt"]).tolist() for e in examples]
    generator.params = state.params  # the current parameters themselves
    seed = int(np.random.default_rng([self.cfg.seed, q, 11]).integers(2**31))
    tokens_BN, scores_BN2, _ = generator.generate_scored(prompt_ids, p.max_new_tokens,
                                                         Sampling(temperature=p.temperature, seed=seed),
                                                         vocab_limit=tok.vocab_size)
    return examples, prompt_ids, tokens_BN, scores_BN2

  def _round(self, state: state_lib.TrainState, k: int, q: int, reference: Any,
             generator: Any) -> tuple[Any, dict, dict, list[dict]]:
    """Round k + 1 on position q's rollouts: (state, last update's metrics, scalars, each update's guard flags)."""
    p, tok = self.cfg.post, self.data.tokenizer
    t0 = time.monotonic()
    examples, prompt_ids, tokens_BN, scores_BN2 = self._rollout(state, q, generator)
    t1 = time.monotonic()
    rows, lengths, completions = rollout_rows(prompt_ids, tokens_BN, scores_BN2, tok.eos_id, self.cfg.data.seq_len)
    texts = [tok.decode(c) for c in completions]
    rewards = score(self.data.reward_fn, p.reward, examples, texts)
    if p.log_rollouts and jax.process_index() == 0:
      self._log_rollouts(k + 1, q, examples, texts, rewards)
    trained = -rewards if p.negate_reward else rewards
    adv_PG = np.asarray(rl_loss.group_advantages(trained.reshape(p.prompts_per_step, p.group_size)))
    t2 = time.monotonic()
    mask = rows["loss_mask"]
    host = {k: rows[k] for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask")}
    host["advantages"] = adv_PG.reshape(-1, 1) * mask
    host["old_logp"] = np.zeros_like(mask)
    host["ref_logp"] = np.zeros_like(mask)
    batch = rl_step.to_device(host, self.program)
    host["ref_logp"] = np.asarray(self.logprobs(reference, batch))
    host["old_logp"] = np.asarray(self.logprobs(state.params, batch))
    gap = logprob_gap(host["old_logp"], rows["sampler_logp"], mask)
    n, per, flags = len(mask), len(mask) // p.minibatches, []
    fault = self.faults.in_graph(k + 1)  # faults.nan_at_step / spike_at_step: every update of that round
    for _ in range(p.ppo_epochs):
      for i in range(p.minibatches):
        minibatch = {key: v[i * per:(i + 1) * per] for key, v in host.items()}
        state, metrics = self.grpo_step(state, rl_step.to_device(minibatch, self.program, fault))
        flags.append({key: metrics[key] for key in GUARD_FLAGS})
    jax.block_until_ready(metrics)
    t3 = time.monotonic()
    count = max(float(mask.sum()), 1.0)
    metrics = jax.device_get(metrics)
    scalars = {"rl/reward_mean": float(rewards.mean()), "rl/reward_std": float(rewards.std()),
               "rl/kl": float(metrics["kl"]), "rl/clip_fraction": float(metrics["clip_fraction"]),
               "rl/ratio_mean": float(metrics["ratio_mean"]),
               "rl/entropy": float((rows["entropy"] * mask).sum() / count),
               "rl/response_length": float(lengths.mean()),
               "rl/zero_advantage_groups": float(np.mean(np.all(adv_PG == 0, axis=1))),
               "rl/logprob_gap": gap, "rl/rollout_s": t1 - t0, "rl/score_s": t2 - t1, "rl/train_s": t3 - t2,
               "rl/rollout_tokens_per_s": float(n * p.max_new_tokens) / max(t1 - t0, 1e-9)}
    self.metrics.tokens_per_step = n * self.cfg.data.seq_len * p.ppo_epochs
    return state, metrics, scalars, flags

  def _log_rollouts(self, round_: int, position: int, examples: list[dict], texts: list[str],
                    rewards: np.ndarray) -> None:
    """One line per round in <output_dir>/rollouts.jsonl (a resumed run appends the rounds it redoes; a
    round redone after a rollback is drawn at a new prompt position)."""
    record = {"round": round_, "position": position, "prompts": [e["prompt"] for e in examples],
              "completions": texts, "rewards": rewards.tolist()}
    with open(self.out_dir / ROLLOUTS_FILE, "a", encoding="utf-8") as f:
      f.write(json.dumps(record) + "\n")


def run(cfg: ml_collections.ConfigDict, t_process_start: float | None = None) -> dict:
  return GrpoTrainer(cfg, t_process_start).train()
