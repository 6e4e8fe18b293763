"""The converted-parameters format: what `convert from-hf` writes and `init_from` / `to-hf` / `generate` read.

```
OUT/
  config.py        a maxtrain config preset for this model (shape, RoPE, eps, tokenizer, init_from)
  tokenizer.json   the model's tokenizer, when it had one (named by config.py's data.tokenizer)
  params/
    meta.json      format, config.model keys, every parameter's shape and dtype, the HF ids and vocab
    embed/ blocks.attn.wq/ ...   one TensorStore zarr3 array per parameter (layers stacked, as in
                                 training), uncompressed, chunked in the blocks `names.Piece` moves
    maxtrain_manifest.json       written last: sizes and checksums (maxtrain/checkpoint/manifest.py); its
                                 presence marks a complete conversion, and readers verify it
```
TensorStore is the storage layer under Orbax; it is used directly because Orbax 0.12 saves and
restores whole arrays, while conversion must hold one block: `from-hf` writes each HF tensor's row
blocks into their box of the stacked array, `to-hf` reads one block back, and `read_sharded` reads
exactly the shard each local device holds (on every process), so no host holds the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from maxtrain.checkpoint import manifest
from maxtrain.errors import UserError

FORMAT = "maxtrain-params"
VERSION = 2  # 1: one Orbax checkpoint per parameter (whole arrays)
META = "meta.json"


def _item_dir(params_dir: Path, name: str) -> Path:
  return params_dir.absolute() / name.replace("/", ".")


def _open(params_dir: Path, name: str, metadata: dict | None = None, **kwargs) -> ts.TensorStore:
  spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(_item_dir(params_dir, name))}}
  return ts.open({**spec, "metadata": metadata} if metadata else spec, **kwargs).result()


def create(params_dir: Path, name: str, shape: tuple[int, ...], dtype: str,
           chunk_shape: tuple[int, ...]) -> ts.TensorStore:
  """An empty (zero-filled) array for one parameter, to be written block by block."""
  metadata = {"shape": list(shape), "data_type": str(np.dtype(dtype)), "fill_value": 0,
              "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
              "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}]}
  return _open(params_dir, name, create=True, metadata=metadata)


def write_block(store: ts.TensorStore, index: tuple, value: np.ndarray) -> None:
  store[index].write(value).result()


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
                      f"this maxtrain reads {FORMAT} v{VERSION}: convert the Hugging Face model again (from-hf)")
    self.model = self.meta["model"]
    self.tokenizer = self.meta.get("tokenizer", "")
    if self.tokenizer and not Path(self.tokenizer).is_absolute():
      self.tokenizer = str((self.dir.parent / self.tokenizer).resolve())
    self.vocab_size = self.meta["vocab_size"]
    self.bos_id, self.eos_id = self.meta.get("bos_token_id"), self.meta.get("eos_token_id")
    self._store: tuple[str, ts.TensorStore] | None = None  # the last parameter read

  def names(self) -> list[str]:
    return list(self.meta["params"])

  def info(self, name: str) -> tuple[tuple[int, ...], str]:
    p = self.meta["params"][name]
    return tuple(p["shape"]), p["dtype"]

  def read_slice(self, name: str, index: tuple) -> np.ndarray:
    """`value[index]` of one parameter, reading only the chunks that box touches."""
    if self._store is None or self._store[0] != name:
      self._store = (name, _open(self.dir, name, open=True))
    return np.asarray(self._store[1][index].read().result())

  def read(self, name: str) -> np.ndarray:
    return self.read_slice(name, ())

  def read_sharded(self, name: str, target: jax.ShapeDtypeStruct) -> jax.Array:
    """The parameter on `target`'s sharding; each process reads the shards of its own devices."""
    store = _open(self.dir, name, open=True)
    if tuple(store.shape) != tuple(target.shape):
      raise UserError(f"{_item_dir(self.dir, name)}: shape {list(store.shape)}, the model needs {list(target.shape)}")

    def shard(index: tuple) -> np.ndarray:
      return np.asarray(store[index].read().result()).astype(target.dtype, copy=False)

    return jax.make_array_from_callback(target.shape, target.sharding, shard)
