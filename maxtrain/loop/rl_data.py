"""GRPO's data and reward: `PromptData` (SftData's held-out rows and examples plus each round's
prompts) and the reward function named by `post.reward`, loaded and called with bad outcomes named
(exit 2), not tracebacks."""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable, Sequence

import ml_collections
import numpy as np

from maxtrain.errors import UserError, require
from maxtrain.loop import sft as sft_loop

log = logging.getLogger("maxtrain")


def load_reward(spec: str) -> Callable[[str, str, dict], float]:
  """The reward function named `module:function`; UserError (exit 2) naming it when it cannot be had."""
  module, _, name = spec.partition(":")
  require(bool(module) and bool(name), f"config.post.reward={spec!r}: expected module:function")
  try:
    fn = getattr(importlib.import_module(module), name)
  except (ImportError, AttributeError) as e:
    raise UserError(f"config.post.reward={spec!r} cannot be loaded ({type(e).__name__}: {e}): name an importable "
                    "module:function(prompt, completion, meta) -> float") from None
  require(callable(fn), f"config.post.reward={spec!r} is not callable")
  return fn


def score(fn: Callable, spec: str, prompts: Sequence[dict], completions: Sequence[str]) -> np.ndarray:
  """Rewards [N] as float32; a raising or non-numeric reward is a UserError naming the function."""
  out = np.zeros(len(completions), np.float32)
  for i, (example, text) in enumerate(zip(prompts, completions)):
    try:
      out[i] = float(fn(example["prompt"], text, example.get("meta", {})))
    except Exception as e:  # the user's code: named, not a traceback
      raise UserError(f"config.post.reward={spec!r} raised {type(e).__name__}: {e} on prompt "
                      f"{example['prompt']!r}, completion {text!r}") from None
  require(bool(np.all(np.isfinite(out))), f"config.post.reward={spec!r} returned a non-finite reward")
  return out


class PromptData(sft_loop.SftData):
  """SftData's held-out eval rows and examples, plus the round's prompts; evals score greedy
  completions with the reward (`rl/eval_reward`)."""

  def __init__(self, cfg: ml_collections.ConfigDict, batch_shardings: dict[str, Any]):
    super().__init__(cfg, batch_shardings)
    from maxtrain.data import sft as sft_data

    self.examples = sft_data.load_examples(cfg.post.data, "train", self.tokenizer)
    self.per_round = cfg.post.prompts_per_step
    self.reward_spec, self.temperature = cfg.post.reward, cfg.post.temperature
    self.reward_fn = load_reward(cfg.post.reward)  # before compiling: a bad name is exit 2 at once

  def prompts(self, k: int) -> list[dict]:
    per_epoch = len(self.examples) // self.per_round
    epoch, i = divmod(k, per_epoch)
    order = np.random.default_rng([self.seed, epoch, 7]).permutation(len(self.examples))
    return [self.examples[j] for j in order[i * self.per_round:(i + 1) * self.per_round]]

  def extra_eval(self, program: Any, params: Any) -> dict[str, float]:
    """The held-out prompts' mean reward: greedy (`rl/eval_reward`), and sampled at post.temperature
    with a seed fixed for the run (`rl/eval_reward_sampled`: the quantity GRPO maximises, and the same
    random stream at every eval, so two evals differ only by the parameters)."""
    if not self.eval_examples:
      return {}
    from maxtrain.inference.sampling import Sampling

    if self._generator is None:
      self._generator = sft_loop.make_generator(program, params)
    self._generator.params = params
    prompts = [self.tokenizer.encode(e["prompt"]).tolist() for e in self.eval_examples]
    out = {}
    for tag, sampling in (("rl/eval_reward", Sampling()),
                          ("rl/eval_reward_sampled", Sampling(temperature=self.temperature, seed=self.seed + 1))):
      outs, _ = self._generator.generate(prompts, self.max_new_tokens, sampling, eos_ids=(self.tokenizer.eos_id,),
                                         vocab_limit=self.tokenizer.vocab_size)
      texts = [self.tokenizer.decode(o) for o in outs]
      out[tag] = float(score(self.reward_fn, self.reward_spec, self.eval_examples, texts).mean())
    log.info("held-out mean reward %.3f greedy, %.3f sampled at temperature %g (%d prompts)", out["rl/eval_reward"],
             out["rl/eval_reward_sampled"], self.temperature, len(self.eval_examples))
    return out
