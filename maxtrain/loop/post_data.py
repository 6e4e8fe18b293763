"""The run's data by `post.mode`: pretraining token stores (`loop/data.py`), SFT rows (`loop/sft.py`)
or GRPO prompts (`loop/rl_data.py`)."""

from __future__ import annotations

from typing import Any

import ml_collections

from maxtrain.errors import require
from maxtrain.loop.data import Data
from maxtrain.loop.rl_data import PromptData
from maxtrain.loop.sft import SftData

MODES = ("", "sft", "grpo")


def make_data(cfg: ml_collections.ConfigDict, batch_shardings: dict[str, Any]) -> Any:
  require(cfg.post.mode in MODES, f"config.post.mode={cfg.post.mode!r}: one of {', '.join(map(repr, MODES))}")
  kind = {"": Data, "sft": SftData, "grpo": PromptData}[cfg.post.mode]
  return kind(cfg, batch_shardings)
