"""Qwen3-MoE: Qwen3's attention (per-head qk RMSNorm, a head_dim of its own) with every feed-forward a mixture
of experts (`models/moe.py`): a softmax router over `num_experts`, the top `num_experts_per_tok`, their weights
renormalised when `norm_topk_prob` (model.moe.norm_topk_prob), no shared experts.

HF `Qwen3MoeForCausalLM`: its router is `mlp.gate`, its experts `mlp.experts.{e}.{gate,up,down}_proj` one tensor
per expert (as published and as transformers 4.x and 5.x save them), stacked into maxtrain's [E, ...] tensors.
Dense layers among the MoE ones (`mlp_only_layers`, `decoder_sparse_step` > 1), attention biases and Qwen's
per-layer sliding window are refused by field. A converted model routes without drops (model.moe.dispatch=
dropless), as transformers does.
"""

from __future__ import annotations

import dataclasses

from maxtrain.errors import UserError, require
from maxtrain.models import hf_adapter
from maxtrain.models.hf_adapter import Mapping
from maxtrain.models.moe import MoEConfig
from maxtrain.models.registry import Family

ARCHITECTURE = "Qwen3MoeForCausalLM"

TENSORS = {
    **{k: m for k, m in hf_adapter.TENSORS.items() if not k.startswith("blocks/")},
    **{k: m for k, m in hf_adapter.stack_tensors("moe_blocks").items() if "/mlp/" not in k},
    "moe_blocks/moe/router": Mapping("model.layers.{}.mlp.gate.weight", 1),
    "moe_blocks/moe/router_bias": Mapping("", 0),  # maxtrain's aux-free balancing bias: HF has none
    "moe_blocks/moe/gate": Mapping("model.layers.{}.mlp.experts.{}.gate_proj.weight", 1, experts=True),
    "moe_blocks/moe/up": Mapping("model.layers.{}.mlp.experts.{}.up_proj.weight", 1, experts=True),
    "moe_blocks/moe/down": Mapping("model.layers.{}.mlp.experts.{}.down_proj.weight", 1, experts=True),
}


# Qwen3-30B-A3B's config.json as `from-hf` reads it (tests/test_families.py checks that), the family's defaults
# (registry.Family.defaults; a literal: config/loader.py reads it without importing this module).
DEFAULTS = {
    "num_layers": 48, "d_model": 2048, "num_heads": 32, "num_kv_heads": 4, "head_dim": 128, "d_ff": 6144,
    "vocab_size": 151936, "max_seq_len": 40960, "norm_eps": 1e-6, "tie_embeddings": False,
    "rope_theta": 1000000.0, "rope_scaling": "none",
    "moe.num_experts": 128, "moe.experts_per_token": 8, "moe.num_shared_experts": 0, "moe.expert_d_ff": 768,
    "moe.first_dense_layers": 0, "moe.router": "softmax", "moe.norm_topk_prob": True, "moe.dispatch": "dropless",
}


def _int(hf: dict, where: str, *fields: str) -> int:
  """The first of `fields` present (transformers 5.x renames some: num_experts -> num_local_experts)."""
  for field in fields:
    if field in hf:
      value = hf[field]
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise hf_adapter.refuse(where, field, value, "must be a positive integer")
      return value
  raise hf_adapter.refuse(where, fields[0], None, f"missing: a {ARCHITECTURE} config.json needs it")


def _pieces_in(hf: dict, where: str) -> dict:
  hf_adapter.no_window(hf, where)
  hf_adapter.refuse_bias(hf, where)
  if hf.get("mlp_only_layers"):
    raise hf_adapter.refuse(where, "mlp_only_layers", hf["mlp_only_layers"], "dense layers among the MoE layers are "
                            "not supported (every layer must be a MoE layer)")
  if hf.get("decoder_sparse_step", 1) != 1:
    raise hf_adapter.refuse(where, "decoder_sparse_step", hf["decoder_sparse_step"], "only 1 (every layer a MoE "
                            "layer) is supported")
  if hf.get("shared_expert_intermediate_size"):
    raise hf_adapter.refuse(where, "shared_expert_intermediate_size", hf["shared_expert_intermediate_size"],
                            "Qwen3-MoE has no shared expert")
  norm = hf.get("norm_topk_prob", False)  # transformers' default
  if not isinstance(norm, bool):
    raise hf_adapter.refuse(where, "norm_topk_prob", norm, "must be true or false")
  experts = _int(hf, where, "num_experts", "num_local_experts")
  k = _int(hf, where, "num_experts_per_tok")
  if k > experts:
    raise hf_adapter.refuse(where, "num_experts_per_tok", k, f"more than the {experts} experts")
  moe = MoEConfig(num_experts=experts, experts_per_token=k, expert_d_ff=_int(hf, where, "moe_intermediate_size"),
                  router="softmax", norm_topk_prob=norm, dispatch="dropless",
                  aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)))
  return {"family": "qwen3_moe", "moe": dataclasses.asdict(moe)}


def _pieces_out(m: dict, where: str) -> dict:
  hf_adapter.require_off(m, where, ARCHITECTURE, "qkv_bias", "sliding_window")
  moe = m.get("moe") or {}
  if not moe.get("num_experts"):
    raise UserError(f"{where}: model.moe.num_experts=0: {ARCHITECTURE} is a mixture of experts; export "
                               "a dense model as qwen3")
  for key, ok in (("num_shared_experts", 0), ("first_dense_layers", 0), ("router", "softmax")):
    if moe.get(key, ok) != ok:
      raise UserError(f"{where}: model.moe.{key}={moe[key]!r}: {ARCHITECTURE} has only {key}={ok!r}")
  return {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
          "layer_types": ["full_attention"] * m["num_layers"], "num_experts": moe["num_experts"],
          "num_experts_per_tok": moe["experts_per_token"], "moe_intermediate_size": moe["expert_d_ff"],
          "norm_topk_prob": bool(moe.get("norm_topk_prob", True)), "decoder_sparse_step": 1, "mlp_only_layers": [],
          "router_aux_loss_coef": moe.get("aux_loss_weight", 0.001)}


def _validate(m) -> None:
  require(m.moe.num_experts > 0, "config.model.moe.num_experts=0: model.family=qwen3_moe is a mixture of experts; "
          "set model.moe.num_experts (Qwen3-30B-A3B: 128) or use model.family=qwen3")


FAMILY = Family(name="qwen3_moe", pieces={"qk_norm": True}, validate=_validate, defaults=DEFAULTS,
                hf=hf_adapter.HFAdapter(ARCHITECTURE, "qwen3_moe", _pieces_in, _pieces_out, tensors=TENSORS))
