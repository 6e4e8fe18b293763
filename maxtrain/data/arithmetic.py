"""The shipped verifiable task: two-number addition ("17+25=" -> "42"), generated in process (no
download), split into fixed train and held-out prompts, and its reward function for GRPO
(`post.reward = "maxtrain.data.arithmetic:reward"`)."""

from __future__ import annotations

from typing import Any

import numpy as np

HELD_OUT = 500  # held-out (a, b) pairs, never trained on


def _pairs(max_operand: int) -> np.ndarray:
  """Every (a, b) with 0 <= a, b <= max_operand, in a fixed shuffled order (seed-independent: the
  held-out split is the same in every run)."""
  n = max_operand + 1
  pairs = np.stack(np.meshgrid(np.arange(n), np.arange(n), indexing="ij"), -1).reshape(-1, 2)
  return pairs[np.random.default_rng(12345).permutation(len(pairs))]


def example(a: int, b: int) -> dict[str, Any]:
  answer = str(a + b)
  return {"prompt": f"{a}+{b}=", "response": answer, "meta": {"answer": answer}}


def examples(split: str, max_operand: int = 99) -> list[dict[str, Any]]:
  """The task's examples: "train" (all pairs but the held-out ones) or "eval" (the held-out pairs)."""
  pairs = _pairs(max_operand)
  held = min(HELD_OUT, len(pairs) // 5)
  chosen = pairs[:held] if split == "eval" else pairs[held:]
  return [example(int(a), int(b)) for a, b in chosen]


def reward(prompt: str, completion: str, meta: dict[str, Any]) -> float:
  """1 for exactly the right number (surrounding whitespace ignored), else 0."""
  return 1.0 if completion.strip() == str(meta["answer"]) else 0.0
