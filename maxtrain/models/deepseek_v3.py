"""DeepSeek-V3 (and Kimi K2, which shares its architecture): multi-head latent attention (`model.mla.*`,
models/mla.py), the first `first_dense_layers` layers dense, then mixtures of experts with a sigmoid router,
its correction bias (maxtrain's aux-loss-free `router_bias`), group-limited top-k (`n_group`, `topk_group`),
normalised weights times `routed_scaling_factor`, and shared experts; YaRN RoPE with `mscale_all_dim`
scaling the softmax too (model.mla.softmax_mscale).

HF `DeepseekV3ForCausalLM`: the experts one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, as
transformers 4.x and 5.x save them), stacked; the MoE layers' HF indices start after the dense ones.
Published checkpoints are FP8 with block scales (`quantization_config`, `weight_scale_inv`): dequantised on
import (interop/dequant.py). Multi-token prediction layers (`num_nextn_predict_layers`,
HF layer `num_hidden_layers`) are not read: HF's class has no place for them either.
"""

from __future__ import annotations

import dataclasses
import math

from maxtrain.errors import UserError, require
from maxtrain.models import hf_adapter
from maxtrain.models.hf_adapter import Mapping
from maxtrain.models.mla import MLAConfig
from maxtrain.models.moe import MoEConfig
from maxtrain.models.registry import Family

ARCHITECTURE = "DeepseekV3ForCausalLM"

_ATTENTION = {  # per layer, under blocks/ or moe_blocks/
    "attn/wq": Mapping("model.layers.{}.self_attn.q_proj.weight", 1),
    "attn/wq_a": Mapping("model.layers.{}.self_attn.q_a_proj.weight", 1),
    "attn/q_a_norm/scale": Mapping("model.layers.{}.self_attn.q_a_layernorm.weight", 0),
    "attn/wq_b": Mapping("model.layers.{}.self_attn.q_b_proj.weight", 1),
    "attn/wkv_a": Mapping("model.layers.{}.self_attn.kv_a_proj_with_mqa.weight", 1),
    "attn/kv_a_norm/scale": Mapping("model.layers.{}.self_attn.kv_a_layernorm.weight", 0),
    "attn/wkv_b": Mapping("model.layers.{}.self_attn.kv_b_proj.weight", 1),
    "attn/wo": Mapping("model.layers.{}.self_attn.o_proj.weight", 2),
    "attn_norm/scale": Mapping("model.layers.{}.input_layernorm.weight", 0),
    "mlp_norm/scale": Mapping("model.layers.{}.post_attention_layernorm.weight", 0),
}
_MOE = {
    "moe/router": Mapping("model.layers.{}.mlp.gate.weight", 1),
    "moe/router_bias": Mapping("model.layers.{}.mlp.gate.e_score_correction_bias", 0),
    "moe/gate": Mapping("model.layers.{}.mlp.experts.{}.gate_proj.weight", 1, experts=True),
    "moe/up": Mapping("model.layers.{}.mlp.experts.{}.up_proj.weight", 1, experts=True),
    "moe/down": Mapping("model.layers.{}.mlp.experts.{}.down_proj.weight", 1, experts=True),
    "moe/shared/gate": Mapping("model.layers.{}.mlp.shared_experts.gate_proj.weight", 1),
    "moe/shared/up": Mapping("model.layers.{}.mlp.shared_experts.up_proj.weight", 1),
    "moe/shared/down": Mapping("model.layers.{}.mlp.shared_experts.down_proj.weight", 1),
}


def _tensors(m: dict) -> dict[str, Mapping]:
  """The names for these model keys: the MoE stack's HF layers start after the first_dense_layers dense ones."""
  dense = (m.get("moe") or {}).get("first_dense_layers", 0)
  out = {k: v for k, v in hf_adapter.TENSORS.items() if not k.startswith("blocks/")}
  out.update({f"blocks/{k}": v for k, v in _ATTENTION.items()})
  out.update({k: v for k, v in hf_adapter.TENSORS.items() if k.startswith("blocks/mlp/")})
  for k, v in {**_ATTENTION, **_MOE}.items():
    out[f"moe_blocks/{k}"] = dataclasses.replace(v, layer_offset=dense)
  return out


# DeepSeek-V3 (671B, 37B active)'s config.json as `from-hf` reads it (tests/test_families.py checks that), the
# family's defaults (registry.Family.defaults; a literal: config/loader.py reads it without importing this).
# Multi-token prediction (num_nextn_predict_layers 1) is a training choice, not set here.
DEFAULTS = {
    "num_layers": 61, "d_model": 7168, "num_heads": 128, "num_kv_heads": 128, "head_dim": 0, "d_ff": 18432,
    "vocab_size": 129280, "max_seq_len": 163840, "norm_eps": 1e-6, "tie_embeddings": False,
    "rope_theta": 10000.0, "rope_scaling": "yarn", "rope_scaling_factor": 40.0, "rope_original_max_len": 4096,
    "rope_beta_fast": 32.0, "rope_beta_slow": 1.0, "rope_truncate": True, "rope_attention_factor": 1.0,
    "moe.num_experts": 256, "moe.experts_per_token": 8, "moe.num_shared_experts": 1, "moe.expert_d_ff": 2048,
    "moe.first_dense_layers": 3, "moe.router": "sigmoid", "moe.norm_topk_prob": True, "moe.dispatch": "dropless",
    "moe.n_group": 8, "moe.topk_group": 4, "moe.routed_scaling_factor": 2.5, "moe.activation": "swiglu",
    "moe.expert_bias": False, "mla.kv_lora_rank": 512, "mla.q_lora_rank": 1536, "mla.rope_head_dim": 64,
    "mla.nope_head_dim": 128, "mla.v_head_dim": 128, "mla.rope_interleave": True,
    "mla.softmax_mscale": 1.3688879454113936,  # YaRN's mscale_all_dim 1 at factor 40: 0.1 ln 40 + 1
}


def _int(hf: dict, where: str, field: str, *, allow_zero: bool = False, default=None) -> int:
  value = hf.get(field, default)
  if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
    raise hf_adapter.refuse(where, field, value, "must be a positive integer")
  return value


def _pieces_in(hf: dict, where: str) -> dict:
  hf_adapter.refuse_bias(hf, where)
  layers = hf["num_hidden_layers"]
  dense = _int(hf, where, "first_k_dense_replace", allow_zero=True, default=0)
  if dense >= layers:
    raise hf_adapter.refuse(where, "first_k_dense_replace", dense, f"must be below num_hidden_layers={layers}")
  experts = _int(hf, where, "n_routed_experts", default=hf.get("num_local_experts"))
  spec = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
  factor, mscale_all = spec.get("factor") or 1.0, spec.get("mscale_all_dim") or 0
  softmax_mscale = 0.1 * mscale_all * math.log(factor) + 1.0 if mscale_all and factor > 1 and spec.get(
      "rope_type", spec.get("type", "default")) != "default" else 1.0
  moe = MoEConfig(num_experts=experts, experts_per_token=_int(hf, where, "num_experts_per_tok"),
                  num_shared_experts=_int(hf, where, "n_shared_experts", allow_zero=True, default=0),
                  expert_d_ff=_int(hf, where, "moe_intermediate_size"), first_dense_layers=dense, router="sigmoid",
                  norm_topk_prob=bool(hf.get("norm_topk_prob", True)), dispatch="dropless",
                  n_group=_int(hf, where, "n_group", default=1), topk_group=_int(hf, where, "topk_group", default=1),
                  routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)))
  if experts % moe.n_group or moe.topk_group > moe.n_group:
    raise hf_adapter.refuse(where, "n_group", moe.n_group, f"must divide n_routed_experts={experts} and be >= "
                            f"topk_group={moe.topk_group}")
  mla = MLAConfig(kv_lora_rank=_int(hf, where, "kv_lora_rank"), q_lora_rank=hf.get("q_lora_rank") or 0,
                  rope_head_dim=_int(hf, where, "qk_rope_head_dim"), nope_head_dim=_int(hf, where, "qk_nope_head_dim"),
                  v_head_dim=_int(hf, where, "v_head_dim"), rope_interleave=bool(hf.get("rope_interleave", True)),
                  softmax_mscale=softmax_mscale)
  return {"family": "deepseek_v3", "moe": dataclasses.asdict(moe), "mla": dataclasses.asdict(mla), "head_dim": 0,
          "num_kv_heads": hf["num_attention_heads"]}


def _pieces_out(m: dict, where: str) -> dict:
  hf_adapter.require_off(m, where, ARCHITECTURE, "qkv_bias", "qk_norm", "sliding_window")
  moe, mla = m.get("moe") or {}, m.get("mla") or {}
  if moe.get("router", "softmax") != "sigmoid" or not moe.get("num_experts") or not mla.get("kv_lora_rank"):
    raise UserError(f"{where}: model.moe.router={moe.get('router')!r}, model.moe.num_experts={moe.get('num_experts')}, "
                    f"model.mla.kv_lora_rank={mla.get('kv_lora_rank')}: {ARCHITECTURE} needs a sigmoid-routed MoE "
                    "and multi-head latent attention")
  out = {}
  if m.get("rope_scaling") == "yarn" and mla.get("softmax_mscale", 1.0) != 1.0:
    # the softmax's mscale back as YaRN's mscale_all_dim (transformers' yarn_apply_mscale), the rotary dims'
    # attention factor as it is
    factor = m["rope_scaling_factor"]
    out["rope_scaling"] = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": m["rope_original_max_len"],
                           "beta_fast": m.get("rope_beta_fast", 32.0), "beta_slow": m.get("rope_beta_slow", 1.0),
                           "truncate": m.get("rope_truncate", True),
                           "mscale_all_dim": (mla["softmax_mscale"] - 1.0) / (0.1 * math.log(factor)),
                           "attention_factor": m.get("rope_attention_factor") or 0.1 * math.log(factor) + 1.0}
  return {**out, "attention_bias": False, "n_routed_experts": moe["num_experts"], "num_experts_per_tok": moe["experts_per_token"],
          "n_shared_experts": moe.get("num_shared_experts", 0), "moe_intermediate_size": moe["expert_d_ff"],
          "first_k_dense_replace": moe.get("first_dense_layers", 0), "norm_topk_prob": moe.get("norm_topk_prob", True),
          "n_group": moe.get("n_group", 1), "topk_group": moe.get("topk_group", 1),
          "routed_scaling_factor": moe.get("routed_scaling_factor", 1.0), "kv_lora_rank": mla["kv_lora_rank"],
          "q_lora_rank": mla.get("q_lora_rank") or None, "qk_rope_head_dim": mla["rope_head_dim"],
          "qk_nope_head_dim": mla["nope_head_dim"], "v_head_dim": mla["v_head_dim"],
          "head_dim": mla["rope_head_dim"], "rope_interleave": mla.get("rope_interleave", True),
          "num_key_value_heads": m["num_heads"], "num_nextn_predict_layers": 0}


def _validate(m) -> None:
  require(m.moe.num_experts > 0 and m.mla.kv_lora_rank > 0,
          f"config.model.moe.num_experts={m.moe.num_experts}, model.mla.kv_lora_rank={m.mla.kv_lora_rank}: "
          "model.family=deepseek_v3 needs both (DeepSeek-V3: 256 experts, kv_lora_rank 512)")


class _MLAFamily(Family):
  def flops_per_token(self, cfg, seq_len: int) -> float:
    """The decoder's count with its GQA attention swapped for MLA's: the latent projections' matmul parameters,
    and q.k over nope + rope dims, p.v over v_head_dim (ModelConfig.train_flops_per_token's convention)."""
    c, d, n, L = cfg.mla, cfg.d_model, cfg.num_heads, cfg.num_layers
    h, k = cfg.head_dim, cfg.num_kv_heads
    gqa = 6.0 * L * (d * n * h * 2 + d * k * h * 2) + L * 3 * 2 * n * h * (seq_len + 1)
    q = d * c.q_lora_rank + c.q_lora_rank * n * c.qk_head_dim if c.q_lora_rank else d * n * c.qk_head_dim
    mla_params = q + d * (c.kv_lora_rank + c.rope_head_dim) + c.kv_lora_rank * n * (c.nope_head_dim + c.v_head_dim) \
        + n * c.v_head_dim * d
    mla = 6.0 * L * mla_params + L * 3 * n * (c.qk_head_dim + c.v_head_dim) * (seq_len + 1)
    return cfg.train_flops_per_token(seq_len) - gqa + mla


FAMILY = _MLAFamily(name="deepseek_v3", pieces={}, validate=_validate, defaults=DEFAULTS,
                hf=hf_adapter.HFAdapter(ARCHITECTURE, "deepseek_v3", _pieces_in, _pieces_out, tensors_for=_tensors,
                                        rope_types=("default", "yarn")))
