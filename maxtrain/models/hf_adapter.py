"""A family's Hugging Face adapter: tensor names and config.json, both ways.

The shared part is what every LLaMA-like `*ForCausalLM` writes the same way (the decoder's widths, RMSNorm
epsilon, RoPE in both transformers spellings, tied embeddings, the tensor names of `TENSORS`); a family
adds its own fields with two small functions (`pieces_in`: its config.json fields -> `model.*` keys,
refusing what it cannot express; `pieces_out`: the reverse). A field that changes the math and is not
understood is a UserError (exit 2) that names it: never a silent drop.

RoPE is read in both spellings: `rope_theta` + `rope_scaling` (transformers 4.x, most published
checkpoints) and `rope_parameters` (transformers 5.x); the legacy one is written, which both read.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable

from maxtrain.errors import UserError


@dataclasses.dataclass(frozen=True)
class Mapping:
  """One maxtrain parameter kind <-> a Hugging Face tensor name."""
  hf: str  # HF name; "{}" is the layer index for per-layer tensors
  in_dims: int  # leading maxtrain dims forming HF's `in` axis (0: no transpose, e.g. norms, embedding)
  per_layer: bool = True
  flat: bool = False  # HF holds the tensor flattened to 1-D (a bias [N, H] as [N * H])
  # HF holds one tensor per expert ("...experts.{}.gate_proj.weight": layer, then expert), maxtrain one [E, ...]
  experts: bool = False
  layer_offset: int = 0  # HF's index of the stack's first layer (DeepSeek's MoE layers after the dense ones)

  @property
  def absent(self) -> bool:
    """No HF tensor (hf ""): zeros on import; to-hf refuses it unless it is all zeros (a routing bias HF lacks)."""
    return not self.hf


# The decoder's parameters under the names every LLaMA-like HF class uses (a family adds its own).
TENSORS = {
    "embed": Mapping("model.embed_tokens.weight", 0, per_layer=False),
    "final_norm/scale": Mapping("model.norm.weight", 0, per_layer=False),
    "head": Mapping("lm_head.weight", 1, per_layer=False),
    "blocks/attn_norm/scale": Mapping("model.layers.{}.input_layernorm.weight", 0),
    "blocks/attn/wq": Mapping("model.layers.{}.self_attn.q_proj.weight", 1),
    "blocks/attn/wk": Mapping("model.layers.{}.self_attn.k_proj.weight", 1),
    "blocks/attn/wv": Mapping("model.layers.{}.self_attn.v_proj.weight", 1),
    "blocks/attn/wo": Mapping("model.layers.{}.self_attn.o_proj.weight", 2),
    "blocks/attn/bq": Mapping("model.layers.{}.self_attn.q_proj.bias", 0, flat=True),
    "blocks/attn/bk": Mapping("model.layers.{}.self_attn.k_proj.bias", 0, flat=True),
    "blocks/attn/bv": Mapping("model.layers.{}.self_attn.v_proj.bias", 0, flat=True),
    "blocks/attn/q_norm/scale": Mapping("model.layers.{}.self_attn.q_norm.weight", 0),
    "blocks/attn/k_norm/scale": Mapping("model.layers.{}.self_attn.k_norm.weight", 0),
    "blocks/mlp_norm/scale": Mapping("model.layers.{}.post_attention_layernorm.weight", 0),
    "blocks/mlp/gate": Mapping("model.layers.{}.mlp.gate_proj.weight", 1),
    "blocks/mlp/up": Mapping("model.layers.{}.mlp.up_proj.weight", 1),
    "blocks/mlp/down": Mapping("model.layers.{}.mlp.down_proj.weight", 1),
}


# Multi-token prediction depths (models/mtp.py, `model.mtp_layers`) as DeepSeek-V3's published checkpoints hold
# them: depth j is HF layer num_hidden_layers + j; its block is named as the model's last layer is, besides these.
MTP_TENSORS = {
    "mtp/enorm/scale": Mapping("model.layers.{}.enorm.weight", 0),
    "mtp/hnorm/scale": Mapping("model.layers.{}.hnorm.weight", 0),
    "mtp/eh_proj": Mapping("model.layers.{}.eh_proj.weight", 1),
    "mtp/norm/scale": Mapping("model.layers.{}.shared_head.norm.weight", 0),
}
# What those layers hold besides: copies of the embedding and the head, which the depths share with the main model
# (read from its own names; the copies are not read).
MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def mtp_tensors(m: dict, tensors: dict[str, Mapping]) -> dict[str, Mapping]:
  """The names of the MTP depths' parameters ('mtp/<j>/block/attn/wq' is 'mtp/block/attn/wq' of layer j): the block's
  from the family's names of its last stack (`moe_blocks/` when the model has MoE layers, as models/decoder.py
  builds the depths' blocks), every layer index counted from num_layers."""
  moe = m.get("moe") or {}
  stack = "moe_blocks/" if moe.get("num_experts") and moe.get("first_dense_layers", 0) < m["num_layers"] else "blocks/"
  out = {f"mtp/block/{k[len(stack):]}": v for k, v in tensors.items() if k.startswith(stack)}
  out.update(MTP_TENSORS)
  return {k: dataclasses.replace(v, layer_offset=m["num_layers"]) for k, v in out.items()}


def stack_tensors(stack: str, tensors: dict[str, Mapping] = TENSORS) -> dict[str, Mapping]:
  """The per-layer names of `blocks/` for another stack of the decoder (`moe_blocks/`: a MoE model's layers)."""
  return {f"{stack}/{k.split('/', 1)[1]}": m for k, m in tensors.items() if k.startswith("blocks/")}


ROPE_TYPES = {"default": "none", "llama3": "llama3", "linear": "linear", "yarn": "yarn"}  # HF rope_type -> model.rope_scaling
# YaRN fields -> model.rope_* keys (a family reads yarn only when its adapter lists it in rope_types)
YARN_FIELDS = {"rope_scaling_factor": ("factor", float), "rope_original_max_len": ("original_max_position_embeddings", int),
               "rope_beta_fast": ("beta_fast", float), "rope_beta_slow": ("beta_slow", float)}
# model.rope_* key <- HF llama3 rope field
LLAMA3_FIELDS = {"rope_scaling_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
                 "rope_high_freq_factor": "high_freq_factor",
                 "rope_original_max_len": "original_max_position_embeddings"}
_DEFAULTS = {"rope_scaling_factor": 8.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
             "rope_original_max_len": 8192}
# Fields read as numbers: a JSON string ("4096") or a bool there is refused by name, not a TypeError later.
INT_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "vocab_size", "max_position_embeddings", "head_dim", "sliding_window")
FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def refuse(where: str, field: str, value: Any, why: str) -> UserError:
  return UserError(f"{where}: {field}={json.dumps(value)}: {why}")


def number(value: Any, kind: type, where: str, field: str) -> Any:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise refuse(where, field, value, "must be a number (a JSON number, not a string)")
  return kind(value)


def rope(hf: dict, where: str, types: tuple[str, ...] = ("default", "llama3")) -> dict[str, Any]:
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or {}
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  spec = {**params, **scaling}
  kind = spec.get("rope_type", spec.get("type", "default"))
  field = "rope_scaling.rope_type" if scaling else "rope_parameters.rope_type"
  if kind not in types:
    raise refuse(where, field, kind, f"unsupported RoPE type (supported: {', '.join(types)})")
  out = {"rope_theta": number(theta, float, where, "rope_theta"), "rope_scaling": ROPE_TYPES[kind]}
  if kind == "linear":
    if "factor" not in spec:
      raise refuse(where, f"{field.split('.')[0]}.factor", None, "missing: linear RoPE scaling needs it")
    out["rope_scaling_factor"] = number(spec["factor"], float, where, f"{field.split('.')[0]}.factor")
  if kind == "llama3":
    for key, hf_key in LLAMA3_FIELDS.items():
      if hf_key not in spec:
        raise refuse(where, f"rope_scaling.{hf_key}", None, "missing: llama3 RoPE scaling needs it")
      out[key] = number(spec[hf_key], type(_DEFAULTS[key]), where, f"rope_scaling.{hf_key}")
  if kind == "yarn":
    if spec.get("factor") is None:
      raise refuse(where, f"{field.split('.')[0]}.factor", None, "missing: yarn RoPE scaling needs it")
    out.update(rope_beta_fast=32.0, rope_beta_slow=1.0)  # transformers' defaults
    for key, (hf_key, kind_) in YARN_FIELDS.items():
      if hf_key in spec and spec[hf_key] is not None:
        out[key] = number(spec[hf_key], kind_, where, f"{field.split('.')[0]}.{hf_key}")
    out.setdefault("rope_original_max_len", hf.get("max_position_embeddings", 4096))
    out["rope_truncate"] = bool(spec.get("truncate", True))
    factor, mscale, mscale_all = out.get("rope_scaling_factor", 1.0), spec.get("mscale"), spec.get("mscale_all_dim")
    get = lambda s, m=1.0: 0.1 * m * math.log(s) + 1.0 if s > 1 else 1.0  # transformers' yarn_get_mscale
    if spec.get("attention_factor") is not None:
      out["rope_attention_factor"] = number(spec["attention_factor"], float, where, "rope_scaling.attention_factor")
    elif mscale and mscale_all:
      out["rope_attention_factor"] = get(factor, mscale) / get(factor, mscale_all)
  return out


def _check_types(hf: dict, where: str, architecture: str) -> None:
  for field in REQUIRED:
    if field not in hf:
      raise refuse(where, field, None, f"missing: a {architecture} config.json needs it")
  for field in INT_FIELDS:
    value = hf.get(field)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
      raise refuse(where, field, value, "must be a positive integer (a JSON number, not a string)")
  for field in FLOAT_FIELDS:
    value = hf.get(field)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
      raise refuse(where, field, value, "must be a positive number (a JSON number, not a string)")


def no_window(hf: dict, where: str) -> None:
  """Refuses the sliding-window fields of a family whose maxtrain pattern has no window from HF (Qwen)."""
  if hf.get("use_sliding_window"):
    raise refuse(where, "use_sliding_window", True, "Qwen's per-layer sliding window (max_window_layers) is not "
                 "supported")
  sliding = [t for t in hf.get("layer_types") or () if t != "full_attention"]
  if sliding:
    raise refuse(where, "layer_types", sliding[0], "only full_attention layers are supported for this family")


def refuse_bias(hf: dict, where: str, fields: tuple[str, ...] = ("attention_bias", "mlp_bias")) -> None:
  for field in fields:
    if hf.get(field, False):
      raise refuse(where, field, hf[field], "this family has no such biases in maxtrain")


@dataclasses.dataclass(frozen=True)
class HFAdapter:
  architecture: str  # config.json `architectures` ("Qwen3ForCausalLM")
  model_type: str  # config.json `model_type` ("qwen3")
  pieces_in: Callable[[dict, str], dict]  # (config.json, where) -> the family's model.* keys; refuses by field
  pieces_out: Callable[[dict, str], dict]  # (model keys, where) -> the family's config.json fields; refuses
  tensors: dict[str, Mapping] = dataclasses.field(default_factory=lambda: TENSORS)
  rope_types: tuple[str, ...] = ("default", "llama3", "linear")  # the HF rope_type values the family reads
  tensors_for: Callable[[dict], dict[str, Mapping]] | None = None  # model keys -> tensors, when they depend on them
  activations: tuple[str, ...] = ("silu",)  # the HF hidden_act / hidden_activation values the family reads
  # the Gemma-style model.* pieces (GEMMA_PIECES) its config.json expresses: to-hf refuses the others when on
  expresses: tuple[str, ...] = ()

  def tensors_of(self, m: dict) -> dict[str, Mapping]:
    tensors = self.tensors_for(m) if self.tensors_for else self.tensors
    return {**tensors, **mtp_tensors(m, tensors)} if m.get("mtp_layers") else tensors

  def to_model_keys(self, hf: dict, where: str, vocab_multiple: int) -> dict[str, Any]:
    """`config.model` keys equal to this HF model; the vocabulary padded up to a multiple of `vocab_multiple`."""
    if not isinstance(hf, dict):
      raise UserError(f"{where}: expected a JSON object, found {type(hf).__name__}")
    _check_types(hf, where, self.architecture)
    if hf.get("model_type", self.model_type) != self.model_type:
      raise refuse(where, "model_type", hf["model_type"], f"{self.architecture} needs {self.model_type}")
    for field in ("hidden_act", "hidden_activation"):  # 5.x Gemma writes only the second, 4.x both
      if hf.get(field, self.activations[0]) not in self.activations:
        raise refuse(where, field, hf[field], f"{self.architecture} reads only {', '.join(self.activations)}")
    heads, width = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or width // heads
    vocab = hf["vocab_size"]
    keys = {"num_layers": hf["num_hidden_layers"], "d_model": width, "num_heads": heads,
            "num_kv_heads": hf.get("num_key_value_heads") or heads, "d_ff": hf["intermediate_size"],
            "vocab_size": -(-vocab // vocab_multiple) * vocab_multiple,
            "max_seq_len": hf.get("max_position_embeddings", 2048),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "scan_layers": True,
            # 0 (d_model / num_heads) when it is that: the default run's keys stay as they were
            "head_dim": 0 if head_dim * heads == width else head_dim}
    keys.update(rope(hf, where, self.rope_types))
    keys.update(self.pieces_in(hf, where))
    return keys

  def from_model_keys(self, m: dict, *, vocab_size: int, dtype: str, bos_id: int | None, eos_id: int | None,
                      where: str) -> dict:
    """The `config.json` of a maxtrain model (the legacy RoPE spelling, which transformers 4 and 5 read)."""
    scaling = None
    if m.get("rope_scaling", "none") == "llama3":
      scaling = {"rope_type": "llama3", **{hf_key: m[key] for key, hf_key in LLAMA3_FIELDS.items()}}
    elif m.get("rope_scaling", "none") == "linear":
      scaling = {"rope_type": "linear", "factor": m["rope_scaling_factor"]}
    elif m.get("rope_scaling", "none") == "yarn":
      defaults = {"rope_beta_fast": 32.0, "rope_beta_slow": 1.0}
      scaling = {"rope_type": "yarn", **{hf_key: m.get(key, defaults.get(key)) for key, (hf_key, _) in YARN_FIELDS.items()},
                 "truncate": m.get("rope_truncate", True)}
      if m.get("rope_attention_factor"):
        scaling["attention_factor"] = m["rope_attention_factor"]
    out = {"architectures": [self.architecture], "model_type": self.model_type, "hidden_act": "silu",
           "hidden_size": m["d_model"], "intermediate_size": m["d_ff"], "num_hidden_layers": m["num_layers"],
           "num_attention_heads": m["num_heads"], "num_key_value_heads": m["num_kv_heads"],
           "head_dim": m.get("head_dim") or m["d_model"] // m["num_heads"], "vocab_size": vocab_size,
           "max_position_embeddings": m["max_seq_len"], "rms_norm_eps": m.get("norm_eps", 1e-5),
           "rope_theta": m["rope_theta"], "rope_scaling": scaling, "tie_word_embeddings": m["tie_embeddings"],
           "bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": dtype, "use_cache": True}
    require_off(m, where, self.architecture, *(k for k in GEMMA_PIECES if k not in self.expresses))
    if m.get("mlp_activation", "silu") != "silu" and "mlp_activation" not in self.expresses:
      raise UserError(f"{where}: model.mlp_activation={m['mlp_activation']!r}: {self.architecture} has only silu")
    out.update(self.pieces_out(m, where))
    return out


# Pieces (model.* keys, off = False / 0) only a Gemma-style config.json can express; mlp_activation besides
GEMMA_PIECES = ("norm_one_plus", "post_norms", "embed_scale", "query_pre_attn_scalar", "attn_logit_softcap",
                "final_logit_softcap")


def require_off(m: dict, where: str, architecture: str, *keys: str) -> None:
  """UserError when a maxtrain piece `architecture` cannot express is on (to-hf of llama + qk_norm...)."""
  for key in keys:
    if m.get(key):
      raise UserError(f"{where}: model.{key}={m[key]!r}: {architecture} has no such piece; export a family "
                      "that has it (docs/models.md)")
