"""Gemma 3 (text): Gemma 2's decoder (the (1 + w) norms, post-attention and post-MLP norms, embedding scale,
GELU-tanh GLU, query_pre_attn_scalar, tied embeddings) with a (1 + w) RMS qk-norm (`qk_norm`; Gemma's norms
make it one-plus), five local sliding-window layers to one global (`model.window_pattern`, default 6) and a
RoPE base of their own on the local layers (`model.rope_local_theta`, unscaled; the global layers keep
`rope_theta` and `rope_scaling`: linear x8 in the 4B-27B). Soft-capping is off in Gemma 3 (read if present).
Layers unscanned (each Block its own static window and RoPE).

HF `Gemma3ForCausalLM` (`model_type` gemma3_text). The layer pattern is read from `layer_types` (transformers
5.x, and late 4.x) or `sliding_window_pattern` (4.x; 5.x writes `_sliding_window_pattern`): layer i slides iff
(i + 1) % pattern; a `layer_types` no period gives is refused by field. RoPE: 4.x `rope_theta` + `rope_scaling`
(global) and `rope_local_base_freq`; 5.x `rope_parameters` per layer type (`full_attention`,
`sliding_attention`; a scaled local RoPE is refused by field). The multimodal `Gemma3ForConditionalGeneration`
is not read: registry.for_architecture refuses its `architectures` by name.
"""

from __future__ import annotations

from maxtrain.models import gemma2, hf_adapter
from maxtrain.models.registry import Family

ARCHITECTURE = "Gemma3ForCausalLM"
MODEL_TYPE = "gemma3_text"
PATTERN = 6  # transformers' default sliding_window_pattern: five local layers, then one global
PIECES = {**gemma2.PIECES, "qk_norm": True}
LOCAL_THETA = 10_000.0  # transformers' default rope_local_base_freq


def layer_types(pattern: int, layers: int) -> list[str]:
  return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def _pattern(hf: dict, where: str) -> int:
  """The period of config.json's layer pattern, checked against `layer_types` when it is there."""
  layers = hf["num_hidden_layers"]
  field = "sliding_window_pattern" if "sliding_window_pattern" in hf else "_sliding_window_pattern"
  pattern = hf.get(field)
  if pattern is not None and (isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1):
    raise hf_adapter.refuse(where, field, pattern, "must be a positive integer")
  types = hf.get("layer_types")
  if types is None:
    return pattern or PATTERN
  if pattern is None:  # the first global layer gives the period (none: any period longer than the stack)
    pattern = list(types).index("full_attention") + 1 if "full_attention" in types else max(PATTERN, layers + 1)
  if list(types) != layer_types(pattern, layers):
    raise hf_adapter.refuse(where, "layer_types", types, f"Gemma 3's layers slide iff (i + 1) % {pattern} (one "
                            "global layer every sliding_window_pattern)")
  return pattern


def _rope(hf: dict, where: str) -> dict:
  """The global layers' RoPE (the shared reader over the full_attention entry) and the local layers' base."""
  params = hf.get("rope_parameters") or {}
  if "full_attention" not in params and "sliding_attention" not in params:  # 4.x: rope_theta + rope_scaling
    local = hf.get("rope_local_base_freq", LOCAL_THETA)
    return {**hf_adapter.rope(hf, where, FAMILY.hf.rope_types),
            "rope_local_theta": hf_adapter.number(local, float, where, "rope_local_base_freq")}
  full = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
  out = hf_adapter.rope({**full, "rope_parameters": params.get("full_attention") or {}}, where, FAMILY.hf.rope_types)
  local = params.get("sliding_attention") or {}
  if local.get("rope_type", "default") != "default":
    raise hf_adapter.refuse(where, "rope_parameters.sliding_attention.rope_type", local["rope_type"],
                            "Gemma 3's local layers have plain RoPE")
  theta = local.get("rope_theta", LOCAL_THETA)
  return {**out, "rope_local_theta": hf_adapter.number(theta, float, where, "rope_parameters.sliding_attention.rope_theta")}


def _pieces_in(hf: dict, where: str) -> dict:
  if hf.get("use_bidirectional_attention"):
    raise hf_adapter.refuse(where, "use_bidirectional_attention", True, "maxtrain's Gemma 3 is causal")
  keys = {**gemma2._pieces_in({k: v for k, v in hf.items() if k != "layer_types"}, where), "family": "gemma3"}
  return {**keys, **_rope(hf, where), "window_pattern": _pattern(hf, where)}


def _pieces_out(m: dict, where: str) -> dict:
  hf_adapter.require_off(m, where, ARCHITECTURE, "qkv_bias", "o_bias", "attention_sinks")
  out = gemma2._pieces_out({**m, "qk_norm": False}, where)
  pattern = m.get("window_pattern") or PATTERN
  rope_local = m.get("rope_local_theta") or None
  if rope_local is None and m.get("rope_scaling", "none") != "none":  # HF scales the global layers only
    raise hf_adapter.refuse(where, "model.rope_local_theta", 0.0, "Gemma 3 scales the global layers' RoPE only: "
                            "set model.rope_local_theta (the local layers' base) to export a scaled RoPE")
  # No window: one as long as the model's longest sequence (the same math); transformers' Gemma 3 needs a number
  window = m.get("sliding_window") or m["max_seq_len"]
  return {**out, "sliding_window": window, "sliding_window_pattern": pattern,
          "layer_types": layer_types(pattern, m["num_layers"]),
          "rope_local_base_freq": rope_local or m["rope_theta"], "use_bidirectional_attention": False}


FAMILY = Family(name="gemma3", pieces=PIECES, window_layers="all", window_pattern=PATTERN,
                hf=hf_adapter.HFAdapter(ARCHITECTURE, MODEL_TYPE, _pieces_in, _pieces_out, tensors=gemma2.TENSORS,
                                        activations=(gemma2.HF_ACTIVATION,),
                                        expresses=(*hf_adapter.GEMMA_PIECES, "mlp_activation")))
