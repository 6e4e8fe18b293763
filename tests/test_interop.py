"""Hugging Face interop: import/export parity with transformers, bitwise round trips, refusals, init_from."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("transformers", reason="interop tests need the test extra: pip install -e '.[test]'")

from hf_models import VARIANTS, hf_logits, make_hf_model  # noqa: E402
from maxtrain.interop import hf_export, hf_import  # noqa: E402
from maxtrain.interop.sources import open_source  # noqa: E402
from maxtrain.models.llama import Llama, ModelConfig  # noqa: E402
from maxtrain.sharding.layout import param_name  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TOL = 1e-4  # max |logits difference|, fp32 (the bound)


def maxtrain_model(source) -> Llama:
  """The maxtrain model with the source's parameters, on one device."""
  cfg = ModelConfig.from_config({**source.model, "attention": "dot"})
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(params=0))))
  params = jax.tree_util.tree_map_with_path(lambda p, leaf: jax.numpy.asarray(source.read(param_name(p))), abstract)
  return nnx.merge(graphdef, params)


def maxtrain_logits(model: Llama, tokens: np.ndarray) -> np.ndarray:
  b, t = tokens.shape
  positions = np.broadcast_to(np.arange(t), (b, t))
  return np.asarray(model(tokens, np.ones((b, t), np.int32), positions))


def tokens(vocab: int, b: int = 2, t: int = 40) -> np.ndarray:
  return np.random.default_rng(0).integers(0, vocab, (b, t))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_import_matches_transformers(tmp_path, variant):
  hf = make_hf_model(tmp_path / "hf", variant)
  hf_import.from_hf(tmp_path / "hf", tmp_path / "mt")
  source = open_source(tmp_path / "mt")
  assert source.model["vocab_size"] == 384 and source.vocab_size == 299  # padded for the mesh
  x = tokens(299)
  ours = maxtrain_logits(maxtrain_model(source), x)
  np.testing.assert_array_equal(ours[..., 299:], 0.0)  # padded vocabulary rows are zero
  assert np.abs(ours[..., :299] - hf_logits(hf, x)).max() <= TOL


@pytest.mark.parametrize("variant", ["gqa_untied", "tied_mha"])
def test_round_trip_hf_maxtrain_hf_is_bitwise(tmp_path, variant):
  from safetensors.numpy import load_file

  make_hf_model(tmp_path / "hf", variant)
  hf_import.from_hf(tmp_path / "hf", tmp_path / "mt")
  summary = hf_export.to_hf(tmp_path / "mt", tmp_path / "hf2", max_shard_bytes=20_000)
  assert summary["files"] > 1 and (tmp_path / "hf2" / "model.safetensors.index.json").is_file()
  original = load_file(tmp_path / "hf" / "model.safetensors")
  index = json.loads((tmp_path / "hf2" / "model.safetensors.index.json").read_text())["weight_map"]
  exported = {}
  for f in sorted(set(index.values())):
    exported.update(load_file(tmp_path / "hf2" / f))
  if VARIANTS[variant]["tie_word_embeddings"]:
    original.pop("lm_head.weight", None)
  assert sorted(exported) == sorted(original)
  for name, value in original.items():
    assert exported[name].dtype == value.dtype and np.array_equal(exported[name], value), name
  assert (tmp_path / "hf2" / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()


def test_export_loads_in_transformers_without_warnings_and_matches(tmp_path):
  import transformers

  make_hf_model(tmp_path / "hf", "llama3_rope")
  hf_import.from_hf(tmp_path / "hf", tmp_path / "mt")
  hf_export.to_hf(tmp_path / "mt", tmp_path / "hf2", max_shard_bytes=30_000)
  model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", output_loading_info=True)
  assert all(not v for v in info.values()), info  # no missing, unexpected or mismatched keys
  source = open_source(tmp_path / "mt")
  x = tokens(299)
  assert np.abs(maxtrain_logits(maxtrain_model(source), x)[..., :299] - hf_logits(model.eval(), x)).max() <= TOL
  gen = json.loads((tmp_path / "hf2" / "generation_config.json").read_text())
  assert (gen["bos_token_id"], gen["eos_token_id"]) == (0, 1)
