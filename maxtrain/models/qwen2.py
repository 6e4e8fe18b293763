"""Qwen2 / Qwen2.5: LLaMA with q/k/v projection biases (no o_proj bias).

HF `Qwen2ForCausalLM`: Qwen's per-layer sliding window (`use_sliding_window`, `layer_types` with
sliding layers) is refused by field; `sliding_window` and `max_window_layers` are read only with it.
"""

from __future__ import annotations

from maxtrain.models import hf_adapter
from maxtrain.models.registry import Family

ARCHITECTURE = "Qwen2ForCausalLM"


def _pieces_in(hf: dict, where: str) -> dict:
  hf_adapter.no_window(hf, where)
  hf_adapter.refuse_bias(hf, where, ("mlp_bias",))
  return {"family": "qwen2"}


def _pieces_out(m: dict, where: str) -> dict:
  hf_adapter.require_off(m, where, ARCHITECTURE, "qk_norm", "sliding_window")
  return {"use_sliding_window": False, "sliding_window": None, "layer_types": ["full_attention"] * m["num_layers"]}


FAMILY = Family(name="qwen2", pieces={"qkv_bias": True},
                hf=hf_adapter.HFAdapter(ARCHITECTURE, "qwen2", _pieces_in, _pieces_out))
