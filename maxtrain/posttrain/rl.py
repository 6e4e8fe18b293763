"""The RL stepper (`post.mode=rl`): one step of the Loop is a round, rollout -> score -> advantages ->
post.ppo_epochs x post.minibatches optimizer updates, of the algorithm `post.algorithm` names
(`algorithms/`). The Loop (`loop/trainer.py`) keeps everything else: checkpoints, resume, events,
metrics, watchdog, preemption, evals, guards and rollback.

Each round k:
- rollout (`rollout.py`): prompt batch q (the data position; it equals k until a rollback or a dynamic
  sampling draw moves it on), each prompt post.group_size times, sampled with a seed from (seed, q);
- score: the rewards `post.reward` on the host, per completion (cut at its first EOS);
- train: rows prompt + completion (+ EOS) with the loss mask on completion tokens, reference log-probs
  from the frozen reference (the initial parameters: checkpoint.init_from, else the seed's
  initialisation, rebuilt on resume), old log-probs from the trainer's forward pass before the first
  update, the algorithm's advantages; then the optimizer updates (`rl_step.py`);
- guards: each update's flags go to pretraining's guard policy in rounds (`loop/rollback.py`).
Scalars (TensorBoard `rl/*`): reward mean/std (and `rl/reward/<function>` per reward), KL, entropy,
clip fraction, response length, the fraction of zero-advantage groups, `rl/logprob_gap` (max |sampler -
trainer| log-prob on the round's completion tokens), the groups dynamic sampling dropped, and the
rollout / score / train seconds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from maxtrain.config import schema
from maxtrain.inference import sampling as sampling_lib
from maxtrain.monitor import events as ev
from maxtrain.posttrain import algorithms, correction, packing, rl_step, rollout as rollout_lib
from maxtrain.posttrain.data import PromptData
from maxtrain.program import batch as batch_lib, state as state_lib
from maxtrain.interop import init_from
from maxtrain.sharding.layout import with_shardings

log = logging.getLogger("maxtrain")
ROLLOUTS_FILE = "rollouts.jsonl"  # post.log_rollouts
# What users track of RL's utilisation: TensorBoard scalars, and an `rl_round` event per logged round
UTILISATION = ("rl/trainer_busy", "rl/updates_per_s", "rl/rollout_tokens_per_s", "rl/trainer_idle_s",
               "rl/rollout_idle_s", "rl/staleness_mean", "rl/padding_share")
GUARD_FLAGS = ("nonfinite", "nonfinite_update", "spike", "loss_zscore", "consecutive_bad", "grad_norm")


def completion_tokens(draws: list) -> float:
  """The tokens the round's draws generated (each completion through its EOS)."""
  return float(sum(int(d.lengths.sum()) for d in draws))


@dataclasses.dataclass
class Outcome:
  """What a step hands the Loop: the last update's metrics, host scalars to log, and each update's
  guard flags (read by the Loop's guard policy)."""
  metrics: Any
  scalars: dict[str, float] | None = None
  flags: list[dict] | None = None


class RlStepper:
  """A round of the configured algorithm per Loop step (module docstring)."""
  unit = "round"
  spike_signal = "grad_norm"  # the surrogate loss is ~0 by construction: the guards watch the gradient norm
  evaluates_at_start = True  # the starting model's held-out reward is the baseline
  reports_mismatch = False  # rl/mismatch_kl and the correction's shares without a correction (the async stepper)

  def __init__(self, cfg: schema.Config, program: Any, observers: Any, metrics: Any, out_dir: Path,
               starting_state: Any):
    self.cfg, self.program, self.observers, self.metrics, self.out_dir = cfg, program, observers, metrics, out_dir
    self.algorithm, self.hp = algorithms.resolve(cfg.post)
    p = cfg.post
    self.updates_per_step = p.ppo_epochs * p.minibatches
    self.pieces = rl_step.build(program, self.algorithm, self.hp, on_policy=self.updates_per_step == 1)
    self.data = PromptData(cfg, program.batch_shardings)
    self._starting_state = starting_state
    self.reference = self.generator = None

  def describe(self) -> str:
    hp = self.hp
    return (f"{self.algorithm.name}: clip [{1 - hp.clip_low:g}, {1 + hp.clip_high:g}], kl_coef {hp.kl_coef:g}, "
            f"{self.updates_per_step} updates a round"
            + (f", overlong buffer {hp.overlong_buffer}" if hp.overlong_buffer else "")
            + (f", up to {hp.max_draws} draws a round" if self.algorithm.dynamic_sampling else ""))

  def start(self, state: state_lib.TrainState, step: int) -> None:
    """Before the attempt's first round: the frozen reference and the generator."""
    if self.data.restored_in_flight:  # an asynchronous run's queue (posttrain/async_rollout.py), resumed synchronously
      log.warning("the checkpoint holds %d rollout batches made ahead by an asynchronous run (post.max_staleness); "
                  "this synchronous run samples its rounds itself and does not train on them",
                  len(self.data.restored_in_flight))
      self.data.restored_in_flight = []
    self.reference = self._reference(state)
    self.generator = sampling_lib.for_program(self.program, state.params)

  def _reference(self, state: state_lib.TrainState) -> Any:
    """The frozen reference: the run's starting parameters (rebuilt, not saved: also after a resume)."""
    if self.cfg.checkpoint.init_from:
      spec = self.program.state
      return init_from.load_params(self.cfg.checkpoint.init_from, self.program.model_cfg,
                                   with_shardings(spec.abstract.params, spec.shardings.params))
    if int(state.step) == 0:
      return jax.tree.map(lambda x: x.copy(), state.params)  # the state is donated to the step
    return self._starting_state().params

  def run(self, state: state_lib.TrainState, step: int) -> tuple[state_lib.TrainState, Outcome]:
    """Round `step` (1-based) at the data position; the position moves past every prompt batch drawn."""
    p, hp, data = self.cfg.post, self.hp, self.data
    t0 = time.monotonic()
    r, draws = self._rollout(state, step)
    t1 = time.monotonic()
    if p.log_rollouts and jax.process_index() == 0:
      self._log_rollouts(step, r.positions[0], r)
    trained = -r.rewards if p.negate_reward else r.rewards
    rows, mask = r.rows, r.rows["loss_mask"]
    host = {k: rows[k] for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask")}
    if p.pack_updates:  # the log-prob passes over the packed minibatches too (no critic: refused at load)
      host["ref_logp"], host["old_logp"] = self._packed_logprobs(state.params, host)
    else:
      zeros = np.zeros_like(mask)
      batch = rl_step.to_device({**host, **{k: zeros for k in self.pieces.batch_shardings if k in rl_step.RL_KEYS
                                            + rl_step.CRITIC_KEYS}}, self.program)
      host["ref_logp"] = batch_lib.to_host(self.pieces.logprobs(self.reference, batch))
      host["old_logp"] = batch_lib.to_host(self.pieces.logprobs(state.params, batch))
    rewards_PG = trained.reshape(p.prompts_per_step, p.group_size)
    if self.algorithm.critic:  # GAE from the critic's values at the rollout (PPO)
      host["old_values"] = batch_lib.to_host(self.pieces.values(state.params, state.opt_state.params, batch)) * mask
      host["advantages"], host["returns"] = self.algorithm.advantages(rewards_PG, host["old_logp"], host["ref_logp"],
                                                                      mask, hp, values_BT=host["old_values"])
    else:
      host["advantages"] = self.algorithm.advantages(rewards_PG, host["old_logp"], host["ref_logp"], mask, hp)
    gap = rollout_lib.logprob_gap(host["old_logp"], rows["sampler_logp"], mask)
    correction_scalars = {}
    if p.correction != "none" or self.reports_mismatch:  # the rollout policy against the trainer's at the round's start
      weights, correction_scalars = correction.weights(host["old_logp"], rows["sampler_logp"], mask, p.correction,
                                                       p.is_cap)
      host["advantages"] = (host["advantages"] * weights).astype(np.float32)
    per, flags = len(mask) // p.minibatches, []
    minibatches = [{key: v[i * per:(i + 1) * per] for key, v in host.items()} for i in range(p.minibatches)]
    if p.pack_updates:  # each minibatch's completions in fewer rows, kept apart by document ids
      shards = self.program.plan.layout.shards("act_batch")
      minibatches = [packing.pack(minibatch, shards)[0] for minibatch in minibatches]
    update_rows = sum(len(minibatch["inputs"]) for minibatch in minibatches)
    real_B = packing.lengths(rows["segment_ids"])  # each row's real tokens (the padding share's)
    for _ in range(p.ppo_epochs):
      for minibatch in minibatches:
        # every update of the round is the round's batch to the loop's observers (a drill: the same for all)
        state, metrics = self.pieces.step(state, self.observers.batch(step, rl_step.to_device(minibatch, self.program)))
        flags.append({key: metrics[key] for key in GUARD_FLAGS})
    jax.block_until_ready(metrics)
    t3 = time.monotonic()
    count = max(float(mask.sum()), 1.0)
    metrics = jax.device_get(metrics)
    adv_rows = np.abs(host["advantages"]).sum(axis=1).reshape(p.prompts_per_step, p.group_size)
    scalars = {"rl/reward_mean": float(r.rewards.mean()), "rl/reward_std": float(r.rewards.std()),
               "rl/kl": float(metrics["kl"]), "rl/clip_fraction": float(metrics["clip_fraction"]),
               "rl/ratio_mean": float(metrics["ratio_mean"]),
               "rl/entropy": float((rows["entropy"] * mask).sum() / count),
               "rl/response_length": float(r.lengths.mean()),
               "rl/zero_advantage_groups": float(np.mean(np.all(adv_rows == 0, axis=1))),
               "rl/logprob_gap": gap, "rl/rollout_s": t1 - t0 - r.score_s, "rl/score_s": r.score_s,
               "rl/train_s": t3 - t1,  # the log-prob passes, the advantages and the updates
               "rl/rollout_tokens_per_s": completion_tokens(draws) / max(t1 - t0 - r.score_s, 1e-9),
               # colocated: the updates wait for the rollout and the generator for the updates
               "rl/trainer_busy": (t3 - t1) / max(t3 - t0, 1e-9),
               "rl/updates_per_s": self.updates_per_step / max(t3 - t0, 1e-9),
               "rl/trainer_idle_s": t1 - t0, "rl/rollout_idle_s": t3 - t1,
               "rl/padding_share": packing.padding_share(real_B, (update_rows, mask.shape[1]))}
    if p.pack_updates:
      scalars["rl/padding_share_unpacked"] = packing.padding_share(real_B, mask.shape)
    scalars.update({f"rl/reward/{name}": float(v.mean()) for name, v in r.parts.items()})  # each on its own
    scalars.update(correction_scalars)
    if self.algorithm.critic:  # the critic at the rollout against the round's returns (all its tokens)
      on = mask > 0
      error, returns = (host["old_values"] - host["returns"])[on], host["returns"][on]
      scalars.update({"rl/value_loss": float(0.5 * np.mean(np.square(error))),
                      "rl/explained_variance": float(1.0 - np.var(error) / max(float(np.var(returns)), 1e-8))})
    if self.algorithm.dynamic_sampling:
      scalars.update({"rl/draws": float(len(draws)), "rl/dropped_groups": float(r.dropped_groups),
                      "rl/sampled_reward_mean": float(r.sampled_rewards.mean())})
    self.metrics.tokens_per_step = update_rows * self.cfg.data.seq_len * p.ppo_epochs
    return state, Outcome(metrics, scalars, flags)

  def _packed_logprobs(self, params: Any, host: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(reference, old) log-probs [B, T] of the round's rows from passes over each minibatch packed as the
    updates pack it (`posttrain/packing.py`), read back into the rows (0 past each row's tokens)."""
    shape, minibatches = host["inputs"].shape, self.cfg.post.minibatches
    per, shards = shape[0] // minibatches, self.program.plan.layout.shards("act_batch")
    ref, old = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    for i in range(minibatches):
      part = {k: v[i * per:(i + 1) * per] for k, v in host.items()}
      packed, groups = packing.pack(part, shards)
      zeros = np.zeros_like(packed["loss_mask"])
      batch = rl_step.to_device({**packed, **{k: zeros for k in self.pieces.batch_shardings if k in rl_step.RL_KEYS}},
                                self.program)
      m_B = packing.lengths(part["segment_ids"])
      for out, which in ((ref, self.reference), (old, params)):
        logp = batch_lib.to_host(self.pieces.logprobs(which, batch))
        out[i * per:(i + 1) * per] = packing.unpack(logp, groups, m_B, part["inputs"].shape)
    return ref, old

  def _rollout(self, state: state_lib.TrainState, step: int) -> tuple[rollout_lib.Rollout, list]:
    """Round `step`'s rollout (and every draw made for it), sampled here with the current parameters;
    the data position moves past every prompt batch drawn."""
    p, data = self.cfg.post, self.data
    q, draws = data.step, []
    while True:  # one draw, or (dynamic sampling) until the round has enough groups whose rewards differ
      draws.append(rollout_lib.sample(data, self.generator, state.params, q + len(draws), p, self.cfg.seed,
                                      self.cfg.data.seq_len))
      varied = sum(np.ptp(d.rewards.reshape(-1, p.group_size), axis=1).astype(bool).sum() for d in draws)
      if not self.algorithm.dynamic_sampling or varied >= p.prompts_per_step or len(draws) >= self.hp.max_draws:
        break
    data.step = q + len(draws)
    return rollout_lib.select(draws, p.group_size, p.prompts_per_step, self.algorithm.dynamic_sampling), draws

  def after_run(self, step: int, last: bool) -> None:
    pass  # the next round samples with the parameters this one made: nothing to read ahead

  def after_rollback(self, step: int, last: bool) -> None:
    pass

  def guard(self, rollbacks: Any, step: int, outcome: Outcome, last: bool) -> Any:
    return rollbacks.after_updates(step, outcome.flags, self.updates_per_step)

  def log_line(self, step: int, outcome: Outcome) -> None:
    s = outcome.scalars
    if jax.process_index() == 0:
      self.metrics.events.emit(ev.RL_ROUND, step, **{k[3:]: round(float(s[k]), 6) for k in UTILISATION if k in s})
    log.info("round %d  reward %.3f +- %.3f  kl %.4f  logprob_gap %.2e  rollout %.2fs score %.2fs train %.2fs",
             step, s["rl/reward_mean"], s["rl/reward_std"], s["rl/kl"], s["rl/logprob_gap"], s["rl/rollout_s"],
             s["rl/score_s"], s["rl/train_s"])

  def _log_rollouts(self, round_: int, position: int, r: rollout_lib.Rollout) -> None:
    """One line per round in <output_dir>/rollouts.jsonl (a resumed run appends the rounds it redoes; a
    round redone after a rollback is drawn at a new prompt position)."""
    record = {"round": round_, "position": position, "prompts": [e["prompt"] for e in r.examples],
              "completions": r.texts, "rewards": r.rewards.tolist()}
    if len(r.parts) > 1:
      record["reward_parts"] = {k: v.tolist() for k, v in r.parts.items()}
    with open(self.out_dir / ROLLOUTS_FILE, "a", encoding="utf-8") as f:
      f.write(json.dumps(record) + "\n")
