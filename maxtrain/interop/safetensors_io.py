"""Sharded `safetensors` directories, streamed in row blocks.

Reading parses each file's header once and reads a tensor's rows [a, b) with plain file reads (a
safetensors tensor is row-major bytes at an offset), so a reader holds one block, never a whole
tensor or a mapped file. Writing streams too: the shards are planned from shapes and dtypes alone,
each file's header is written first and then each tensor's row blocks in order. Format (the
safetensors spec): an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}}, padded with spaces to a multiple of 8, then the bytes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path
from typing import Callable, Iterable

import ml_dtypes  # registers bfloat16 with numpy (np.dtype('bfloat16')); float8 dtypes
import numpy as np

from maxtrain.errors import UserError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
ST_DTYPES = {v: k for k, v in DTYPES.items()}
# Stored dtypes read only as the raw halves of a quantized pair (interop/dequant.py), never as a parameter.
RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "U8": np.uint8}
MAX_HEADER_BYTES = 100 * 2**20


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
      files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (self.directory / SINGLE).is_file():
      files = [SINGLE]
    else:
      raise UserError(f"{self.directory}: no {SINGLE} nor {INDEX} (only safetensors weights are read; convert "
                      "*.bin checkpoints with transformers' save_pretrained(safe_serialization=True) first)")
    self.entries: dict[str, tuple[Path, TensorInfo, int]] = {}  # name -> (file, info, data offset)
    for f in files:
      for info, offset in _read_header(self.directory / f):
        self.entries[info.name] = (self.directory / f, info, offset)

  def names(self) -> list[str]:
    return sorted(self.entries)

  def info(self, name: str) -> TensorInfo:
    if name not in self.entries:
      raise UserError(f"{self.directory}: tensor {name!r} is missing from the checkpoint")
    info = self.entries[name][1]
    if info.dtype not in DTYPES:
      raise UserError(f"{self.entries[name][0]}: tensor {name} has dtype {info.dtype} (supported: "
                      f"{', '.join(ST_DTYPES)})")
    return info

  def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of the tensor (its first dim), read straight from the file."""
    info = self.info(name)
    row_shape = info.shape[1:]
    return self._read(name, start * math.prod(row_shape), (stop - start, *row_shape))

  def read_raw_rows(self, name: str, start: int, stop: int) -> np.ndarray:
    """Rows of a tensor in its stored dtype, the quantized ones (RAW_DTYPES) included."""
    info = self.entries[name][1]
    dtype = RAW_DTYPES[info.dtype] if info.dtype in RAW_DTYPES else self.info(name).dtype
    return self._read(name, start * math.prod(info.shape[1:]), (stop - start, *info.shape[1:]), dtype)

  def read(self, name: str) -> np.ndarray:
    return self._read(name, 0, self.info(name).shape)

  def _read(self, name: str, first: int, shape: tuple[int, ...], dtype: object = None) -> np.ndarray:
    """`shape`'s worth of elements from element `first` on."""
    path, _, offset = self.entries[name]
    out = np.empty(shape, dtype or self.info(name).dtype)
    with open(path, "rb") as f:
      f.seek(offset + first * out.itemsize)
      if f.readinto(memoryview(out.reshape(-1).view(np.uint8))) != out.nbytes:
        raise UserError(f"{path}: truncated (tensor {name} ends past the end of the file)")
    return out


def _read_header(path: Path) -> list[tuple[TensorInfo, int]]:
  """(tensor, absolute byte offset of its data) for every tensor in a safetensors file."""
  try:
    with open(path, "rb") as f:
      (length,) = struct.unpack("<Q", f.read(8))
      size = path.stat().st_size
      # Checked before reading: f.read(2**63) would try to allocate it (safetensors caps headers at 100 MB).
      if not 0 < length <= min(size - 8, MAX_HEADER_BYTES):
        raise UserError(f"{path}: not a safetensors file: its header length field says {length:,} bytes, but the "
                        f"file has {size:,} bytes (and a header is at most {MAX_HEADER_BYTES:,}). Re-download it.")
      header = json.loads(f.read(length))
  except (OSError, struct.error, ValueError) as e:
    raise UserError(f"{path}: not a readable safetensors file ({e})") from None
  try:
    return [(TensorInfo(name, tuple(int(n) for n in entry["shape"]), ST_DTYPES.get(entry["dtype"], entry["dtype"])),
             8 + length + int(entry["data_offsets"][0]))  # an unsupported dtype fails when it is read
            for name, entry in header.items() if name != "__metadata__"]
  except (AttributeError, KeyError, IndexError, TypeError, ValueError) as e:
    raise UserError(f"{path}: malformed safetensors header ({type(e).__name__}: {e}): each tensor needs dtype, "
                    "shape and data_offsets") from None


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


def file_names(count: int) -> list[str]:
  return [SINGLE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_file(path: Path, tensors: list[TensorInfo], blocks: Callable[[TensorInfo], Iterable[np.ndarray]]) -> None:
  """One planned file: its header, then each tensor's row blocks (`blocks(t)`, in order, which
  together are exactly the tensor), so the writer holds one block at a time."""
  with open(path, "wb") as f:
    f.write(_header(tensors))
    for t in tensors:
      written = 0
      for block in blocks(t):
        block = np.ascontiguousarray(block)
        assert block.shape[1:] == t.shape[1:] and block.dtype == np.dtype(t.dtype), (t, block.shape, block.dtype)
        f.write(memoryview(block.reshape(-1).view(np.uint8)))
        written += block.nbytes
      assert written == t.nbytes, (t, written)


def write_index(directory: Path, files: list[list[TensorInfo]]) -> None:
  """The index naming each tensor's file (only when there is more than one file)."""
  if len(files) > 1:
    names = file_names(len(files))
    weight_map = {t.name: names[i] for i, tensors in enumerate(files) for t in tensors}
    total = sum(t.nbytes for tensors in files for t in tensors)
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                              indent=2) + "\n")
