"""Hugging Face `config.json` <-> maxtrain `config.model` keys, through the family's adapter.

The family comes from config.json's `architectures` (`models/registry.for_architecture`); its adapter
(`models/hf_adapter.py` plus the family's own fields) maps the rest and refuses, by field, what would
change the math and is not understood (exit 2). Both spellings of the RoPE fields are read
(transformers 4.x `rope_theta` + `rope_scaling`, 5.x `rope_parameters`); the legacy one is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from maxtrain.errors import UserError, require
from maxtrain.models import registry


def read(hf_dir: Path) -> dict[str, Any]:
  path = Path(hf_dir) / "config.json"
  try:
    return json.loads(path.read_text())
  except OSError as e:
    raise UserError(f"{path}: cannot read the Hugging Face config ({e.strerror}); pass a directory saved by "
                    "save_pretrained") from None
  except json.JSONDecodeError as e:
    raise UserError(f"{path}: not valid JSON ({e})") from None


def to_model_keys(hf: dict, where: str, vocab_multiple: int = 128) -> dict[str, Any]:
  """`config.model` keys of the maxtrain model equal to this HF model (its family's); the vocabulary padded
  up to a multiple of `vocab_multiple` (so that it divides the mesh; padded rows are zero)."""
  require(vocab_multiple > 0, f"--vocab-multiple={vocab_multiple}: must be > 0")
  family = registry.for_architecture(hf, where)
  return family.hf.to_model_keys(hf, where, vocab_multiple)


def from_model_keys(m: dict, *, vocab_size: int, dtype: str, bos_id: int | None, eos_id: int | None,
                    where: str = "the checkpoint") -> dict:
  """The `config.json` of a maxtrain model, as its family's HF class reads it. The adapter sees the pieces in
  effect (the family's own on), so one the class cannot express is refused by key."""
  cfg = registry.model_config(m)
  m = {**m, "qkv_bias": cfg.qkv_bias, "qk_norm": cfg.qk_norm, "sliding_window": cfg.sliding_window,
       "head_dim": cfg.head_dim_setting}
  return registry.of_keys(m).hf.from_model_keys(m, vocab_size=vocab_size, dtype=dtype, bos_id=bos_id, eos_id=eos_id, where=where)


def tensors(m: dict) -> dict:
  """The family's tensor names (models/hf_adapter.py Mapping by parameter kind) for these model keys."""
  return registry.of_keys(m).hf.tensors_of(m)


def generation_config(bos_id: int | None, eos_id: int | None) -> dict:
  return {"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False}
