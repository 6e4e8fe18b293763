"""Post-training data: `SftData` (packed prompt/response rows with the loss on the response, held-out
eval batches and greedy exact match) and `PromptData` (SftData's held-out parts plus each round's
prompts, for RL). Both implement the Loop's data interface (`loop/stepper.py` Data) themselves.

The train order is a permutation per epoch (seed + epoch): batch k (SFT) or prompt batch q (RL) is a
function of (seed, k), so the data state is a count, plus the identity of the data it indexes
(`data/sft.py` source_identity: each file's path, size and SHA-256 of what was read): a resume on other
data is exit 2 naming the file (or, with post.resume_new_data, goes on with a warning and an event).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import jax
import numpy as np

from maxtrain.config import schema
from maxtrain.data import sft as sft_data
from maxtrain.data.pipeline import KEYS
from maxtrain.data.tokenizer import load_tokenizer
from maxtrain.errors import UserError, require
from maxtrain.inference import sampling as sampling_lib
from maxtrain.posttrain import rewards as rewards_lib
from maxtrain.program import batch as batch_lib
from maxtrain.inference.sampling import Sampling

log = logging.getLogger("maxtrain")


class SftData:
  def __init__(self, cfg: schema.Config, batch_shardings: dict[str, Any], *, pack_train: bool = True):
    d, p = cfg.data, cfg.post
    self.tokenizer = load_tokenizer(d.tokenizer)
    require(self.tokenizer.vocab_size <= cfg.model.vocab_size,
            f"config.data.tokenizer={d.tokenizer!r} has {self.tokenizer.vocab_size} ids, more than "
            f"config.model.vocab_size={cfg.model.vocab_size}")
    self.source, self.batch_size, self.seed = p.data, d.batch_size, cfg.seed
    self.allow_new_data, self.shardings, self.step = p.resume_new_data, batch_shardings, 0
    self.identity = sft_data.source_identity(p.data)
    self.data_change: str | None = None  # set by set_state when post.resume_new_data let other data through
    evals = sft_data.packed_rows(p.data, "eval", self.tokenizer, d.seq_len, cfg.seed)
    if pack_train:
      self.train = sft_data.packed_rows(p.data, "train", self.tokenizer, d.seq_len, cfg.seed)
      self.num_rows = len(self.train["inputs"])
      require(self.num_rows >= self.batch_size, f"config.post.data={p.data!r} packs into {self.num_rows} rows of "
              f"data.seq_len={d.seq_len}, fewer than data.batch_size={self.batch_size}")
      self._entropy = _unigram_entropy(self.train["targets"], self.train["loss_mask"])
    n_eval = min(cfg.eval.batches * self.batch_size, len(evals["inputs"]) // self.batch_size * self.batch_size)
    self.eval_sets = {"sft": [batch_lib.global_to_device({k: evals[k][i:i + self.batch_size] for k in KEYS}, batch_shardings)
                              for i in range(0, n_eval, self.batch_size)]}
    self.eval_examples = sft_data.load_examples(p.data, "eval", self.tokenizer)[:p.eval_prompts]
    self.max_new_tokens, self._generator = p.max_new_tokens, None

  # What the Loop reads of every run's data (loop/stepper.py Data).
  @property
  def tokenizer_identity(self) -> str:
    return self.tokenizer.identity

  def describe(self) -> str:
    return (f"sft: {self.source or 'arithmetic'}: {self.num_rows} packed rows, "
            f"{int(self.train['loss_mask'].sum())} response tokens")

  def unigram_entropy(self) -> float:
    return self._entropy

  def close(self) -> None:
    pass  # no reader threads: the rows are in memory

  def check_checkpoint(self, meta: dict, path: Any) -> None:
    saved = meta.get("tokenizer_identity")
    require(saved is None or saved == self.tokenizer_identity, f"checkpoint {path} was trained on data tokenized by "
            f"{saved}, but config.data.tokenizer is {self.tokenizer_identity}: resume with the tokenizer it was "
            "trained with, or start a new run in another output_dir")

  def rows(self, step: int) -> dict[str, np.ndarray]:
    """The rows of the batch that completes as step `step` + 1 (epoch-wise permutations)."""
    per_epoch = self.num_rows // self.batch_size
    epoch, k = divmod(step, per_epoch)
    order = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)[k * self.batch_size:(k + 1) * self.batch_size]
    return {key: self.train[key][order] for key in KEYS}

  def next_batch(self) -> tuple[dict[str, jax.Array], float]:
    t0 = time.monotonic()
    batch = batch_lib.global_to_device(self.rows(self.step), self.shardings)  # the whole batch, every process
    self.step += 1
    return batch, time.monotonic() - t0

  def get_state(self) -> dict:
    return {"step": self.step, "source": self.identity}

  def set_state(self, state: dict) -> None:
    """The checkpoint's position, after checking it indexes this data (rule 1 of DESIGN.md)."""
    if not set(state) <= {"step", "source", "in_flight"} or "step" not in state:  # a pretraining loader's state (data/loader.py)
      raise UserError("the checkpoint's data state is a pretraining loader's (token stores), not post-training "
                      "data: resume it with post.mode='' (pretraining), or start a new run in another output_dir")
    saved = state.get("source")
    if saved is not None and saved != self.identity:
      change = sft_data.describe_change(saved, self.identity)
      if not self.allow_new_data:
        raise UserError(f"the checkpoint was trained on other post-training data: {change}. Its position would index "
                        "other examples. Resume with the data it was trained on, start a new run in another "
                        "output_dir, or set post.resume_new_data=true to go on from the same position on the new data")
      log.warning("post.resume_new_data: the checkpoint was trained on other data (%s); going on from its position",
                  change)
      self.data_change = change
    self.step = int(state["step"])

  def scalars(self, state: dict | None = None) -> dict[str, float]:
    step = self.step if state is None else int(state["step"])
    return {"data/sequences": float(step * self.batch_size),
            "data/epochs": step * self.batch_size / self.num_rows}

  def newly_past_max_epochs(self) -> dict[str, float]:
    return {}

  def bytes_per_token(self, name: str) -> float | None:
    return None

  def extra_eval(self, program: Any, params: Any) -> dict[str, float]:
    """`sft/exact_match` of greedy completions on the held-out prompts (post.eval_prompts)."""
    if not self.eval_examples:
      return {}
    acc = exact_match(self._generator_for(program, params), self.tokenizer, self.eval_examples, self.max_new_tokens)
    log.info("held-out exact match %.3f (%d prompts, greedy)", acc, len(self.eval_examples))
    return {"sft/exact_match": acc}

  def _generator_for(self, program: Any, params: Any) -> Any:
    if self._generator is None:
      self._generator = sampling_lib.for_program(program, params)
    self._generator.params = params
    return self._generator


class PromptData(SftData):
  """SftData's held-out eval rows and examples, plus the round's prompts; evals score greedy
  completions with the reward (`rl/eval_reward`)."""

  def __init__(self, cfg: schema.Config, batch_shardings: dict[str, Any]):
    super().__init__(cfg, batch_shardings, pack_train=False)
    self.examples = sft_data.load_examples(cfg.post.data, "train", self.tokenizer)
    self.per_round = cfg.post.prompts_per_step
    require(len(self.examples) >= self.per_round, f"config.post.data={cfg.post.data!r} has {len(self.examples)} "
            f"train prompts, fewer than post.prompts_per_step={self.per_round}")
    self.temperature = cfg.post.temperature
    self.rewards = rewards_lib.load(cfg.post.reward)  # before compiling: a bad name is exit 2 at once
    self._entropy = float("nan")  # no train tokens before the rollouts
    # The asynchronous rollout side (posttrain/async_rollout.py), when the run has one: the rollouts it has
    # made or started for later rounds are part of the data state (a resume trains on the same ones).
    self.in_flight: Any = None
    self.restored_in_flight: list[dict] = []  # the checkpoint's, until the rollout side takes them

  def get_state(self) -> dict:
    state = super().get_state()
    if self.in_flight is not None:
      state["in_flight"] = self.in_flight.get_state()
    elif self.restored_in_flight:  # restored, not yet taken (the state the attempt starts from)
      state["in_flight"] = self.restored_in_flight
    return state

  def set_state(self, state: dict) -> None:
    super().set_state(state)
    self.restored_in_flight = list(state.get("in_flight", []))

  def close(self) -> None:
    if self.in_flight is not None:
      self.in_flight.close()

  def describe(self) -> str:
    return (f"rl: {self.source or 'arithmetic'}: {len(self.examples)} train prompts, {self.per_round} a draw; "
            f"reward {rewards_lib.describe(self.rewards)}")

  def prompts(self, q: int) -> list[dict]:
    """Prompt batch q (the data position: draws so far), a function of (seed, q)."""
    per_epoch = len(self.examples) // self.per_round
    epoch, i = divmod(q, per_epoch)
    order = np.random.default_rng([self.seed, epoch, 7]).permutation(len(self.examples))
    return [self.examples[j] for j in order[i * self.per_round:(i + 1) * self.per_round]]

  def scalars(self, state: dict | None = None) -> dict[str, float]:
    step = self.step if state is None else int(state["step"])
    return {"data/prompts": float(step * self.per_round), "data/epochs": step * self.per_round / len(self.examples)}

  def extra_eval(self, program: Any, params: Any) -> dict[str, float]:
    """The held-out prompts' mean reward: greedy (`rl/eval_reward`), and sampled at post.temperature
    with a seed fixed for the run (`rl/eval_reward_sampled`: the quantity RL maximises, and the same
    random stream at every eval, so two evals differ only by the parameters)."""
    if not self.eval_examples:
      return {}
    generator = self._generator_for(program, params)
    prompts = [self.tokenizer.encode(e["prompt"]).tolist() for e in self.eval_examples]
    out = {}
    for tag, sampling in (("rl/eval_reward", Sampling()),
                          ("rl/eval_reward_sampled", Sampling(temperature=self.temperature, seed=self.seed + 1))):
      outs, _ = generator.generate(prompts, self.max_new_tokens, sampling, eos_ids=(self.tokenizer.eos_id,),
                                   vocab_limit=self.tokenizer.vocab_size)
      texts = [self.tokenizer.decode(o) for o in outs]
      out[tag] = float(rewards_lib.score_all(self.rewards, self.eval_examples, texts)[0].mean())
    log.info("held-out mean reward %.3f greedy, %.3f sampled at temperature %g (%d prompts)", out["rl/eval_reward"],
             out["rl/eval_reward_sampled"], self.temperature, len(self.eval_examples))
    return out


def _unigram_entropy(targets: np.ndarray, mask: np.ndarray) -> float:
  """Entropy (nats) of the trained-on tokens' unigram distribution: the summary's "learned nothing" mark."""
  counts = np.bincount(targets[mask > 0].reshape(-1))
  p = counts[counts > 0] / max(counts.sum(), 1)
  return float(-(p * np.log(p)).sum())


def exact_match(generator: Any, tokenizer: Any, examples: Sequence[dict], max_new_tokens: int,
                batch: int = 256) -> float:
  """Fraction of examples whose greedy completion (to EOS) equals the response, whitespace-stripped."""
  hits = 0
  for i in range(0, len(examples), batch):
    chunk = examples[i:i + batch]
    prompts = [tokenizer.encode(e["prompt"]).tolist() for e in chunk]
    outs, _ = generator.generate(prompts, max_new_tokens, Sampling(), eos_ids=(tokenizer.eos_id,),
                                 vocab_limit=tokenizer.vocab_size)
    hits += sum(tokenizer.decode(o).strip() == e["response"].strip() for o, e in zip(outs, chunk))
  return hits / max(len(examples), 1)
