"""maxtrain parameter <-> Hugging Face tensor: names and layouts (the names are the family's adapter's,
`models/hf_adapter.py`; every function takes them as `tensors`, LLaMA-like names by default).

Shape legend: L layers, D model, N heads, K kv heads, H head dim, F ffn, V vocab.

HF stores a linear layer as weight[out, in] (y = x W^T); maxtrain as w[in..., out...] (y = x w), with
the head dims split out: q_proj [N*H, D] -> wq [D, N, H], o_proj [D, N*H] -> wo [N, H, D]. No
permutation of q/k rows: HF LLaMA checkpoints already use the rotate-half RoPE layout (dim i paired
with i + H/2) that `models/layers.apply_rope` uses. (Meta's original checkpoints interleave pairs;
transformers' own conversion script permutes them into this layout, so every HF LLaMA is in it.)
Scanned layers (`model.scan_layers=True`) stack the L per-layer tensors along a leading dim
('blocks/attn/wq' [L, D, N, H]); unscanned ones are parameters of their own ('blocks/3/attn/wq').

Streaming: a `Piece` is one HF tensor's place in a maxtrain parameter. It moves in blocks along its
"row dim" (the first maxtrain dim of HF's `out` axis, or dim 0 when there is no transpose), so that
a block is a contiguous run of HF rows and a box in the maxtrain array: both directions convert a
tensor one block at a time. Vocabulary padding is the part of the row dim past `units`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from maxtrain.models.hf_adapter import TENSORS as MAPPINGS, Mapping
VOCAB_DIM = {"embed": 0, "head": 1}  # the maxtrain dim padded to model.vocab_size
BLOCK_BYTES = 8 << 20  # default block, counted at 4 bytes per element (a bf16 block holds 4 MiB)


def mapping(name: str, tensors: dict[str, Mapping] = MAPPINGS) -> Mapping:
  if name not in tensors:
    raise KeyError(f"parameter {name!r} has no Hugging Face name; add it to its family's adapter "
                   "(models/hf_adapter.py TENSORS or the family's own)")
  return tensors[name]


def split_layer(name: str) -> tuple[str, int | None]:
  """'blocks/3/attn/wq' (model.scan_layers=False) -> ('blocks/attn/wq', 3), an MTP depth's 'mtp/0/eh_proj' ->
  ('mtp/eh_proj', 0); other names -> (name, None)."""
  parts = name.split("/")
  if len(parts) > 2 and parts[0] in ("blocks", "moe_blocks", "mtp") and parts[1].isdigit():
    return "/".join([parts[0], *parts[2:]]), int(parts[1])
  return name, None


def to_hf(m: Mapping, w: np.ndarray) -> np.ndarray:
  """One layer's maxtrain tensor (or a block of it) -> the HF tensor (or those rows of it)."""
  in_dims = m.in_dims
  if in_dims == 0:
    return w.reshape(-1) if m.flat else w
  return np.ascontiguousarray(w.reshape(math.prod(w.shape[:in_dims]), -1).T)


def from_hf(m: Mapping, w: np.ndarray, layer_shape: tuple[int, ...]) -> np.ndarray:
  """The HF tensor (or some rows of it) -> one layer's maxtrain tensor (or that block) of `layer_shape`."""
  if m.in_dims == 0:
    return w.reshape(layer_shape)
  return np.ascontiguousarray(w.T).reshape(layer_shape)


def hf_shape(m: Mapping, layer_shape: tuple[int, ...]) -> tuple[int, ...]:
  in_dims = m.in_dims
  if in_dims == 0:
    return (math.prod(layer_shape),) if m.flat else tuple(layer_shape)
  return (math.prod(layer_shape[in_dims:]), math.prod(layer_shape[:in_dims]))


@dataclasses.dataclass(frozen=True)
class Piece:
  """One HF tensor inside a maxtrain parameter."""
  param: str  # the maxtrain parameter: 'blocks/attn/wq' (stacked) or 'blocks/3/attn/wq'
  base: str  # its key in the family's tensor names
  prefix: tuple[int, ...]  # the layer's index into the parameter: (i,) when stacked, else (); then the expert's
  layer_shape: tuple[int, ...]  # one layer's maxtrain shape (vocabulary padded)
  hf_name: str
  units: int  # length of the row dim that HF holds (the unpadded vocabulary for embed and head)
  m: Mapping

  @property
  def row_dim(self) -> int:
    return self.m.in_dims

  def block_shape(self, start: int, stop: int) -> tuple[int, ...]:
    k = self.row_dim
    return (*self.layer_shape[:k], stop - start, *self.layer_shape[k + 1:])

  @property
  def hf_shape(self) -> tuple[int, ...]:
    return hf_shape(self.m, self.block_shape(0, self.units))

  def blocks(self, block_bytes: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of the row dim, each about `block_bytes` (at least one unit)."""
    step = block_units(self.layer_shape, self.row_dim, block_bytes)
    return [(a, min(a + step, self.units)) for a in range(0, self.units, step)]

  def index(self, start: int, stop: int) -> tuple[int | slice, ...]:
    """The block's place in the maxtrain parameter."""
    return (*self.prefix, *(slice(None),) * self.row_dim, slice(start, stop))

  def hf_rows(self, start: int, stop: int) -> tuple[int, int]:
    # a flat tensor's rows are its elements; otherwise one unit of the row dim is one HF row per trailing element
    rows_per_unit = math.prod(self.layer_shape[self.row_dim + 1:]) if self.row_dim or self.m.flat else 1
    return start * rows_per_unit, stop * rows_per_unit

  def to_hf(self, block: np.ndarray) -> np.ndarray:
    return to_hf(self.m, block)

  def from_hf(self, rows: np.ndarray, start: int, stop: int) -> np.ndarray:
    return from_hf(self.m, rows, self.block_shape(start, stop))


def block_units(layer_shape: tuple[int, ...], row_dim: int, block_bytes: int) -> int:
  """How many units of the row dim make a block of about `block_bytes` (at 4 bytes per element)."""
  unit_bytes = math.prod(layer_shape) // layer_shape[row_dim] * 4
  return max(1, block_bytes // unit_bytes)


def pieces(param: str, shape: tuple[int, ...], vocab_size: int, tensors: dict[str, Mapping] = MAPPINGS) -> list[Piece]:
  """The HF tensors of a maxtrain parameter of this shape, in layer (then expert) order; [] for one HF lacks."""
  base, layer = split_layer(param)
  m = mapping(base, tensors)
  if m.absent:
    return []
  stacked = m.per_layer and layer is None
  layer_shape = tuple(shape[1:] if stacked else shape)
  if m.experts:  # one HF tensor per (layer, expert): the expert dim joins the prefix
    experts, layer_shape = layer_shape[0], layer_shape[1:]
    units = layer_shape[m.in_dims]
    layers = [((i,), i) for i in range(shape[0])] if stacked else [((), layer)]
    return [Piece(param, base, (*prefix, e), layer_shape, m.hf.format(i + m.layer_offset, e), units, m)
            for prefix, i in layers for e in range(experts)]
  units = vocab_size if base in VOCAB_DIM else layer_shape[m.in_dims]
  if base in VOCAB_DIM:
    assert VOCAB_DIM[base] == m.in_dims, base  # the vocabulary is the row dim (padding = its tail)
  if stacked:
    return [Piece(param, base, (i,), layer_shape, m.hf.format(i + m.layer_offset), units, m) for i in range(shape[0])]
  return [Piece(param, base, (), layer_shape, m.hf.format(layer + m.layer_offset) if m.per_layer else m.hf, units, m)]
