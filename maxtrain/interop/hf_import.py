"""`convert from-hf`: a Hugging Face LLaMA directory -> a converted checkpoint (`params_store` format)
plus a maxtrain config preset for it, one parameter in host memory at a time."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import numpy as np

from maxtrain.errors import UserError
from maxtrain.interop import params_store
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


def from_hf(hf_dir: str | Path, out: str | Path, *, vocab_multiple: int = 128, dtype: str = "keep",
            base_config: str | None = None) -> dict:
  """Converts; returns a summary (parameters, bytes, seconds). UserError (exit 2) for what it does not support."""
  t0 = time.monotonic()
  hf_dir, out = Path(hf_dir), Path(out)
  if dtype not in DTYPE_CHOICES:
    raise UserError(f"--dtype={dtype}: choose one of {', '.join(DTYPE_CHOICES)}")
  source = HFSource(hf_dir, vocab_multiple)
  if (out / "params").exists():
    raise UserError(f"{out / 'params'} already exists: choose a new output directory (nothing is overwritten)")
  params_dir = out / "params"
  params_dir.mkdir(parents=True)
  params, total, stored = {}, 0, None
  for name in source.names():
    value = source.read(name)
    if dtype != "keep":
      value = value.astype(dtype)
    stored = str(value.dtype)
    params_store.write_param(params_dir, name, value)
    params[name] = {"shape": list(value.shape), "dtype": str(value.dtype)}
    total += value.nbytes
    log.info("%s %s %s", name, list(value.shape), value.dtype)
    del value  # one parameter at a time
  model = {**source.model, "param_dtype": stored if stored in ("float32", "bfloat16") else "float32"}
  copied = [f for f in TOKENIZER_FILES if (hf_dir / f).is_file()]
  for f in copied:
    shutil.copyfile(hf_dir / f, out / f)
  tokenizer = "tokenizer.json" in copied
  params_store.finish(params_dir, {"model": model, "params": params, "vocab_size": source.vocab_size,
                                   "bos_token_id": source.bos_id, "eos_token_id": source.eos_id,
                                   "tokenizer": "tokenizer.json" if tokenizer else "", "source": str(hf_dir)})
  (out / "config.py").write_text(_preset(out.resolve(), hf_dir, model, tokenizer, base_config))
  return {"parameters": sum(int(np.prod(p["shape"])) for p in params.values()), "bytes": total,
          "seconds": time.monotonic() - t0, "tokenizer": tokenizer}
