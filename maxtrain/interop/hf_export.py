"""`convert to-hf`: a converted or training checkpoint -> a Hugging Face `LlamaForCausalLM` directory
(size-capped safetensors files with an index, config.json, generation_config.json, the tokenizer).

Streams: the files are planned from shapes alone; each maxtrain parameter (layers stacked) is read
once, when the first of its tensors is written, and dropped when the next parameter is needed.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np

from maxtrain.errors import UserError
from maxtrain.interop import hf_config, names as names_lib, safetensors_io
from maxtrain.interop.sources import open_source

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _tensors(source, dtype: str) -> list[tuple[str, int | None, safetensors_io.TensorInfo]]:
  """(maxtrain name, layer or None, HF tensor) in writing order."""
  out, model = [], source.model
  for name in names_lib.MAPPINGS:
    if name not in source.names():
      continue
    shape, stored = source.info(name)
    mapping = names_lib.mapping(name)
    layer_shape = list(shape[1:] if mapping.per_layer else shape)
    if name in names_lib.VOCAB_DIM:
      layer_shape[names_lib.VOCAB_DIM[name]] = source.vocab_size
    hf_shape = names_lib.hf_shape(name, tuple(layer_shape))
    target = stored if dtype == "keep" else dtype
    for i, hf_name in enumerate(names_lib.hf_names(name, model["num_layers"])):
      out.append((name, i if mapping.per_layer else None, safetensors_io.TensorInfo(hf_name, hf_shape, target)))
  return out


def _copy_tokenizer(tokenizer: str, out: Path) -> bool:
  if not tokenizer or tokenizer == "byte" or not Path(tokenizer).exists():
    return False
  path = Path(tokenizer)
  directory = path if path.is_dir() else path.parent
  shutil.copyfile(path / "tokenizer.json" if path.is_dir() else path, out / "tokenizer.json")
  for f in TOKENIZER_FILES[1:]:
    if (directory / f).is_file():
      shutil.copyfile(directory / f, out / f)
  return True


def to_hf(checkpoint: str | Path, out: str | Path, *, max_shard_bytes: int = 2 << 30, dtype: str = "keep") -> dict:
  t0 = time.monotonic()
  out = Path(out)
  if dtype not in ("keep", "float32", "bfloat16"):
    raise UserError(f"--dtype={dtype}: choose one of keep, float32, bfloat16")
  if out.exists() and any(out.iterdir()):
    raise UserError(f"{out} is not empty: choose a new output directory (nothing is overwritten)")
  source = open_source(checkpoint)
  if not source.model.get("scan_layers", True):
    raise UserError(f"{checkpoint}: model.scan_layers=False checkpoints are not exported yet; train with "
                    "scan_layers=True")
  tensors = _tensors(source, dtype)
  cached: dict[str, np.ndarray] = {}

  def get(info: safetensors_io.TensorInfo) -> np.ndarray:
    name, layer, _ = by_hf[info.name]
    if name not in cached:
      cached.clear()  # one maxtrain parameter in memory at a time
      cached[name] = source.read(name)
    w = cached[name] if layer is None else cached[name][layer]
    w = names_lib.to_hf(name, names_lib.trim_vocab(name, w, source.vocab_size))
    return w.astype(info.dtype, copy=False)

  by_hf = {t.name: (n, layer, t) for n, layer, t in tensors}
  files = safetensors_io.write(out, safetensors_io.plan([t for _, _, t in tensors], max_shard_bytes), get)
  cached.clear()
  stored = tensors[0][2].dtype
  config = hf_config.from_model_keys(source.model, vocab_size=source.vocab_size, dtype=stored,
                                     bos_id=source.bos_id, eos_id=source.eos_id)
  (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
  (out / "generation_config.json").write_text(
      json.dumps(hf_config.generation_config(source.bos_id, source.eos_id), indent=2) + "\n")
  tokenizer = _copy_tokenizer(source.tokenizer, out)
  return {"files": len(files), "tensors": len(tensors), "bytes": sum(t.nbytes for _, _, t in tensors),
          "seconds": time.monotonic() - t0, "tokenizer": tokenizer}
