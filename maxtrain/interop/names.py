"""maxtrain parameter <-> Hugging Face LLaMA tensor: names and layouts.

Shape legend: L layers, D model, N heads, K kv heads, H head dim, F ffn, V vocab.

HF stores a linear layer as weight[out, in] (y = x W^T); maxtrain as w[in..., out...] (y = x w), with
the head dims split out: q_proj [N*H, D] -> wq [D, N, H], o_proj [D, N*H] -> wo [N, H, D]. No
permutation of q/k rows: HF LLaMA checkpoints already use the rotate-half RoPE layout (dim i paired
with i + H/2) that `models/layers.apply_rope` uses. (Meta's original checkpoints interleave pairs;
transformers' own conversion script permutes them into this layout, so every HF LLaMA is in it.)
Scanned layers: maxtrain stacks the L per-layer tensors along a leading dim.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Mapping:
  hf: str  # HF name; "{}" is the layer index for per-layer tensors
  in_dims: int  # leading maxtrain dims forming HF's `in` axis (0: no transpose, e.g. norms, embedding)
  per_layer: bool = True


MAPPINGS = {
    "embed": Mapping("model.embed_tokens.weight", 0, per_layer=False),
    "final_norm/scale": Mapping("model.norm.weight", 0, per_layer=False),
    "head": Mapping("lm_head.weight", 1, per_layer=False),
    "blocks/attn_norm/scale": Mapping("model.layers.{}.input_layernorm.weight", 0),
    "blocks/attn/wq": Mapping("model.layers.{}.self_attn.q_proj.weight", 1),
    "blocks/attn/wk": Mapping("model.layers.{}.self_attn.k_proj.weight", 1),
    "blocks/attn/wv": Mapping("model.layers.{}.self_attn.v_proj.weight", 1),
    "blocks/attn/wo": Mapping("model.layers.{}.self_attn.o_proj.weight", 2),
    "blocks/mlp_norm/scale": Mapping("model.layers.{}.post_attention_layernorm.weight", 0),
    "blocks/mlp/gate": Mapping("model.layers.{}.mlp.gate_proj.weight", 1),
    "blocks/mlp/up": Mapping("model.layers.{}.mlp.up_proj.weight", 1),
    "blocks/mlp/down": Mapping("model.layers.{}.mlp.down_proj.weight", 1),
}
VOCAB_DIM = {"embed": 0, "head": 1}  # the maxtrain dim padded to model.vocab_size


def mapping(name: str) -> Mapping:
  if name not in MAPPINGS:
    raise KeyError(f"parameter {name!r} has no Hugging Face name; add it to MAPPINGS in interop/names.py")
  return MAPPINGS[name]


def hf_names(name: str, num_layers: int) -> list[str]:
  m = mapping(name)
  return [m.hf.format(i) for i in range(num_layers)] if m.per_layer else [m.hf]


def to_hf(name: str, w: np.ndarray) -> np.ndarray:
  """One layer's maxtrain tensor -> the HF tensor (vocab padding is trimmed by the caller)."""
  in_dims = mapping(name).in_dims
  if in_dims == 0:
    return w
  return np.ascontiguousarray(w.reshape(math.prod(w.shape[:in_dims]), -1).T)


def from_hf(name: str, w: np.ndarray, layer_shape: tuple[int, ...]) -> np.ndarray:
  """The HF tensor -> one layer's maxtrain tensor of `layer_shape` (before vocab padding)."""
  if mapping(name).in_dims == 0:
    return w.reshape(layer_shape)
  return np.ascontiguousarray(w.T).reshape(layer_shape)


def hf_shape(name: str, layer_shape: tuple[int, ...]) -> tuple[int, ...]:
  in_dims = mapping(name).in_dims
  if in_dims == 0:
    return tuple(layer_shape)
  return (math.prod(layer_shape[in_dims:]), math.prod(layer_shape[:in_dims]))


def pad_vocab(name: str, w: np.ndarray, vocab_size: int) -> np.ndarray:
  """Zero rows (embedding) / columns (head) up to the model's padded vocabulary."""
  dim = VOCAB_DIM.get(name)
  if dim is None or w.shape[dim] == vocab_size:
    return w
  widths = [(0, 0)] * w.ndim
  widths[dim] = (0, vocab_size - w.shape[dim])
  return np.pad(w, widths)


def trim_vocab(name: str, w: np.ndarray, vocab_size: int) -> np.ndarray:
  dim = VOCAB_DIM.get(name)
  if dim is None:
    return w
  return w[:vocab_size] if dim == 0 else w[:, :vocab_size]
