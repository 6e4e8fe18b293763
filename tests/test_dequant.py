"""Quantized checkpoints dequantised on import (interop/dequant.py): tiny random DeepSeek-V3 (FP8, block scales)
and GPT-OSS (MXFP4 experts) models quantised here as the published checkpoints are, then `from-hf`: the
weights equal what transformers' own dequantisation loads (`dequantize=True`), and so do the logits; what
cannot be read is exit 2 naming the field or the tensor."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from test_families import TOL, VOCAB, make_family_model

FP8_BLOCK = [8, 16]  # not square, so that a transposed scale grid shows
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def quantize_fp8(w, block):
  """DeepSeek-V3's scheme: per (rows, cols) block, scale = amax / 448 (E4M3's largest), q = w / scale in E4M3."""
  import torch

  (o, i), (bo, bi) = w.shape, block
  scale = w.reshape(o // bo, bo, i // bi, bi).abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
  q = (w / scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)).to(torch.float8_e4m3fn)
  return q, scale.float()


def quantize_mxfp4(w):
  """OCP MXFP4 of transformers' [E, K, R] expert weight: stored transposed [E, R, K / 32, 16], groups of 32 along K
  sharing a power-of-two scale (E8M0, bias 127), each value the nearest E2M1, two a byte (low nibble first)."""
  import torch

  x = w.transpose(1, 2).numpy().astype(np.float64)
  e, r, k = x.shape
  groups = x.reshape(e, r, k // 32, 32)
  exp = np.ceil(np.log2(np.maximum(np.abs(groups).max(-1), 1e-30) / 6.0)).astype(np.int32)  # |value| / 2^exp <= 6
  scaled = groups / np.exp2(exp)[..., None]
  nibbles = np.abs(scaled[..., None] - FP4_VALUES).argmin(-1).astype(np.uint8)
  blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
  return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(np.ascontiguousarray(exp + 127).astype(np.uint8))


def quantized_checkpoint(directory: Path, family: str) -> None:
  """The family's tiny random model saved as its published checkpoints are quantised."""
  import torch
  from safetensors.torch import load_file, save_file

  if family == "deepseek_v3":  # every dim a multiple of the block (transformers' loader derives it from the grid)
    make_family_model(directory, family, q_lora_rank=32)
    spec = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": FP8_BLOCK}
  else:  # the experts' K (hidden 32, intermediate 64) in groups of 32
    make_family_model(directory, family, intermediate_size=64)
    spec = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
  tensors, out = load_file(directory / "model.safetensors"), {}
  for name, w in tensors.items():
    if family == "deepseek_v3" and name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight"):
      out[name], out[name + "_scale_inv"] = quantize_fp8(w, FP8_BLOCK)
    elif family == "gpt_oss" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
      out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(w)
    else:
      out[name] = w
  assert len(out) > len(tensors)
  save_file(out, directory / "model.safetensors", metadata={"format": "pt"})
  config = json.loads((directory / "config.json").read_text())
  (directory / "config.json").write_text(json.dumps({**config, "quantization_config": spec}))
  del torch


def load_dequantized(directory: Path):
  """transformers' own dequantisation of the checkpoint (float32 on CPU)."""
  import transformers

  spec = json.loads((directory / "config.json").read_text())["quantization_config"]
  config = (transformers.FineGrainedFP8Config if spec["quant_method"] == "fp8" else transformers.Mxfp4Config)(
      dequantize=True)
  return transformers.AutoModelForCausalLM.from_pretrained(directory, quantization_config=config).eval()


@pytest.fixture(scope="module", params=["deepseek_v3", "gpt_oss"])
def quantized(request, tmp_path_factory):
  from maxtrain.interop import hf_export, hf_import

  root = tmp_path_factory.mktemp(f"q_{request.param}")
  quantized_checkpoint(root / "hf", request.param)
  hf_import.from_hf(root / "hf", root / "mt", block_bytes=200)  # small blocks: partial reads of the pairs
  hf_export.to_hf(root / "mt", root / "hf2")
  return request.param, root, load_dequantized(root / "hf")


def test_from_hf_equals_transformers_dequantisation(quantized):
  """Every weight of the conversion (written back unquantized by to-hf) equals transformers' dequantised one
  exactly; the quantized ones differ from the unquantized originals (so the scales were applied, not dropped)."""
  import transformers
  from safetensors.torch import load_file

  family, root, hf = quantized
  ours = transformers.AutoModelForCausalLM.from_pretrained(root / "hf2").state_dict()
  theirs = hf.state_dict()
  assert ours.keys() == theirs.keys()
  for name in theirs:
    assert np.array_equal(ours[name].numpy(), theirs[name].numpy()), name
  stored = load_file(root / "hf" / "model.safetensors")
  quantized_names = [n for n in stored if n.endswith(("_scale_inv", "_blocks"))]
  assert quantized_names
  changed = 0
  for name in quantized_names:
    base = name.removesuffix("_scale_inv").removesuffix("_blocks")
    if base in theirs:  # GPT-OSS's fused experts; DeepSeek's attention and shared experts
      original = make_original(root, family)[base].numpy()
      err = np.abs(theirs[base].numpy() - original).max() / np.abs(original).max()
      assert 0 < err < 0.2, (name, err)  # a quantisation, with its scales
      changed += 1
  assert changed


_ORIGINALS = {}


def make_original(root: Path, family: str):
  """The unquantized tiny model's weights (the same seed and shapes as the quantized checkpoint's)."""
  if family not in _ORIGINALS:
    overrides = dict(q_lora_rank=32) if family == "deepseek_v3" else dict(intermediate_size=64)
    _ORIGINALS[family] = make_family_model(root / "original", family, **overrides).state_dict()
  return _ORIGINALS[family]


def test_dequantised_logits_equal_transformers(quantized):
  import torch

  from maxtrain.interop.sources import open_source
  from test_interop import maxtrain_logits, maxtrain_model

  _, root, hf = quantized
  x = np.random.default_rng(0).integers(0, VOCAB, (2, 24))
  with torch.no_grad():
    want = hf(torch.tensor(x)).logits.numpy()
  assert np.abs(maxtrain_logits(maxtrain_model(open_source(root / "mt")), x)[..., :VOCAB] - want).max() <= TOL


def test_a_partial_fp8_block_takes_its_blocks_scale():
  """A weight whose dims the block does not divide (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows of 128-row
  blocks): against transformers' `_dequantize_fp8_weight` (its partial-block dequantisation)."""
  import torch
  from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

  from maxtrain.interop.dequant import dequantize_fp8

  rng = np.random.default_rng(0)
  q = torch.tensor(rng.normal(size=(20, 40)) * 50).to(torch.float8_e4m3fn)
  scale = torch.tensor(rng.uniform(0.1, 2.0, (3, 3)), dtype=torch.float32)  # ceil(20 / 8), ceil(40 / 16)
  want = _dequantize_fp8_weight(q, scale, FP8_BLOCK, torch.float32).numpy()
  got = dequantize_fp8(q.view(torch.uint8).numpy().view(np.dtype("float8_e4m3fn")), scale.numpy(), tuple(FP8_BLOCK))
  assert np.array_equal(got, want)


def test_what_cannot_be_dequantised_is_exit_2_naming_it(quantized, tmp_path, capsys):
  """A block size that does not tile the weights as its scales do, and a weight whose scales are missing."""
  from safetensors.torch import load_file, save_file

  from maxtrain.cli import convert

  family, root, _ = quantized
  cases = []
  if family == "deepseek_v3":
    cases.append(("config", dict(weight_block_size=[16, 16]), "quantization_config.weight_block_size=[16, 16]"))
    cases.append(("drop", "model.layers.0.self_attn.o_proj.weight_scale_inv", "model.layers.0.self_attn.o_proj.weight"))
  else:
    cases.append(("drop", "model.layers.1.mlp.experts.down_proj_scales", "model.layers.1.mlp.experts.down_proj_blocks"))
  for i, (kind, change, named) in enumerate(cases):
    hf_dir = tmp_path / f"hf{i}"
    shutil.copytree(root / "hf", hf_dir)
    if kind == "config":
      config = json.loads((hf_dir / "config.json").read_text())
      config["quantization_config"].update(change)
      (hf_dir / "config.json").write_text(json.dumps(config))
    else:
      tensors = load_file(hf_dir / "model.safetensors")
      del tensors[change]
      save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert convert.main(["from-hf", str(hf_dir), str(tmp_path / f"out{i}")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err
    assert not (tmp_path / f"out{i}").exists()
