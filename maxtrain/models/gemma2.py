"""Gemma 2: LLaMA's decoder with Gemma's pieces on: (1 + w) RMSNorm (`norm_one_plus`), an RMSNorm after
attention and after the MLP as well (`post_norms`), the embedding times sqrt(d_model) (`embed_scale`), the
GELU-tanh GLU (`mlp_activation=gelu_tanh`), scores scaled by `query_pre_attn_scalar`^-1/2, tanh soft-capping
of the attention scores and of the output logits (`attn_logit_softcap`, `final_logit_softcap`: from
config.json), tied embeddings (config.json's `tie_word_embeddings`, True in every Gemma 2), and alternating
sliding-window (even) and global (odd) layers: transformers' `layer_types`, "sliding_attention" iff
(i + 1) % 2 (4.x: is_sliding = not i % 2), the same layers. Layers unscanned (each Block its own static window).

Attention soft-capping runs in the dot and flash kernels and in decoding (docs/models.md): `model.attention=auto`
runs flash where it would pick blocked or cudnn; blocked / cudnn / nki are exit 2 while `model.attn_logit_softcap` > 0.

HF `Gemma2ForCausalLM`: `post_attention_layernorm` is the post-attention norm here (LLaMA's MLP input norm
is Gemma's `pre_feedforward_layernorm`); q/k/v biases, qk-norm, other layer patterns and activations are
refused by field.
"""

from __future__ import annotations

from maxtrain.models import hf_adapter
from maxtrain.models.hf_adapter import Mapping
from maxtrain.models.registry import Family

ARCHITECTURE = "Gemma2ForCausalLM"
PIECES = {"norm_one_plus": True, "post_norms": True, "embed_scale": True, "mlp_activation": "gelu_tanh",
          "scan_layers": False}
HF_ACTIVATION = "gelu_pytorch_tanh"

TENSORS = {
    **{k: m for k, m in hf_adapter.TENSORS.items() if k != "blocks/mlp_norm/scale"},
    "blocks/post_attn_norm/scale": Mapping("model.layers.{}.post_attention_layernorm.weight", 0),
    "blocks/mlp_norm/scale": Mapping("model.layers.{}.pre_feedforward_layernorm.weight", 0),
    "blocks/post_mlp_norm/scale": Mapping("model.layers.{}.post_feedforward_layernorm.weight", 0),
}


def _layer_types(window: int, layers: int) -> list[str]:
  return ["sliding_attention" if window and (i + 1) % 2 else "full_attention" for i in range(layers)]


def _cap(hf: dict, where: str, field: str) -> float:
  value = hf.get(field)
  if value is None:  # null: off
    return 0.0
  if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
    raise hf_adapter.refuse(where, field, value, "must be a positive number or null (off)")
  return float(value)


def _pieces_in(hf: dict, where: str) -> dict:
  hf_adapter.refuse_bias(hf, where)
  window = hf.get("sliding_window") or 0
  types = hf.get("layer_types")
  if window and types is not None and list(types) != _layer_types(window, hf["num_hidden_layers"]):
    raise hf_adapter.refuse(where, "layer_types", types, "Gemma 2 alternates sliding (even) and full (odd) layers")
  scalar = hf.get("query_pre_attn_scalar", 256)
  if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0:
    raise hf_adapter.refuse(where, "query_pre_attn_scalar", scalar, "must be a positive number")
  return {"family": "gemma2", "sliding_window": window, "scan_layers": False, "query_pre_attn_scalar": float(scalar),
          "attn_logit_softcap": _cap(hf, where, "attn_logit_softcapping"),
          "final_logit_softcap": _cap(hf, where, "final_logit_softcapping")}


def _pieces_out(m: dict, where: str) -> dict:
  hf_adapter.require_off(m, where, ARCHITECTURE, "qkv_bias", "qk_norm", "o_bias", "attention_sinks")
  window = m.get("sliding_window") or 0
  head_dim = m.get("head_dim") or m["d_model"] // m["num_heads"]
  scalar = m.get("query_pre_attn_scalar") or head_dim
  scalar = int(scalar) if float(scalar).is_integer() else scalar  # transformers types it int (strict config)
  return {"hidden_act": HF_ACTIVATION, "hidden_activation": HF_ACTIVATION, "attention_bias": False,
          "query_pre_attn_scalar": scalar,
          "attn_logit_softcapping": m.get("attn_logit_softcap") or None,
          "final_logit_softcapping": m.get("final_logit_softcap") or None,
          "sliding_window": window or None, "layer_types": _layer_types(window, m["num_layers"])}


FAMILY = Family(name="gemma2", pieces=PIECES, window_layers="alternate",
                hf=hf_adapter.HFAdapter(ARCHITECTURE, "gemma2", _pieces_in, _pieces_out, tensors=TENSORS,
                                        activations=(HF_ACTIVATION,),
                                        expresses=(*hf_adapter.GEMMA_PIECES, "mlp_activation")))
