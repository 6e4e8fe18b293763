"""GPT-OSS (20B, 120B): every layer a mixture of experts, with attention sinks (a learned softmax-normaliser
logit per head), biases on q, k, v and o, on the router and on every expert, the clamped SwiGLU
(`model.moe.activation=clamped_swiglu`: swiglu_alpha, swiglu_limit, its fused interleaved gate_up weight),
alternating windowed (even) and full (odd) layers, and YaRN RoPE.

Its layers are unscanned (model.scan_layers=False): each Block holds its own static window, so flash skips
the key blocks outside it on the windowed layers only. The router is top-k of the biased logits with the
softmax over the chosen (= maxtrain's softmax router with norm_topk_prob).

HF `GptOssForCausalLM`: the tensors are read as transformers writes them (`mlp.experts.gate_up_proj`
[E, D, 2F] = maxtrain's layout, `mlp.router.{weight,bias}`, `self_attn.sinks`). Published checkpoints hold
the experts in MXFP4 (`quantization_config`, `*_blocks` / `*_scales`): dequantised on import
(interop/dequant.py).
"""

from __future__ import annotations

import dataclasses

from maxtrain.errors import UserError, require
from maxtrain.models import hf_adapter
from maxtrain.models.hf_adapter import Mapping
from maxtrain.models.moe import MoEConfig
from maxtrain.models.registry import Family

ARCHITECTURE = "GptOssForCausalLM"
PIECES = {"qkv_bias": True, "o_bias": True, "attention_sinks": True, "scan_layers": False}

TENSORS = {
    **{k: m for k, m in hf_adapter.TENSORS.items() if not k.startswith("blocks/")},
    **{k: m for k, m in hf_adapter.stack_tensors("moe_blocks").items() if "/mlp/" not in k},
    "moe_blocks/attn/bo": Mapping("model.layers.{}.self_attn.o_proj.bias", 0),
    "moe_blocks/attn/sinks": Mapping("model.layers.{}.self_attn.sinks", 0),
    "moe_blocks/moe/router": Mapping("model.layers.{}.mlp.router.weight", 1),
    "moe_blocks/moe/router_b": Mapping("model.layers.{}.mlp.router.bias", 0),
    "moe_blocks/moe/router_bias": Mapping("", 0),  # maxtrain's aux-free balancing bias: HF has none
    "moe_blocks/moe/gate_up": Mapping("model.layers.{}.mlp.experts.gate_up_proj", 0),
    "moe_blocks/moe/gate_up_b": Mapping("model.layers.{}.mlp.experts.gate_up_proj_bias", 0),
    "moe_blocks/moe/down": Mapping("model.layers.{}.mlp.experts.down_proj", 0),
    "moe_blocks/moe/down_b": Mapping("model.layers.{}.mlp.experts.down_proj_bias", 0),
}


# gpt-oss-20b's config.json as `from-hf` reads it (tests/test_families.py checks that), the family's defaults
# (registry.Family.defaults; a literal: config/loader.py reads it without importing this module).
DEFAULTS = {
    "num_layers": 24, "d_model": 2880, "num_heads": 64, "num_kv_heads": 8, "head_dim": 64, "d_ff": 2880,
    "vocab_size": 201088, "max_seq_len": 131072, "norm_eps": 1e-5, "tie_embeddings": False, "sliding_window": 128,
    "rope_theta": 150000.0, "rope_scaling": "yarn", "rope_scaling_factor": 32.0, "rope_original_max_len": 4096,
    "rope_beta_fast": 32.0, "rope_beta_slow": 1.0, "rope_truncate": False,
    "moe.num_experts": 32, "moe.experts_per_token": 4, "moe.num_shared_experts": 0, "moe.expert_d_ff": 2880,
    "moe.first_dense_layers": 0, "moe.router": "softmax", "moe.norm_topk_prob": True, "moe.dispatch": "dropless",
    "moe.activation": "clamped_swiglu", "moe.expert_bias": True, "moe.swiglu_alpha": 1.702, "moe.swiglu_limit": 7.0,
}


def _number(hf: dict, where: str, field: str, default, kind: type):
  value = hf.get(field, default)
  if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
    raise hf_adapter.refuse(where, field, value, "must be a positive number")
  return kind(value)


def _pieces_in(hf: dict, where: str) -> dict:
  if hf.get("attention_bias", True) is not True:
    raise hf_adapter.refuse(where, "attention_bias", hf["attention_bias"], "GPT-OSS has q, k, v and o biases")
  window = hf.get("sliding_window") or 0
  layers = hf["num_hidden_layers"]
  want = [("sliding_attention" if window and i % 2 == 0 else "full_attention") for i in range(layers)]
  types = hf.get("layer_types") or want
  if list(types) != want:
    raise hf_adapter.refuse(where, "layer_types", types, f"GPT-OSS alternates sliding (even) and full (odd) "
                            f"layers with sliding_window={window or None}")
  experts = _number(hf, where, "num_local_experts", hf.get("num_experts"), int)
  k = _number(hf, where, "num_experts_per_tok", None, int)
  if k > experts:
    raise hf_adapter.refuse(where, "num_experts_per_tok", k, f"more than the {experts} experts")
  moe = MoEConfig(num_experts=experts, experts_per_token=k, expert_d_ff=hf["intermediate_size"], router="softmax",
                  norm_topk_prob=True, dispatch="dropless", activation="clamped_swiglu", expert_bias=True,
                  swiglu_alpha=_number(hf, where, "swiglu_alpha", 1.702, float),
                  swiglu_limit=_number(hf, where, "swiglu_limit", 7.0, float),
                  aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)))
  return {"family": "gpt_oss", "sliding_window": window, "moe": dataclasses.asdict(moe), "scan_layers": False}


def _pieces_out(m: dict, where: str) -> dict:
  hf_adapter.require_off(m, where, ARCHITECTURE, "qk_norm")
  moe = m.get("moe") or {}
  for key, ok in (("activation", "clamped_swiglu"), ("expert_bias", True), ("num_shared_experts", 0),
                  ("first_dense_layers", 0), ("router", "softmax"), ("norm_topk_prob", True)):
    if moe.get(key, getattr(MoEConfig(), key)) != ok:
      raise UserError(f"{where}: model.moe.{key}={moe.get(key)!r}: {ARCHITECTURE} has only {key}={ok!r}")
  window = m.get("sliding_window") or 0
  return {"attention_bias": True, "sliding_window": window or None,
          "layer_types": ["sliding_attention" if window and i % 2 == 0 else "full_attention"
                          for i in range(m["num_layers"])],
          "num_local_experts": moe["num_experts"], "num_experts_per_tok": moe["experts_per_token"],
          "intermediate_size": moe["expert_d_ff"], "swiglu_alpha": moe["swiglu_alpha"],
          "swiglu_limit": moe["swiglu_limit"], "router_aux_loss_coef": moe.get("aux_loss_weight", 0.001)}


def _validate(m) -> None:
  require(m.moe.num_experts > 0, "config.model.moe.num_experts=0: model.family=gpt_oss is a mixture of experts; "
          "set model.moe.num_experts (GPT-OSS 20B: 32)")
  require(m.moe.get("activation") == "clamped_swiglu" and m.moe.get("expert_bias"),
          "config.model.moe.activation / expert_bias: model.family=gpt_oss needs model.moe.activation=clamped_swiglu "
          "and model.moe.expert_bias=True")


class _AlternatingFamily(Family):
  def flops_per_token(self, cfg, seq_len: int) -> float:
    """The window on the even layers only: the decoder's count with and without it, mixed by layer count."""
    windowed, full = cfg.train_flops_per_token(seq_len), dataclasses.replace(cfg, sliding_window=0).train_flops_per_token(
        seq_len)
    return full + (windowed - full) * ((cfg.num_layers + 1) // 2) / cfg.num_layers


FAMILY = _AlternatingFamily(name="gpt_oss", pieces=PIECES, window_layers="alternate", validate=_validate,
                defaults=DEFAULTS,
                hf=hf_adapter.HFAdapter(ARCHITECTURE, "gpt_oss", _pieces_in, _pieces_out, tensors=TENSORS,
                                        rope_types=("default", "yarn")))
