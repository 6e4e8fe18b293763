"""Quantized Hugging Face checkpoints read as the full-precision tensors they stand for (`convert from-hf`).

Two formats, the ones the published MoE checkpoints use, selected by config.json's `quantization_config`:
- `fp8` (DeepSeek-V3): `X.weight` in float8 E4M3 with `X.weight_scale_inv` [ceil(out / bo), ceil(in / bi)]
  float32, one multiplier per (bo, bi) = `weight_block_size` block: w = q * scale_inv. A last partial block
  takes its block's scale (DeepSeek's reference `weight_dequant`, transformers' `_dequantize_fp8_weight`:
  DeepSeek-V3's kv_a_proj_with_mqa has 576 = 4.5 x 128 rows).
- `mxfp4` (GPT-OSS experts): `X_blocks` uint8 [E, R, G, 16] (two E2M1 values a byte, the low nibble first) and
  `X_scales` uint8 [E, R, G] (E8M0: 2^(s - 127) for each group of 32), read as `X` [E, G * 32, R] (transposed:
  transformers' `convert_moe_packed_tensors`).

A `DequantReader` wraps `safetensors_io.Reader` and answers the same calls (`names`, `info`, `read_rows`) with
the dequantised tensors in place of the quantized pairs, a row block at a time (one expert of an MXFP4 tensor,
a few rows of an FP8 one): the float32 product cast to the checkpoint's float dtype (its embedding's), what
transformers' own dequantisation (`dequantize=True`) gives. What cannot be read is a UserError (exit 2)
naming the field or the tensor: another quant_method or fmt, static activation scales, a block size that is
not two positive integers, a scale grid that does not tile the weight with it, a weight without its scales.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from maxtrain.errors import UserError
from maxtrain.interop.safetensors_io import Reader, TensorInfo

METHODS = ("fp8", "mxfp4")
FP8_SCALE = ".weight_scale_inv"
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)  # E2M1, by nibble (OCP MX spec)
E8M0_BIAS = 127


def _refuse(where: str, field: str, value: Any, why: str) -> UserError:
  return UserError(f"{where}: quantization_config.{field}={json.dumps(value)}: {why}")


def block_size(spec: dict, where: str) -> tuple[int, int]:
  """FP8's (rows, cols) block; transformers' default (128, 128) when absent."""
  if spec.get("fmt", "e4m3") != "e4m3":
    raise _refuse(where, "fmt", spec["fmt"], "only e4m3 FP8 weights are read")
  if spec.get("activation_scheme", "dynamic") != "dynamic":
    raise _refuse(where, "activation_scheme", spec["activation_scheme"], "only dynamic activation scaling is read "
                  "(static activation scales have no place in a dequantised model)")
  size = spec.get("weight_block_size", [128, 128])
  if not (isinstance(size, list) and len(size) == 2 and all(type(n) is int and n > 0 for n in size)):
    raise _refuse(where, "weight_block_size", size, "must be two positive integers [rows, cols] (DeepSeek-V3: "
                  "[128, 128]); per-tensor FP8 scales are not read")
  return size[0], size[1]


def open_reader(directory: Path, hf: dict, where: str) -> Reader | "DequantReader":
  """The tensors of `directory`: its Reader for an unquantized checkpoint, else the dequantising view of it.
  UserError naming what cannot be read, config.json's fields before any tensor file is opened."""
  spec = hf.get("quantization_config")
  if not spec:
    return Reader(directory)
  if not isinstance(spec, dict) or spec.get("quant_method") not in METHODS:
    method = spec.get("quant_method") if isinstance(spec, dict) else spec
    raise _refuse(where, "quant_method", method, f"not read (supported: {', '.join(METHODS)}: DeepSeek-V3's FP8 "
                  "block scales, GPT-OSS's MXFP4 experts); dequantise with transformers, save_pretrained, convert that")
  block = block_size(spec, where) if spec["quant_method"] == "fp8" else (1, 32)
  return DequantReader(Reader(directory), spec["quant_method"], block, where)


class DequantReader:
  """The tensors of `reader` with each quantized pair read as the one tensor it encodes."""

  def __init__(self, reader: Reader, method: str, block: tuple[int, int], where: str):
    self.reader, self.method, self.block, self.directory = reader, method, block, reader.directory
    raw = {n: reader.entries[n][1] for n in reader.names()}
    self.dtype = reader.info("model.embed_tokens.weight").dtype  # what transformers dequantises to
    self.virtual: dict[str, tuple[TensorInfo, str, str]] = {}  # name -> (its info, data tensor, scale tensor)
    if self.method == "fp8":
      for name, info in raw.items():
        if name.endswith(FP8_SCALE):
          weight = name[:-len(FP8_SCALE)] + ".weight"
          if weight not in raw:
            raise UserError(f"{self.directory}: tensor {name} scales a weight {weight} the checkpoint lacks")
          self._fp8(raw[weight], info)
        elif info.dtype == "F8_E4M3" and name + "_scale_inv" not in raw:
          raise UserError(f"{self.directory}: tensor {name} is FP8 without its scales {name}_scale_inv "
                          "(quantization_config.quant_method=fp8)")
    else:
      for name, info in raw.items():
        if name.endswith("_blocks"):
          self._mxfp4(info, raw.get(name[:-len("_blocks")] + "_scales"))
        elif name.endswith("_scales") and name[:-len("_scales")] + "_blocks" not in raw:
          raise UserError(f"{self.directory}: tensor {name} has no {name[:-len('_scales')]}_blocks to scale")
    if not self.virtual:
      raise _refuse(where, "quant_method", self.method, "no quantized tensor in the checkpoint (FP8: *.weight_scale_inv; "
                    "MXFP4: *_blocks and *_scales): drop quantization_config or re-download the weights")
    hidden = {n for _, data, scale in self.virtual.values() for n in (data, scale)}
    self._names = sorted((set(raw) - hidden) | set(self.virtual))

  def _fp8(self, weight: TensorInfo, scale: TensorInfo) -> None:
    bo, bi = self.block
    if weight.dtype != "F8_E4M3" or len(weight.shape) != 2:
      raise UserError(f"{self.directory}: tensor {weight.name} is {weight.dtype} {list(weight.shape)}: a weight "
                      f"with {scale.name} must be a 2-D float8 E4M3 (F8_E4M3) matrix")
    want = (math.ceil(weight.shape[0] / bo), math.ceil(weight.shape[1] / bi))
    if tuple(scale.shape) != want or scale.dtype not in ("float32", "bfloat16"):
      raise UserError(f"{self.directory}: tensor {scale.name} is {scale.dtype} {list(scale.shape)}, but "
                      f"quantization_config.weight_block_size={[bo, bi]} tiles {weight.name} {list(weight.shape)} "
                      f"into {list(want)} float32 blocks: the block size does not match the scales")
    self.virtual[weight.name] = (TensorInfo(weight.name, weight.shape, self.dtype), weight.name, scale.name)

  def _mxfp4(self, blocks: TensorInfo, scales: TensorInfo | None) -> None:
    name = blocks.name[:-len("_blocks")]
    if scales is None:
      raise UserError(f"{self.directory}: tensor {blocks.name} has no scales {name}_scales "
                      "(quantization_config.quant_method=mxfp4)")
    if blocks.dtype != "U8" or scales.dtype != "U8" or len(blocks.shape) != 4 or tuple(scales.shape) != blocks.shape[:3]:
      raise UserError(f"{self.directory}: tensors {blocks.name} {blocks.dtype} {list(blocks.shape)} and {scales.name} "
                      f"{scales.dtype} {list(scales.shape)}: MXFP4 needs uint8 (U8) blocks [E, R, G, B] and scales "
                      "[E, R, G]")
    e, r, g, b = blocks.shape
    self.virtual[name] = (TensorInfo(name, (e, g * b * 2, r), self.dtype), blocks.name, scales.name)

  def names(self) -> list[str]:
    return self._names

  def info(self, name: str) -> TensorInfo:
    return self.virtual[name][0] if name in self.virtual else self.reader.info(name)

  def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
    if name not in self.virtual:
      return self.reader.read_rows(name, start, stop)
    info, data, scale = self.virtual[name]
    if self.method == "mxfp4":  # rows are experts
      out = dequantize_mxfp4(self.reader.read_raw_rows(data, start, stop), self.reader.read_raw_rows(scale, start, stop))
    else:
      bo = self.block[0]
      scales = self.reader.read_raw_rows(scale, start // bo, math.ceil(stop / bo))
      full = dequantize_fp8(self.reader.read_raw_rows(data, start // bo * bo, stop), scales, self.block)
      out = full[start % bo:]
    return out.astype(info.dtype)

  def read(self, name: str) -> np.ndarray:
    return self.read_rows(name, 0, self.info(name).shape[0])


def dequantize_fp8(q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
  """float32 q * scale_inv, each scale over its (rows, cols) block, a partial last block included."""
  rows, cols = q.shape
  s = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], axis=0), block[1], axis=1)[:rows, :cols]
  return q.astype(np.float32) * s


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """[E, R, G, B] packed E2M1 pairs and [E, R, G] E8M0 exponents -> float32 [E, G * 2B, R]."""
  values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)  # low nibble = even element
  e, r, g, b = blocks.shape
  out = np.ldexp(values.reshape(e, r, g, 2 * b), scales.astype(np.int32)[..., None] - E8M0_BIAS)
  return out.reshape(e, r, g * 2 * b).transpose(0, 2, 1)

