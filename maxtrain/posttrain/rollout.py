"""Rollouts: a round's prompts sampled by the project's KV-cache generator (`inference/sampling.py`) on
the training mesh with the current parameters (the same arrays: no copy), scored by the rewards, and
turned into training rows.

Prompt batch q (the data position) is sampled with a seed derived from (seed, q), so a resumed run
samples the same completions. With dynamic sampling (DAPO) a round draws batches q, q + 1, ... (up to
post.max_draws) until it holds post.prompts_per_step groups whose rewards differ; the position moves
past every batch drawn, so it only moves forward, as pretraining's loader does. A rollout travels as JSON
(`encode`/`decode`: the checkpoint's in-flight queue, the batches a rollout process posts back), and with
post.rollout_devices it is sampled by the rollout side's own program (`rollout_program`).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import time
from typing import Any, Sequence

import jax
import numpy as np

from maxtrain import config as config_lib
from maxtrain.errors import require
from maxtrain.posttrain import rewards as rewards_lib
from maxtrain.inference import continuous
from maxtrain.inference.sampling import Sampling
from maxtrain.program.build import program_for, split_devices
from maxtrain.sharding.mesh import fully_sharded

ROW_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask", "sampler_logp", "entropy")


def rollout_rows(prompt_ids: Sequence[Sequence[int]], tokens_BN: np.ndarray, scores_BN2: np.ndarray, eos_id: int,
                 seq_len: int, where: Sequence[str] | None = None) -> tuple[dict[str, np.ndarray], np.ndarray, list[list[int]]]:
  """(rows of KEYS + "sampler_logp" + "entropy", completion lengths [B], completion ids without EOS):
  each row is prompt + completion (through its first EOS, kept), one segment, padded; the loss mask
  and the sampler's log-probs sit at the positions whose target is a completion token. `where`: each
  row's example origin (file:line), named when a row does not fit."""
  B = len(prompt_ids)
  rows = {k: np.zeros((B, seq_len), np.float32 if k in ("loss_mask", "sampler_logp", "entropy") else np.int32)
          for k in ROW_KEYS}
  lengths, texts = np.zeros(B, np.int32), []
  for b, prompt in enumerate(prompt_ids):
    row = tokens_BN[b].tolist()
    n = next((i + 1 for i, t in enumerate(row) if t == eos_id), len(row))  # through the EOS
    seq = list(prompt) + row[:n]
    origin = f"{where[b]}: " if where else ""
    require(len(seq) <= seq_len + 1, f"{origin}a prompt of {len(prompt)} tokens + post.max_new_tokens does not fit "
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


@dataclasses.dataclass
class Rollout:
  """A round's sampled and scored completions, P x G rows (group g is rows g*G .. g*G + G - 1)."""
  examples: list[dict]
  rows: dict[str, np.ndarray]
  lengths: np.ndarray
  texts: list[str]
  rewards: np.ndarray  # [B] the weighted sum trained on (before post.negate_reward)
  parts: dict[str, np.ndarray]  # each reward function's own [B]
  positions: list[int]  # the prompt batches drawn
  sampled_rewards: np.ndarray  # every completion drawn this round (dynamic sampling draws more than B)
  dropped_groups: int  # groups of equal rewards left out of the batch (dynamic sampling)
  score_s: float = 0.0  # seconds the rewards took (the draws' sum)


def sample(data: Any, generator: Any, params: Any, q: int, post: Any, seed: int, seq_len: int) -> Rollout:
  """Prompt batch q, each prompt post.group_size times, sampled at post.temperature and scored."""
  tok = data.tokenizer
  examples = [e for e in data.prompts(q) for _ in range(post.group_size)]
  prompt_ids = [tok.encode(e["prompt"]).tolist() for e in examples]
  generator.params = params  # the current parameters themselves
  sampling_seed = int(np.random.default_rng([seed, q, 11]).integers(2**31))
  sampling = Sampling(temperature=post.temperature, seed=sampling_seed)
  if post.continuous_batching:  # rows freed at EOS take the next prompt (inference/continuous.py)
    tokens_BN, scores_BN2, _ = continuous.batcher(generator, post.continuous_batching).generate_scored(
        prompt_ids, post.max_new_tokens, sampling, tok.eos_id, vocab_limit=tok.vocab_size)
  else:
    tokens_BN, scores_BN2, _ = generator.generate_scored(prompt_ids, post.max_new_tokens, sampling,
                                                         vocab_limit=tok.vocab_size)
  rows, lengths, completions = rollout_rows(prompt_ids, tokens_BN, scores_BN2, tok.eos_id, seq_len,
                                            [e.get("where", "") for e in examples])
  texts = [tok.decode(c) for c in completions]
  t0 = time.monotonic()
  rewards, parts = rewards_lib.score_all(data.rewards, examples, texts)
  return Rollout(examples, rows, lengths, texts, rewards, parts, [q], rewards, 0, time.monotonic() - t0)


def select(rollouts: Sequence[Rollout], group_size: int, groups: int, dynamic: bool) -> Rollout:
  """The round's `groups` groups from the draws: all of the one draw, or (dynamic sampling) the groups
  whose rewards differ first, in draw order, topped up with equal-reward groups when the draws ran out."""
  if not dynamic:
    assert len(rollouts) == 1
    return rollouts[0]
  varied, equal = [], []
  for d, r in enumerate(rollouts):
    for g in range(len(r.rewards) // group_size):
      chosen = r.rewards[g * group_size:(g + 1) * group_size]
      (varied if np.ptp(chosen) > 0 else equal).append((d, g))
  picked = (varied + equal)[:groups]
  index = [(d, g * group_size + i) for d, g in picked for i in range(group_size)]

  def take(get):
    return [get(rollouts[d], i) for d, i in index]

  rows = {k: np.stack(take(lambda r, i: r.rows[k][i])) for k in ROW_KEYS}
  parts = {k: np.asarray(take(lambda r, i: r.parts[k][i]), np.float32) for k in rollouts[0].parts}
  return Rollout(examples=take(lambda r, i: r.examples[i]), rows=rows,
                 lengths=np.asarray(take(lambda r, i: r.lengths[i]), np.int32), texts=take(lambda r, i: r.texts[i]),
                 rewards=np.asarray(take(lambda r, i: r.rewards[i]), np.float32), parts=parts,
                 positions=[q for r in rollouts for q in r.positions],
                 sampled_rewards=np.concatenate([r.rewards for r in rollouts]),
                 dropped_groups=len(equal) - max(0, groups - len(varied)), score_s=sum(r.score_s for r in rollouts))


def _array(a: np.ndarray) -> str:
  buf = io.BytesIO()
  np.save(buf, np.asarray(a), allow_pickle=False)
  return base64.b64encode(buf.getvalue()).decode("ascii")


def _unarray(text: str) -> np.ndarray:
  return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


def encode(r: Rollout) -> dict:
  """A rollout as JSON (the checkpoint's data state): arrays as .npy bytes, bit for bit."""
  return {"examples": r.examples, "texts": r.texts, "positions": r.positions, "dropped_groups": r.dropped_groups,
          "score_s": r.score_s, "rows": {k: _array(v) for k, v in r.rows.items()},
          "parts": {k: _array(v) for k, v in r.parts.items()},
          **{k: _array(getattr(r, k)) for k in ("lengths", "rewards", "sampled_rewards")}}


def decode(d: dict) -> Rollout:
  return Rollout(examples=d["examples"], rows={k: _unarray(v) for k, v in d["rows"].items()},
                             lengths=_unarray(d["lengths"]), texts=d["texts"], rewards=_unarray(d["rewards"]),
                             parts={k: _unarray(v) for k, v in d["parts"].items()}, positions=d["positions"],
                             sampled_rewards=_unarray(d["sampled_rewards"]), dropped_groups=d["dropped_groups"],
                             score_s=d["score_s"])


def rollout_program(cfg: Any) -> Any:
  """The rollout side's program on the last post.rollout_devices devices (the model fully sharded over
  them; nothing else of it is built or run), or None without them."""
  devices = split_devices(cfg, jax.devices())[1]
  if not devices:
    return None
  changes = {"post.rollout_devices": 0, "post.max_staleness": 0, "post.rollout_dtype": "", **fully_sharded(cfg.mesh)}
  if cfg.post.rollout_dtype:  # e.g. a bf16 rollout mesh under an fp32 trainer (the mismatch rl/mismatch_kl measures)
    changes.update({"model.param_dtype": cfg.post.rollout_dtype, "model.compute_dtype": cfg.post.rollout_dtype})
  rcfg = config_lib.with_values(config_lib.Config.of(cfg), changes)
  return program_for(rcfg, devices, require_data=False)
