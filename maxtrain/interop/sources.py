"""Where parameters come from, behind one interface, a parameter (or a box of it) at a time: a Hugging Face
directory (mapped on the fly), a converted checkpoint (`params_store`), or a training checkpoint (a
run's output dir, its checkpoints dir, or one step dir: the `state` item's params, the `meta` config).

A source has `model` (config.model keys), `tokenizer` ("byte", a tokenizer.json path, or ""),
`vocab_size` (rows that are real tokens), `bos_id`/`eos_id`, `names()`, `info(name)` (shape, dtype),
`read(name)` (numpy) and `read_sharded(name, target)` (a jax.Array on target's sharding); the two
checkpoint kinds also `read_slice(name, index)`, which reads only that box (what `to-hf` streams).
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np

from maxtrain import config as config_lib
from maxtrain.errors import UserError
from maxtrain.interop import dequant, hf_config, names as names_lib, params_store
from maxtrain.models import hf_adapter, registry
from maxtrain.sharding.layout import param_name
from maxtrain.checkpoint import manifest
from maxtrain.data.tokenizer import load_tokenizer

IGNORED_HF = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved; recomputed, never read
log = logging.getLogger("maxtrain")


def _layer_index(hf_name: str) -> int | None:
  """'model.layers.61.eh_proj.weight' -> 61; None for a name outside the layers."""
  match = re.match(r"model\.layers\.(\d+)\.", hf_name)
  return int(match.group(1)) if match else None


def param_shapes(model: dict[str, Any], dtype: str = "float32") -> dict[str, tuple[int, ...]]:
  """Every parameter's shape for these config.model keys (no array allocated)."""
  fields = {k: v for k, v in model.items() if k not in ("param_dtype", "compute_dtype")}
  _, state = registry.abstract(registry.model_config({**fields, "param_dtype": dtype}))
  return {param_name(p): tuple(leaf.shape) for p, leaf in jax.tree_util.tree_leaves_with_path(state)}


class HFSource:
  """A Hugging Face directory of a registered family (by `architectures` in config.json: docs/models.md), mapped to maxtrain's layout one HF tensor (or a block of it) at a time."""

  def __init__(self, hf_dir: Path, vocab_multiple: int = 128):
    self.dir = Path(hf_dir)
    self.hf = hf_config.read(self.dir)
    self.model = hf_config.to_model_keys(self.hf, str(self.dir / "config.json"), vocab_multiple)
    # a quantized checkpoint (FP8 block scales, MXFP4 experts) read as the tensors it encodes
    self.reader = dequant.open_reader(self.dir, self.hf, str(self.dir / "config.json"))
    self.vocab_size = self.hf["vocab_size"]
    self.bos_id, self.eos_id = self.hf.get("bos_token_id"), self.hf.get("eos_token_id")
    self.tokenizer = str(self.dir / "tokenizer.json") if (self.dir / "tokenizer.json").is_file() else ""
    self._layout()
    layers = self.model["num_layers"]
    if self.model.get("mtp_layers") and f"model.layers.{layers}.eh_proj.weight" not in self.reader.names():
      # transformers' save_pretrained writes no MTP layer even when config.json counts one
      log.warning("%s: config.json has %d multi-token-prediction layer(s) but no model.layers.%d.* tensors: "
                  "imported without them (model.mtp_layers=0)", self.dir, self.model["mtp_layers"], layers)
      self.model["mtp_layers"] = 0
      self._layout()
    expected = {p.hf_name for n in self.shapes for p in names_lib.pieces(n, self.shapes[n], self.vocab_size, self.tensors)}
    extra = [n for n in self.reader.names() if n not in expected and not n.endswith(IGNORED_HF)
             and not (n == "lm_head.weight" and self.model["tie_embeddings"])]
    # Layers past num_hidden_layers: multi-token-prediction layers (DeepSeek-V3's model.layers.61). Read when
    # model.mtp_layers counts them (their copies of the shared embedding and head excepted), else left out: said so.
    beyond = [n for n in extra if _layer_index(n) is not None and _layer_index(n) >= layers]
    if beyond:
      kept = self.model.get("mtp_layers", 0)
      mtp = [n for n in beyond if _layer_index(n) < layers + kept]
      unplaced = [n for n in mtp if not n.endswith(hf_adapter.MTP_SHARED_COPIES)]
      if unplaced:
        raise UserError(f"{self.dir}: tensor {unplaced[0]} has no place in maxtrain's multi-token-prediction layer "
                        "(models/mtp.py)")
      if len(mtp) < len(beyond):
        skipped = [n for n in beyond if n not in mtp]
        log.warning("%s: %d tensor(s) of layers past num_hidden_layers=%d not read (%s ...): multi-token-prediction "
                    "layers beyond model.mtp_layers=%d", self.dir, len(skipped), layers, skipped[0], kept)
      if mtp:
        log.info("%s: %s not read: the multi-token-prediction depths share the main model's embedding and head",
                 self.dir, ", ".join(mtp))
      extra = [n for n in extra if n not in beyond]
    if extra:
      raise UserError(f"{self.dir}: tensor {extra[0]} ({len(extra)} unexpected in all) has no place in the "
                      f"maxtrain model of {self.hf.get('architectures')} that config.json describes")

  def _layout(self) -> None:
    self.shapes = param_shapes(self.model)
    self.tensors = hf_config.tensors(self.model)

  def names(self) -> list[str]:
    return list(self.shapes)

  def info(self, name: str) -> tuple[tuple[int, ...], str]:
    pieces = names_lib.pieces(name, self.shapes[name], self.vocab_size, self.tensors)
    # a parameter HF lacks (names.pieces: []) takes the dtype of the embedding
    return self.shapes[name], self.reader.info(pieces[0].hf_name if pieces else "model.embed_tokens.weight").dtype

  def pieces(self, name: str) -> list[names_lib.Piece]:
    """The parameter's HF tensors, each checked against the shape config.json implies."""
    out = names_lib.pieces(name, self.shapes[name], self.vocab_size, self.tensors)
    for piece in out:
      found = self.reader.info(piece.hf_name).shape
      if tuple(found) != piece.hf_shape:
        raise UserError(f"{self.dir}: tensor {piece.hf_name} has shape {list(found)}, config.json implies "
                        f"{list(piece.hf_shape)}")
    return out

  def read_block(self, piece: names_lib.Piece, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of the piece's row dim, in maxtrain's layout."""
    return piece.from_hf(self.reader.read_rows(piece.hf_name, *piece.hf_rows(start, stop)), start, stop)

  def read_layer(self, piece: names_lib.Piece, dtype: Any) -> np.ndarray:
    """One whole HF tensor in maxtrain's layout, the vocabulary padded with zeros."""
    out = np.zeros(piece.layer_shape, dtype)
    out[piece.index(0, piece.units)[len(piece.prefix):]] = self.read_block(piece, 0, piece.units)
    return out

  def read(self, name: str) -> np.ndarray:
    shape, dtype = self.info(name)
    pieces = self.pieces(name)
    if not pieces:
      return np.zeros(shape, dtype)
    if not pieces[0].prefix:
      return self.read_layer(pieces[0], dtype)
    out = np.empty(shape, dtype)
    for piece in pieces:
      out[piece.prefix] = self.read_layer(piece, dtype)
    return out

  def read_sharded(self, name: str, target: jax.ShapeDtypeStruct) -> jax.Array:
    """Each local device's shard, assembled one HF tensor at a time (a stacked shard layer by layer)."""
    pieces = self.pieces(name)
    by_prefix = {p.prefix: p for p in pieces}

    def shard(index: tuple) -> np.ndarray:
      if not pieces:
        return np.zeros(target.shape, target.dtype)[index]
      if not pieces[0].prefix:
        return self.read_layer(pieces[0], target.dtype)[index]
      k = len(pieces[0].prefix)  # leading dims that pick a piece: the layer, then the expert
      ranges = [range(*i.indices(n)) for i, n in zip(index, target.shape)]
      out = np.empty(tuple(len(r) for r in ranges), target.dtype)
      for at in np.ndindex(*out.shape[:k]):
        piece = by_prefix[tuple(r[j] for r, j in zip(ranges, at))]
        out[at] = self.read_layer(piece, target.dtype)[index[k:]]
      return out

    return jax.make_array_from_callback(target.shape, target.sharding, shard)


class TrainingSource:
  """The parameters of a maxtrain training checkpoint (one step directory), verified against its manifest
  before anything is read (init_from, generate, convert and the eval tools all read through here)."""

  def __init__(self, step_dir: Path):
    import orbax.checkpoint as ocp

    self.dir = step_dir.absolute()
    manifest.check(self.dir)  # CorruptCheckpoint: a UserError naming the file
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    meta = checkpointer.restore(self.dir, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    self.config = config_lib.saved_config(meta, f"checkpoint {self.dir}")  # today's keys (config/migrate.py)
    self.model = self.config["model"]
    self.tokenizer = config_lib.Config.from_dict(self.config).data.tokenizer
    self.tokenizer_identity = meta.get("tokenizer_identity")  # of the stores it trained on (saved since issue 23)
    self.vocab_size = self.model["vocab_size"]
    tok = load_tokenizer(self.tokenizer) if self.tokenizer == "byte" or Path(self.tokenizer).exists() else None
    self.bos_id, self.eos_id = (tok.bos_id, tok.eos_id) if tok else (None, None)
    tree = ocp.StandardCheckpointHandler().metadata(self.dir / "state").tree["params"]
    self._paths: dict[str, tuple] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      keys = tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
      self._paths["/".join(k for k in keys if k != "value")] = (keys, tuple(leaf.shape), str(leaf.dtype))
    self._store: tuple[str, Any] | None = None  # the last parameter read_slice opened

  def names(self) -> list[str]:
    return list(self._paths)

  def info(self, name: str) -> tuple[tuple[int, ...], str]:
    return self._paths[name][1], self._paths[name][2]

  def read_sharded(self, name: str, target: jax.ShapeDtypeStruct) -> jax.Array:
    import orbax.checkpoint as ocp

    keys, shape, dtype = self._paths[name]
    item, args = jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=target.sharding), \
        ocp.ArrayRestoreArgs(sharding=target.sharding)
    for key in reversed(("params",) + keys):
      item, args = {key: item}, {key: args}
    restored = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(self.dir, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True))).state
    value = restored["params"]
    for key in keys:
      value = value[key]
    return value.astype(target.dtype) if value.dtype != target.dtype else value

  def read(self, name: str) -> np.ndarray:
    return self.read_slice(name, ())

  def read_slice(self, name: str, index: tuple) -> np.ndarray:
    """`value[index]` read with TensorStore from Orbax's own array spec. The unit of reading is one
    saved shard (a device's block at save time), kept in a cache of that size while one parameter's
    layers are read in turn."""
    if self._store is None or self._store[0] != name:
      self._store = None  # drop the previous parameter's cache first
      self._store = (name, _open_orbax_array(self.dir / "state", ("params",) + self._paths[name][0]))
    return np.asarray(self._store[1][index].read().result())


def _open_orbax_array(item_dir: Path, keys: tuple[str, ...]) -> Any:
  import orbax.checkpoint as ocp
  import tensorstore as ts

  meta = json.loads((item_dir / "_METADATA").read_text())
  ocdbt = bool(meta.get("use_ocdbt", True))
  context = ocp.type_handlers.get_ts_context(use_ocdbt=ocdbt)
  info = ocp.type_handlers.ParamInfo(name=".".join(keys), parent_dir=item_dir, is_ocdbt_checkpoint=ocdbt,
                                     use_zarr3=bool(meta.get("use_zarr3", False)), ts_context=context)
  spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=ocdbt)
  store = ts.open(spec, open=True, context=context).result()
  # The cache holds the one saved shard (zarr chunk) the next layers' reads will hit again.
  shard_shape = meta["tree_metadata"].get(str(keys), {}).get("value_metadata", {}).get("write_shape") or store.shape
  spec["cache_pool"] = {"total_bytes_limit": math.prod(shard_shape) * store.dtype.numpy_dtype.itemsize + (1 << 20)}
  return ts.open(spec, open=True, context=context).result()


def _newest_step(directory: Path) -> Path | None:
  steps = sorted((int(p.name), p) for p in directory.iterdir() if p.name.isdigit() and (p / "state").is_dir())
  return steps[-1][1] if steps else None


def open_source(path: str | Path, vocab_multiple: int = 128) -> Any:
  """The parameter source at `path`; UserError if it is none of the kinds."""
  path = Path(path)
  if not path.is_dir():
    raise UserError(f"{path}: no such directory (expected a Hugging Face model dir, a converted checkpoint, a "
                    "run's output dir or a checkpoint step dir)")
  converted = params_store.find(path)
  if converted is not None:
    return params_store.ConvertedSource(converted)
  if (path / "state").is_dir():
    return TrainingSource(path)
  for directory in (path / "checkpoints", path):
    step = _newest_step(directory) if directory.is_dir() else None
    if step is not None:
      return TrainingSource(step)
  if (path / "config.json").is_file() and "model_type" in json.loads((path / "config.json").read_text()):
    return HFSource(path, vocab_multiple)
  raise UserError(f"{path}: not a Hugging Face model dir (config.json + safetensors), a converted checkpoint "
                  "(params/meta.json), a run's output dir nor a checkpoint step dir")
