"""The converted-parameters format: what `convert from-hf` writes and `init_from` / `to-hf` / `generate` read.

```
OUT/
  config.py        a maxtrain config preset for this model (shape, RoPE, eps, tokenizer, init_from)
  tokenizer.json   the model's tokenizer, when it had one (named by config.py's data.tokenizer)
  params/
    meta.json      format, config.model keys, every parameter's shape and dtype, the HF ids and vocab
    embed/ blocks.attn.wq/ ...   one Orbax checkpoint per parameter (layers stacked, as in training)
    maxtrain_manifest.json       written last: sizes and checksums (maxtrain/manifest.py); its
                                 presence marks a complete conversion, and readers verify it
```
One Orbax checkpoint per parameter, not one for the tree, so that writing holds one parameter in
host memory at a time; reading restores each straight onto its sharding on the mesh.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from maxtrain import manifest
from maxtrain.errors import UserError

FORMAT = "maxtrain-params"
VERSION = 1
META = "meta.json"


def _item_dir(params_dir: Path, name: str) -> Path:
  return params_dir / name.replace("/", ".")


def write_param(params_dir: Path, name: str, value: np.ndarray) -> None:
  ocp.Checkpointer(ocp.StandardCheckpointHandler()).save(
      _item_dir(params_dir, name).absolute(), args=ocp.args.StandardSave({"value": value}))


def finish(params_dir: Path, meta: dict[str, Any]) -> None:
  """Writes meta.json, then the manifest (last: the conversion is complete)."""
  (params_dir / META).write_text(json.dumps({"format": FORMAT, "version": VERSION, **meta}, indent=2) + "\n")
  manifest.write(params_dir)


def find(path: Path) -> Path | None:
  """The params directory of a converted checkpoint at `path` (OUT or OUT/params), or None."""
  for candidate in (path / "params", path):
    if (candidate / META).is_file():
      return candidate
  return None


class ConvertedSource:
  """Parameters of a converted checkpoint, one at a time."""

  def __init__(self, params_dir: Path):
    self.dir = params_dir.absolute()
    if not (self.dir / manifest.MANIFEST_NAME).is_file():
      raise UserError(f"{self.dir}: an incomplete conversion (no {manifest.MANIFEST_NAME}); convert again")
    manifest.verify(self.dir)  # a corrupt file is a UserError naming it
    self.meta = json.loads((self.dir / META).read_text())
    if self.meta.get("format") != FORMAT or self.meta.get("version") != VERSION:
      raise UserError(f"{self.dir / META}: format {self.meta.get('format')} v{self.meta.get('version')}, "
                      f"this maxtrain reads {FORMAT} v{VERSION}")
    self.model = self.meta["model"]
    self.tokenizer = self.meta.get("tokenizer", "")
    if self.tokenizer and not Path(self.tokenizer).is_absolute():
      self.tokenizer = str((self.dir.parent / self.tokenizer).resolve())
    self.vocab_size = self.meta["vocab_size"]
    self.bos_id, self.eos_id = self.meta.get("bos_token_id"), self.meta.get("eos_token_id")

  def names(self) -> list[str]:
    return list(self.meta["params"])

  def info(self, name: str) -> tuple[tuple[int, ...], str]:
    p = self.meta["params"][name]
    return tuple(p["shape"]), p["dtype"]

  def read_sharded(self, name: str, target: jax.ShapeDtypeStruct) -> jax.Array:
    shape, dtype = self.info(name)
    stored = jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=target.sharding)
    value = ocp.Checkpointer(ocp.StandardCheckpointHandler()).restore(
        _item_dir(self.dir, name), args=ocp.args.StandardRestore({"value": stored}))["value"]
    return value.astype(target.dtype) if value.dtype != target.dtype else value

  def read(self, name: str) -> np.ndarray:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    shape, dtype = self.info(name)
    return np.asarray(self.read_sharded(name, jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=device)))
