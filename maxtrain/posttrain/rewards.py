"""Rewards: `post.reward` = `module:function[:weight],...`, each function(prompt, completion, meta) ->
float called on the host; the reward trained on is their weighted sum, and each is logged on its own
(`rl/reward/<function>`). A reward that cannot be loaded, raises, or returns a non-finite number is
exit 2 naming it; one that calls sys.exit or raises KeyboardInterrupt is a crash naming it (exit 1,
restarted by a supervisor as any crash), never a finish."""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Callable, Sequence

import numpy as np

from maxtrain.errors import UserCodeExit, UserError, require


@dataclasses.dataclass(frozen=True)
class Reward:
  spec: str  # module:function as written
  fn: Callable[[str, str, dict], float]
  weight: float

  @property
  def name(self) -> str:
    return self.spec.rsplit(":", 1)[-1]


def parse(spec: str) -> list[tuple[str, float]]:
  """[(module:function, weight)] of `post.reward`; UserError naming the part that does not parse."""
  out = []
  for part in [p.strip() for p in spec.split(",")]:
    pieces = part.split(":")
    require(len(pieces) in (2, 3) and all(pieces[:2]), f"config.post.reward={spec!r}: {part!r} is not "
            "module:function or module:function:weight")
    weight = 1.0
    if len(pieces) == 3:
      try:
        weight = float(pieces[2])
      except ValueError:
        raise UserError(f"config.post.reward={spec!r}: the weight of {part!r} is not a number") from None
      require(math.isfinite(weight), f"config.post.reward={spec!r}: the weight of {part!r} must be finite")
    out.append((":".join(pieces[:2]), weight))
  names = [s.rsplit(":", 1)[-1] for s, _ in out]
  require(len(set(names)) == len(names), f"config.post.reward={spec!r}: two rewards share a function name "
          "(each is logged as rl/reward/<function>)")
  return out


def load_reward(spec: str) -> Callable[[str, str, dict], float]:
  """The reward function named `module:function`; UserError (exit 2) naming it when it cannot be had."""
  module, _, name = spec.partition(":")
  require(bool(module) and bool(name), f"config.post.reward={spec!r}: expected module:function")
  try:
    fn = getattr(importlib.import_module(module), name)
  except (ImportError, AttributeError) as e:
    raise UserError(f"config.post.reward={spec!r} cannot be loaded ({type(e).__name__}: {e}): name an importable "
                    "module:function(prompt, completion, meta) -> float") from None
  except (SystemExit, KeyboardInterrupt) as e:  # the module's own code, run at import
    raise UserCodeExit(f"config.post.reward={spec!r}: importing it raised {type(e).__name__}({e})") from None
  require(callable(fn), f"config.post.reward={spec!r} is not callable")
  return fn


def load(spec: str) -> list[Reward]:
  return [Reward(s, load_reward(s), w) for s, w in parse(spec)]


def score(fn: Callable, spec: str, prompts: Sequence[dict], completions: Sequence[str]) -> np.ndarray:
  """Rewards [N] as float32 of one function; a raising or non-numeric reward is a UserError naming it,
  sys.exit or KeyboardInterrupt inside it a UserCodeExit (a crash)."""
  out = np.zeros(len(completions), np.float32)
  for i, (example, text) in enumerate(zip(prompts, completions)):
    try:
      out[i] = float(fn(example["prompt"], text, example.get("meta", {})))
    except Exception as e:  # the user's code: named, not a traceback
      raise UserError(f"config.post.reward={spec!r} raised {type(e).__name__}: {e} on prompt "
                      f"{example['prompt']!r}, completion {text!r}") from None
    except (SystemExit, KeyboardInterrupt) as e:  # not a finish: the run did not end its rounds
      raise UserCodeExit(f"config.post.reward={spec!r} raised {type(e).__name__}({e}) on prompt "
                         f"{example['prompt']!r}: a reward must return a number") from None
  require(bool(np.all(np.isfinite(out))), f"config.post.reward={spec!r} returned a non-finite reward")
  return out


def score_all(rewards: Sequence[Reward], prompts: Sequence[dict], completions: Sequence[str]
              ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """(the weighted sum [N] float32, each function's own rewards by name). One function of weight 1 is
  its rewards themselves (bit for bit what a single reward gave before weights existed)."""
  parts = {r.name: score(r.fn, r.spec, prompts, completions) for r in rewards}
  if len(rewards) == 1 and rewards[0].weight == 1.0:
    return parts[rewards[0].name], parts
  total = sum(np.float64(r.weight) * parts[r.name].astype(np.float64) for r in rewards)
  return np.asarray(total, np.float32), parts


def describe(rewards: Sequence[Reward]) -> str:
  return " + ".join(f"{r.weight:g} x {r.spec}" for r in rewards)
