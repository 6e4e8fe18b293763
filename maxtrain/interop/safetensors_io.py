"""Sharded `safetensors` directories, one tensor at a time.

Reading goes through `safetensors.safe_open` (numpy), opening the file per tensor so that no more than
that tensor's pages stay mapped. Writing streams: the shards are planned from shapes and dtypes alone,
each file's header is written first and then its tensors one by one, so the writer holds one tensor,
never a whole shard. Format (the safetensors spec): an 8-byte little-endian header length, a JSON
header {name: {dtype, shape, data_offsets}}, padded with spaces to a multiple of 8, then the bytes.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Callable, Iterable

import ml_dtypes  # noqa: F401 - numpy learns bfloat16 from it; safetensors needs that to read BF16
import numpy as np

from maxtrain.errors import UserError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  name: str
  shape: tuple[int, ...]
  dtype: str  # numpy name: float32 | bfloat16 | float16

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


class Reader:
  """The tensors of a Hugging Face directory (`model.safetensors` or an index of shards)."""

  def __init__(self, directory: Path):
    self.directory = Path(directory)
    index = self.directory / INDEX
    if index.is_file():
      self.files = {k: self.directory / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    elif (self.directory / SINGLE).is_file():
      from safetensors import safe_open

      with safe_open(self.directory / SINGLE, framework="np") as f:
        self.files = {k: self.directory / SINGLE for k in f.keys()}
    else:
      raise UserError(f"{self.directory}: no {SINGLE} nor {INDEX} (only safetensors weights are read; convert "
                      "*.bin checkpoints with transformers' save_pretrained(safe_serialization=True) first)")

  def names(self) -> list[str]:
    return sorted(self.files)

  def read(self, name: str) -> np.ndarray:
    from safetensors import safe_open

    if name not in self.files:
      raise UserError(f"{self.directory}: tensor {name!r} is missing from the checkpoint")
    with safe_open(self.files[name], framework="np") as f:
      return f.get_tensor(name)


def plan(tensors: Iterable[TensorInfo], max_bytes: int) -> list[list[TensorInfo]]:
  """Tensors in order, cut into files of at most `max_bytes` each (a larger tensor gets a file alone)."""
  files, current, size = [], [], 0
  for t in tensors:
    if current and size + t.nbytes > max_bytes:
      files.append(current)
      current, size = [], 0
    current.append(t)
    size += t.nbytes
  return files + ([current] if current else [])


def _header(tensors: list[TensorInfo]) -> bytes:
  entries, offset = {"__metadata__": {"format": "pt"}}, 0
  for t in tensors:
    entries[t.name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
    offset += t.nbytes
  raw = json.dumps(entries, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)
  return struct.pack("<Q", len(raw)) + raw


def write(directory: Path, files: list[list[TensorInfo]], get: Callable[[TensorInfo], np.ndarray]) -> list[Path]:
  """Writes the planned files (`get` returns each tensor's values, called once per tensor, in order)
  and the index when there is more than one file; returns the files written."""
  directory.mkdir(parents=True, exist_ok=True)
  names = [SINGLE] if len(files) == 1 else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                                           for i in range(len(files))]
  weight_map = {}
  for name, tensors in zip(names, files):
    with open(directory / name, "wb") as f:
      f.write(_header(tensors))
      for t in tensors:
        value = np.ascontiguousarray(get(t))
        assert value.shape == t.shape and value.dtype == np.dtype(t.dtype), (t, value.shape, value.dtype)
        f.write(memoryview(value.reshape(-1).view(np.uint8)))
        weight_map[t.name] = name
  if len(files) > 1:
    total = sum(t.nbytes for tensors in files for t in tensors)
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                              indent=2) + "\n")
  return [directory / n for n in names]
