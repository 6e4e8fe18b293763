"""`convert from-hf`: a Hugging Face directory of a registered family -> a converted checkpoint (`params_store` format)
plus a maxtrain config preset for it, one block of one tensor in host memory at a time: each HF
tensor's row blocks are read from its file, laid out (`names.Piece`) and written into their box of
the (stacked) parameter, whose chunks are those blocks."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np

from maxtrain.errors import UserError
from maxtrain.interop import names as names_lib, params_store
from maxtrain.interop.sources import HFSource

log = logging.getLogger("maxtrain")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DTYPE_CHOICES = ("keep", "float32", "bfloat16")

PRESET = '''"""maxtrain config of {source}, written by `python -m maxtrain.convert from-hf`.

Continue pretraining: python -m maxtrain.train --config={here}/config.py --config.data.path=...
"""

from pathlib import Path

from maxtrain.config import base_config, load_file

HERE = Path(__file__).resolve().parent


def get_config():
  c = {base}
{assignments}
  return c
'''


def _preset(out: Path, hf_dir: Path, model: dict, tokenizer: bool, base_config: str | None) -> str:
  lines = [f"  c.model.{k} = {v!r}" for k, v in model.items()]
  if tokenizer:
    lines.append('  c.data.tokenizer = str(HERE / "tokenizer.json")')
  lines.append("  c.checkpoint.init_from = str(HERE)")
  base = f"load_file({str(Path(base_config).resolve())!r})[0]" if base_config else "base_config()"
  return PRESET.format(source=hf_dir, here=out, base=base, assignments="\n".join(lines))


def _convert(source: HFSource, params_dir: Path, name: str, dtype: str, block_bytes: int) -> dict:
  """One parameter, block by block; returns its meta.json entry."""
  shape, stored = source.info(name)
  target = stored if dtype == "keep" else dtype
  pieces = source.pieces(name)
  if not pieces:  # a parameter HF has no tensor for (a routing bias): zeros
    store = params_store.create(params_dir, name, shape, target, tuple(shape))
    params_store.write_block(store, (), np.zeros(shape, target))
    return {"shape": list(shape), "dtype": target}
  chunk, row_dim = list(shape), len(pieces[0].prefix) + pieces[0].row_dim
  chunk[row_dim] = min(shape[row_dim], names_lib.block_units(pieces[0].layer_shape, pieces[0].row_dim, block_bytes))
  for d in range(len(pieces[0].prefix)):
    chunk[d] = 1  # one layer (one expert of a layer) per chunk
  store = params_store.create(params_dir, name, shape, target, tuple(chunk))
  for piece in pieces:
    for start, stop in piece.blocks(block_bytes):
      block = source.read_block(piece, start, stop).astype(target, copy=False)
      params_store.write_block(store, piece.index(start, stop), block)
  log.info("%s %s %s", name, list(shape), target)
  return {"shape": list(shape), "dtype": target}


def from_hf(hf_dir: str | Path, out: str | Path, *, vocab_multiple: int = 128, dtype: str = "keep",
            base_config: str | None = None, block_bytes: int = names_lib.BLOCK_BYTES) -> dict:
  """Converts; returns a summary (parameters, bytes, seconds). UserError (exit 2) for what it does not support.

  Everything is written into a staging directory beside `out` and moved into `out` only once complete,
  so a failure (a bad tensor, a full disk, Ctrl-C) leaves no partial conversion behind."""
  t0 = time.monotonic()
  hf_dir, out = Path(hf_dir), Path(out)
  if dtype not in DTYPE_CHOICES:
    raise UserError(f"--dtype={dtype}: choose one of {', '.join(DTYPE_CHOICES)}")
  source = HFSource(hf_dir, vocab_multiple)
  if out.exists() and not out.is_dir():
    raise UserError(f"{out} is a file: choose a new output directory")
  taken = [out / n for n in ("params", "config.py", *TOKENIZER_FILES) if (out / n).exists()]
  if taken:
    raise UserError(f"{taken[0]} already exists: choose a new output directory (nothing is overwritten)")
  stage = out.parent / f".{out.name}.partial-{os.getpid()}"
  try:
    stage.mkdir(parents=True)
    summary = _write(source, hf_dir, stage, out, dtype, base_config, block_bytes)
    out.mkdir(parents=True, exist_ok=True)
    for entry in stage.iterdir():
      entry.rename(out / entry.name)
  finally:
    shutil.rmtree(stage, ignore_errors=True)
  return {**summary, "seconds": time.monotonic() - t0}


def _write(source: HFSource, hf_dir: Path, stage: Path, out: Path, dtype: str, base_config: str | None,
           block_bytes: int) -> dict:
  """The conversion's files in `stage`; the config preset names their final home, `out`."""
  params_dir = stage / "params"
  params_dir.mkdir()
  params = {name: _convert(source, params_dir, name, dtype, block_bytes) for name in source.names()}
  stored = next(iter(params.values()))["dtype"]
  model = {**source.model, "param_dtype": stored if stored in ("float32", "bfloat16") else "float32"}
  copied = [f for f in TOKENIZER_FILES if (hf_dir / f).is_file()]
  for f in copied:
    shutil.copyfile(hf_dir / f, stage / f)
  tokenizer = "tokenizer.json" in copied
  params_store.finish(params_dir, {"model": model, "params": params, "vocab_size": source.vocab_size,
                                   "bos_token_id": source.bos_id, "eos_token_id": source.eos_id,
                                   "tokenizer": "tokenizer.json" if tokenizer else "", "source": str(hf_dir)})
  (stage / "config.py").write_text(_preset(out.resolve(), hf_dir, model, tokenizer, base_config))
  count = sum(int(np.prod(p["shape"])) for p in params.values())
  return {"parameters": count, "tokenizer": tokenizer,
          "bytes": sum(int(np.prod(p["shape"])) * np.dtype(p["dtype"]).itemsize for p in params.values())}
