"""The RL algorithm registry (`post.algorithm`): each entry one module of this package, an advantage
estimator and a loss with the derivation in its docstring (`base.Algorithm`). Adding one is a module
and a line in ALGORITHMS (docs/post_training.md, "Adding an algorithm").

The shared keys an algorithm tunes (post.clip_eps, clip_eps_high, kl_coef, overlong_buffer,
max_draws) default to -1, "the algorithm's recommended value" (its `defaults`), so that
`--config.post.algorithm=X` alone runs X at its recipe; a value >= 0 set by the user wins.
"""

from __future__ import annotations

from typing import Any

from maxtrain.errors import choice, require
from maxtrain.posttrain.algorithms import dapo, dr_grpo, grpo, gspo, ppo, reinforce_pp, rloo
from maxtrain.posttrain.algorithms.base import Algorithm, Hyper

ALGORITHMS: dict[str, Algorithm] = {m.ALGORITHM.name: m.ALGORITHM
                                    for m in (grpo, dr_grpo, rloo, reinforce_pp, dapo, gspo, ppo)}
TUNED = ("clip_eps", "clip_eps_high", "kl_coef", "overlong_buffer", "max_draws")  # -1: the algorithm's default


def get(name: str) -> Algorithm:
  choice("post.algorithm", name, tuple(ALGORITHMS))
  return ALGORITHMS[name]


def resolve(post: Any) -> tuple[Algorithm, Hyper]:
  """The run's algorithm and its hyperparameters, each tuned key -1 replaced by the algorithm's default
  (clip_eps_high: clip_eps's value; overlong_buffer 0 and max_draws 1 unless the algorithm uses them).
  UserError naming the key for a value out of range."""
  algorithm = get(post.algorithm)
  values = {}
  for key in TUNED:
    value = post[key]
    if value == -1:
      value = algorithm.defaults.get(key, {"clip_eps_high": None, "overlong_buffer": 0, "max_draws": 1}.get(key))
      value = value(post) if callable(value) else value
    values[key] = value
  if values["clip_eps_high"] is None:
    values["clip_eps_high"] = values["clip_eps"]
  for key in ("clip_eps", "clip_eps_high"):
    require(0 < values[key] < 10, f"config.post.{key}={post[key]}: must be in (0, 10), or -1 for post.algorithm="
            f"{algorithm.name}'s default")
  require(values["kl_coef"] >= 0, f"config.post.kl_coef={post.kl_coef}: must be >= 0, or -1 for the algorithm's default")
  require(0 <= values["overlong_buffer"] <= post.max_new_tokens, f"config.post.overlong_buffer={post.overlong_buffer}: "
          f"must be in 0..post.max_new_tokens={post.max_new_tokens}, or -1 for the algorithm's default")
  require(1 <= values["max_draws"] <= 64, f"config.post.max_draws={post.max_draws}: must be in 1..64, or -1 for the "
          "algorithm's default")
  return algorithm, Hyper(clip_low=float(values["clip_eps"]), clip_high=float(values["clip_eps_high"]),
                          kl_coef=float(values["kl_coef"]), max_new_tokens=int(post.max_new_tokens),
                          overlong_buffer=int(values["overlong_buffer"]), max_draws=int(values["max_draws"]),
                          gamma=float(post.gamma), lam=float(post.lam), value_clip=float(post.value_clip))
