"""Qwen3 (dense): LLaMA with per-head RMSNorm of q and k before RoPE, and a head_dim of its own (128 for
every size, whatever d_model / num_heads).

HF `Qwen3ForCausalLM`: `attention_bias` (q, k, v and o biases) and Qwen's per-layer sliding window are
refused by field.
"""

from __future__ import annotations

from maxtrain.models import hf_adapter
from maxtrain.models.registry import Family

ARCHITECTURE = "Qwen3ForCausalLM"


def _pieces_in(hf: dict, where: str) -> dict:
  hf_adapter.no_window(hf, where)
  hf_adapter.refuse_bias(hf, where)
  return {"family": "qwen3"}


def _pieces_out(m: dict, where: str) -> dict:
  hf_adapter.require_off(m, where, ARCHITECTURE, "qkv_bias", "sliding_window")
  return {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
          "layer_types": ["full_attention"] * m["num_layers"]}


FAMILY = Family(name="qwen3", pieces={"qk_norm": True},
                hf=hf_adapter.HFAdapter(ARCHITECTURE, "qwen3", _pieces_in, _pieces_out))
