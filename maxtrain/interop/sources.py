"""Where parameters come from, behind one interface, one parameter at a time: a Hugging Face
directory (mapped on the fly), a converted checkpoint (`params_store`), or a training checkpoint (a
run's output dir, its checkpoints dir, or one step dir: the `state` item's params, the `meta` config).

A source has `model` (config.model keys), `tokenizer` ("byte", a tokenizer.json path, or ""),
`vocab_size` (rows that are real tokens), `bos_id`/`eos_id`, `names()`, `info(name)` (shape, dtype),
`read(name)` (numpy) and `read_sharded(name, target)` (a jax.Array on target's sharding).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

from maxtrain.errors import UserError
from maxtrain.interop import hf_config, names as names_lib, params_store, safetensors_io
from maxtrain.models.llama import Llama, ModelConfig
from maxtrain.sharding.layout import param_name

ST_DTYPES = {v: k for k, v in safetensors_io.DTYPES.items()}
IGNORED_HF = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved; recomputed, never read


def param_shapes(model: dict[str, Any], dtype: str = "float32") -> dict[str, tuple[int, ...]]:
  """Every parameter's shape for these config.model keys (no array allocated)."""
  fields = {k: v for k, v in model.items() if k not in ("param_dtype", "compute_dtype")}
  cfg = ModelConfig.from_config({**fields, "param_dtype": dtype})
  _, state = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(params=0))))
  return {param_name(p): tuple(leaf.shape) for p, leaf in jax.tree_util.tree_leaves_with_path(state)}


def host_to_sharded(value: np.ndarray, target: jax.ShapeDtypeStruct) -> jax.Array:
  value = value.astype(target.dtype, copy=False)
  return jax.make_array_from_callback(target.shape, target.sharding, lambda index: value[index])


class HFSource:
  """A `LlamaForCausalLM` directory, read and mapped to maxtrain's layout one parameter at a time."""

  def __init__(self, hf_dir: Path, vocab_multiple: int = 128):
    self.dir = Path(hf_dir)
    self.hf = hf_config.read(self.dir)
    self.model = hf_config.to_model_keys(self.hf, str(self.dir / "config.json"), vocab_multiple)
    self.reader = safetensors_io.Reader(self.dir)
    self.vocab_size = self.hf["vocab_size"]
    self.bos_id, self.eos_id = self.hf.get("bos_token_id"), self.hf.get("eos_token_id")
    self.tokenizer = str(self.dir / "tokenizer.json") if (self.dir / "tokenizer.json").is_file() else ""
    self.shapes = param_shapes(self.model)
    expected = {h for n in self.shapes for h in names_lib.hf_names(n, self.model["num_layers"])}
    extra = [n for n in self.reader.names() if n not in expected and not n.endswith(IGNORED_HF)
             and not (n == "lm_head.weight" and self.model["tie_embeddings"])]
    if extra:
      raise UserError(f"{self.dir}: tensor {extra[0]} ({len(extra)} unexpected in all) has no place in a "
                      "LLaMA without biases; only LlamaForCausalLM weights are supported")

  def names(self) -> list[str]:
    return list(self.shapes)

  def info(self, name: str) -> tuple[tuple[int, ...], str]:
    from safetensors import safe_open

    first = names_lib.hf_names(name, self.model["num_layers"])[0]
    with safe_open(self.reader.files[first], framework="np") as f:
      return self.shapes[name], ST_DTYPES.get(f.get_slice(first).get_dtype(), "float32")

  def _layer(self, name: str, hf_name: str, layer_shape: tuple[int, ...]) -> np.ndarray:
    w = self.reader.read(hf_name)
    expected = names_lib.hf_shape(name, layer_shape)
    if tuple(w.shape) != expected:
      raise UserError(f"{self.dir}: tensor {hf_name} has shape {list(w.shape)}, config.json implies "
                      f"{list(expected)}")
    return names_lib.from_hf(name, w, layer_shape)

  def read(self, name: str) -> np.ndarray:
    shape, dtype = self.info(name)
    m, hf_names = names_lib.mapping(name), names_lib.hf_names(name, self.model["num_layers"])
    if not m.per_layer:
      dim = names_lib.VOCAB_DIM.get(name)
      unpadded = tuple(self.vocab_size if i == dim else n for i, n in enumerate(shape))
      w = self._layer(name, hf_names[0], unpadded)
      return w if dim is None else names_lib.pad_vocab(name, w, shape[dim])
    out = np.empty(shape, dtype)
    for i, hf_name in enumerate(hf_names):
      out[i] = self._layer(name, hf_name, shape[1:])
    return out

  def read_sharded(self, name: str, target: jax.ShapeDtypeStruct) -> jax.Array:
    return host_to_sharded(self.read(name), target)


class TrainingSource:
  """The parameters of a maxtrain training checkpoint (one step directory)."""

  def __init__(self, step_dir: Path):
    import orbax.checkpoint as ocp

    self.dir = step_dir.absolute()
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    meta = checkpointer.restore(self.dir, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    self.config = meta["config"]
    self.model = self.config["model"]
    self.tokenizer = ml_collections.ConfigDict(self.config).data.tokenizer
    self.vocab_size = self.model["vocab_size"]
    from maxtrain.data.tokenizer import load_tokenizer

    tok = load_tokenizer(self.tokenizer) if self.tokenizer == "byte" or Path(self.tokenizer).exists() else None
    self.bos_id, self.eos_id = (tok.bos_id, tok.eos_id) if tok else (None, None)
    tree = ocp.StandardCheckpointHandler().metadata(self.dir / "state").tree["params"]
    self._paths: dict[str, tuple] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
      self._paths["/".join(k for k in keys if k != "value")] = (keys, tuple(leaf.shape), str(leaf.dtype))

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
    device = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    shape, dtype = self.info(name)
    return np.asarray(self.read_sharded(name, jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=device)))


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
