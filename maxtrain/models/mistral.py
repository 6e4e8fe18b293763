"""Mistral (7B v0.1-v0.3 and its kin): LLaMA with sliding-window attention on every layer
(`model.sliding_window`; v0.1: 4096, later versions none: 0).

HF `MistralForCausalLM`: `sliding_window` (null: none) is read; biases are refused by field.
"""

from __future__ import annotations

from maxtrain.models import hf_adapter
from maxtrain.models.registry import Family

ARCHITECTURE = "MistralForCausalLM"


def _pieces_in(hf: dict, where: str) -> dict:
  hf_adapter.refuse_bias(hf, where)
  window = hf.get("sliding_window") or 0
  want = "sliding_attention" if window else "full_attention"
  other = [t for t in hf.get("layer_types") or () if t != want]
  if other:  # Mistral's pattern is one kind of layer throughout
    raise hf_adapter.refuse(where, "layer_types", other[0], f"mistral has {want} on every layer "
                            f"(sliding_window={window or None})")
  return {"family": "mistral", "sliding_window": window}


def _pieces_out(m: dict, where: str) -> dict:
  hf_adapter.require_off(m, where, ARCHITECTURE, "qkv_bias", "qk_norm")
  return {"sliding_window": m.get("sliding_window") or None}


FAMILY = Family(name="mistral", pieces={}, window_layers="all",
                hf=hf_adapter.HFAdapter(ARCHITECTURE, "mistral", _pieces_in, _pieces_out))
