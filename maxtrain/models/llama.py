"""LLaMA (1-3.x): the decoder with none of its optional pieces; RoPE `default` or `llama3`.

HF `LlamaForCausalLM`: `attention_bias` / `mlp_bias` (which would bias o_proj and the MLP as well) and a
sliding window are refused by field.
"""

from __future__ import annotations

from maxtrain.models import hf_adapter
from maxtrain.models.decoder import CONFIG_KEYS, Decoder, ModelConfig, validate  # noqa: F401  (tests build Llama)
from maxtrain.models.registry import Family, param_count  # noqa: F401

Llama = Decoder
ARCHITECTURE = "LlamaForCausalLM"


def _pieces_in(hf: dict, where: str) -> dict:
  hf_adapter.refuse_bias(hf, where)
  if hf.get("sliding_window"):
    raise hf_adapter.refuse(where, "sliding_window", hf["sliding_window"], "LLaMA has no sliding window (use "
                            "MistralForCausalLM)")
  return {"family": "llama"}


def _pieces_out(m: dict, where: str) -> dict:
  hf_adapter.require_off(m, where, ARCHITECTURE, "qkv_bias", "qk_norm", "sliding_window")
  return {"attention_bias": False, "mlp_bias": False}


FAMILY = Family(name="llama", pieces={}, hf=hf_adapter.HFAdapter(ARCHITECTURE, "llama", _pieces_in, _pieces_out))
