"""Hugging Face `config.json` <-> maxtrain `config.model` keys, and what is refused.

Only `LlamaForCausalLM` is read: SwiGLU (`silu`), no biases, head_dim = hidden_size / heads, RoPE
`default` or `llama3`. Anything else is a UserError (exit 2) that names the field. Both spellings of
the RoPE fields are read: `rope_theta` + `rope_scaling` (transformers 4.x, most published
checkpoints) and `rope_parameters` (transformers 5.x); the legacy one is written, which both read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from maxtrain.errors import UserError, require

ARCHITECTURE = "LlamaForCausalLM"
ROPE_TYPES = {"default": "none", "llama3": "llama3"}  # HF rope_type -> model.rope_scaling
# model.rope_* key <- HF llama3 rope field
LLAMA3_FIELDS = {"rope_scaling_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
                 "rope_high_freq_factor": "high_freq_factor",
                 "rope_original_max_len": "original_max_position_embeddings"}

_DEFAULTS = {"rope_scaling_factor": 8.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
             "rope_original_max_len": 8192}


def read(hf_dir: Path) -> dict[str, Any]:
  path = Path(hf_dir) / "config.json"
  try:
    return json.loads(path.read_text())
  except OSError as e:
    raise UserError(f"{path}: cannot read the Hugging Face config ({e.strerror}); pass a directory saved by "
                    "save_pretrained") from None
  except json.JSONDecodeError as e:
    raise UserError(f"{path}: not valid JSON ({e})") from None


def _refuse(where: str, field: str, value: Any, why: str) -> UserError:
  return UserError(f"{where}: {field}={json.dumps(value)}: {why}")


def _rope(hf: dict, where: str) -> dict[str, Any]:
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or {}
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  rope = {**params, **scaling}
  kind = rope.get("rope_type", rope.get("type", "default"))
  field = "rope_scaling.rope_type" if scaling else "rope_parameters.rope_type"
  if kind not in ROPE_TYPES:
    raise _refuse(where, field, kind, f"unsupported RoPE type (supported: {', '.join(ROPE_TYPES)})")
  out = {"rope_theta": _number(theta, float, where, "rope_theta"), "rope_scaling": ROPE_TYPES[kind]}
  if kind == "llama3":
    for key, hf_key in LLAMA3_FIELDS.items():
      if hf_key not in rope:
        raise _refuse(where, f"rope_scaling.{hf_key}", None, "missing: llama3 RoPE scaling needs it")
      out[key] = _number(rope[hf_key], type(_DEFAULTS[key]), where, f"rope_scaling.{hf_key}")
  return out


def _number(value: Any, kind: type, where: str, field: str) -> Any:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise _refuse(where, field, value, "must be a number (a JSON number, not a string)")
  return kind(value)


# Fields read as numbers: a JSON string ("4096") or a bool there is refused by name, not a TypeError later.
INT_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "vocab_size", "max_position_embeddings", "head_dim")
FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")


def _check_types(hf: dict, where: str) -> None:
  for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
    if field not in hf:
      raise _refuse(where, field, None, "missing: a LlamaForCausalLM config.json needs it")
  for field in INT_FIELDS:
    value = hf.get(field)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
      raise _refuse(where, field, value, "must be a positive integer (a JSON number, not a string)")
  for field in FLOAT_FIELDS:
    value = hf.get(field)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
      raise _refuse(where, field, value, "must be a positive number (a JSON number, not a string)")


def _check_supported(hf: dict, where: str) -> None:
  if not isinstance(hf, dict):
    raise UserError(f"{where}: expected a JSON object, found {type(hf).__name__}")
  _check_types(hf, where)
  arch = hf.get("architectures") or [ARCHITECTURE]
  if arch != [ARCHITECTURE]:
    raise _refuse(where, "architectures", arch, f"only {ARCHITECTURE} is supported")
  if hf.get("model_type", "llama") != "llama":
    raise _refuse(where, "model_type", hf["model_type"], "only llama is supported")
  if hf.get("hidden_act", "silu") != "silu":
    raise _refuse(where, "hidden_act", hf["hidden_act"], "only silu (SwiGLU) is supported")
  for field in ("attention_bias", "mlp_bias"):
    if hf.get(field, False):
      raise _refuse(where, field, hf[field], "biases are not supported (maxtrain's LLaMA has none)")
  heads, width = hf["num_attention_heads"], hf["hidden_size"]
  if hf.get("head_dim") not in (None, width // heads) or width % heads:
    raise _refuse(where, "head_dim", hf.get("head_dim"), f"must be hidden_size / num_attention_heads = "
                  f"{width}/{heads}")
  if hf.get("sliding_window"):
    raise _refuse(where, "sliding_window", hf["sliding_window"], "sliding-window attention is not supported")


def to_model_keys(hf: dict, where: str, vocab_multiple: int = 128) -> dict[str, Any]:
  """`config.model` keys of the maxtrain model equal to this HF LLaMA; the vocabulary padded up to a
  multiple of `vocab_multiple` (so that it divides the mesh; padded rows are zero)."""
  _check_supported(hf, where)
  require(vocab_multiple > 0, f"--vocab-multiple={vocab_multiple}: must be > 0")
  vocab = hf["vocab_size"]
  keys = {"num_layers": hf["num_hidden_layers"], "d_model": hf["hidden_size"],
          "num_heads": hf["num_attention_heads"],
          "num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
          "d_ff": hf["intermediate_size"], "vocab_size": -(-vocab // vocab_multiple) * vocab_multiple,
          "max_seq_len": hf.get("max_position_embeddings", 2048),
          "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
          "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "scan_layers": True}
  keys.update(_rope(hf, where))
  return keys


def from_model_keys(m: dict, *, vocab_size: int, dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
  """The `config.json` of a maxtrain model (the legacy RoPE spelling, which transformers 4 and 5 read)."""
  scaling = None
  if m.get("rope_scaling", "none") == "llama3":
    scaling = {"rope_type": "llama3", **{hf_key: m[key] for key, hf_key in LLAMA3_FIELDS.items()}}
  return {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_act": "silu",
          "hidden_size": m["d_model"], "intermediate_size": m["d_ff"], "num_hidden_layers": m["num_layers"],
          "num_attention_heads": m["num_heads"], "num_key_value_heads": m["num_kv_heads"],
          "head_dim": m["d_model"] // m["num_heads"], "vocab_size": vocab_size,
          "max_position_embeddings": m["max_seq_len"], "rms_norm_eps": m.get("norm_eps", 1e-5),
          "rope_theta": m["rope_theta"], "rope_scaling": scaling, "tie_word_embeddings": m["tie_embeddings"],
          "attention_bias": False, "mlp_bias": False, "bos_token_id": bos_id, "eos_token_id": eos_id,
          "torch_dtype": dtype, "use_cache": True}


def generation_config(bos_id: int | None, eos_id: int | None) -> dict:
  return {"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False}
