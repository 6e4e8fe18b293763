"""`convert to-hf`: a converted or training checkpoint -> a Hugging Face directory of its family's class
(size-capped safetensors files with an index, config.json, generation_config.json, the tokenizer).

Streams: the files are planned from shapes alone, and each HF tensor is written as row blocks
(`names.Piece`), each read on its own from the checkpoint (`source.read_slice`: TensorStore reads
that box), laid out, cast and appended to the file, so the exporter holds one block at a time.
Scanned (stacked) and unscanned (`model.scan_layers=False`) checkpoints export the same way.

Several processes (`process_count` > 1, e.g. one per host of a cluster, each seeing the checkpoint's
storage) split the files: process i writes files i, i + n, ..., reading only the blocks those files
hold; process 0 also writes the index, the configs and the tokenizer. No process needs the others.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np

from maxtrain.errors import UserError
from maxtrain.interop import hf_config, names as names_lib, safetensors_io
from maxtrain.interop.sources import HFSource, open_source

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
log = logging.getLogger("maxtrain")


def _pieces(source, dtype: str) -> list[tuple[names_lib.Piece, safetensors_io.TensorInfo]]:
  """(piece, HF tensor) in writing order: parameter kind by kind (the family's tensor order), layers in order."""
  # The multi-token-prediction depths (model.mtp_layers): transformers' classes have no place for them (DeepSeek-V3's
  # loads num_hidden_layers layers and drops the rest), so they are left out, and said so.
  mtp = [n for n in source.names() if n.startswith("mtp/")]
  if mtp:
    log.warning("to-hf: dropped the %d parameters of the model.mtp_layers=%s multi-token-prediction depth(s) (%s ...): "
                "the Hugging Face class has no place for them", len(mtp), source.model.get("mtp_layers"), mtp[0])
  out, tensors = [], hf_config.tensors({**source.model, "mtp_layers": 0})
  for name in source.names():
    if name.startswith("mtp/"):
      continue
    shape, stored = source.info(name)
    target = stored if dtype == "keep" else dtype
    base = names_lib.split_layer(name)[0]
    if names_lib.mapping(base, tensors).absent:  # HF has no place for it: only zeros may be left out
      if np.any(source.read(name)):
        raise UserError(f"{name} is non-zero (model.moe.bias_update_rate moved it) and the family's Hugging Face "
                        "class has no tensor for it: train with model.moe.bias_update_rate=0 to export")
      continue
    for piece in names_lib.pieces(name, shape, source.vocab_size, tensors):
      out.append((piece, safetensors_io.TensorInfo(piece.hf_name, piece.hf_shape, target)))
  kinds = list(tensors)
  return sorted(out, key=lambda p: (kinds.index(p[0].base), p[0].prefix, names_lib.split_layer(p[0].param)[1] or 0))


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


def _check_out(out: Path, files: list[Path], process_count: int) -> None:
  if process_count == 1 and out.exists() and any(out.iterdir()):
    raise UserError(f"{out} is not empty: choose a new output directory (nothing is overwritten)")
  existing = [f for f in files if f.exists()]
  if existing:
    raise UserError(f"{existing[0]} exists: choose a new output directory (nothing is overwritten)")


def to_hf(checkpoint: str | Path, out: str | Path, *, max_shard_bytes: int = 2 << 30, dtype: str = "keep",
          block_bytes: int = names_lib.BLOCK_BYTES, process_index: int = 0, process_count: int = 1) -> dict:
  t0 = time.monotonic()
  out = Path(out)
  if dtype not in ("keep", "float32", "bfloat16"):
    raise UserError(f"--dtype={dtype}: choose one of keep, float32, bfloat16")
  if not 0 <= process_index < process_count:
    raise UserError(f"process {process_index} of {process_count}: needs 0 <= index < count")
  source = open_source(checkpoint)
  if isinstance(source, HFSource):
    raise UserError(f"{checkpoint} is already a Hugging Face directory (to-hf reads a run, a checkpoint step or "
                    "a converted checkpoint)")
  if source.model.get("moe", {}).get("num_experts") and "moe_blocks/moe/router" not in hf_config.tensors(source.model):
    raise UserError(f"{checkpoint}: a mixture-of-experts model (model.moe.num_experts="
                    f"{source.model['moe']['num_experts']}) of a family with dense layers only; export a MoE family "
                    "(docs/models.md)")
  # The family's config.json first: a piece its HF class cannot express is refused before any file is written.
  hf_config.from_model_keys(source.model, vocab_size=source.vocab_size, dtype="float32", bos_id=None, eos_id=None,
                            where=str(checkpoint))
  pieces = _pieces(source, dtype)
  plan = safetensors_io.plan([t for _, t in pieces], max_shard_bytes)
  mine = [i for i in range(len(plan)) if i % process_count == process_index]
  names = safetensors_io.file_names(len(plan))
  _check_out(out, [out / names[i] for i in mine] + ([out / "config.json"] if process_index == 0 else []), process_count)
  by_hf = {t.name: p for p, t in pieces}

  def blocks(info: safetensors_io.TensorInfo):
    piece = by_hf[info.name]
    for start, stop in piece.blocks(block_bytes):
      yield piece.to_hf(source.read_slice(piece.param, piece.index(start, stop))).astype(info.dtype, copy=False)

  out.mkdir(parents=True, exist_ok=True)
  for i in mine:
    safetensors_io.write_file(out / names[i], plan[i], blocks)
  tokenizer = False
  if process_index == 0:
    safetensors_io.write_index(out, plan)
    tokenizer = _write_configs(source, out, pieces[0][1].dtype)
  return {"files": len(mine), "tensors": sum(len(plan[i]) for i in mine), "tokenizer": tokenizer,
          "bytes": sum(t.nbytes for i in mine for t in plan[i]), "seconds": time.monotonic() - t0}


def _write_configs(source, out: Path, stored: str) -> bool:
  config = hf_config.from_model_keys(source.model, vocab_size=source.vocab_size, dtype=stored,
                                     bos_id=source.bos_id, eos_id=source.eos_id, where=str(source.dir))
  (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
  (out / "generation_config.json").write_text(
      json.dumps(hf_config.generation_config(source.bos_id, source.eos_id), indent=2) + "\n")
  return _copy_tokenizer(source.tokenizer, out)
