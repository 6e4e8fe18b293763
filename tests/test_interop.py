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


def run_train(args, capsys):
  from maxtrain import train

  code = train.main(args)
  captured = capsys.readouterr()
  return code, captured.out + captured.err


def test_training_checkpoint_to_hf_and_back_is_bitwise(store, tmp_path, capsys):
  import transformers
  from tiny import TINY_MODEL

  run = tmp_path / "run"
  code, out = run_train(TINY_MODEL + [f"--config.data.path={store}", "--config.steps=2", "--config.model.num_kv_heads=2",
                                      f"--config.output_dir={run}"], capsys)
  assert code == 0, out
  hf_export.to_hf(run, tmp_path / "hf", max_shard_bytes=40_000)
  hf_import.from_hf(tmp_path / "hf", tmp_path / "mt")
  trained, converted = open_source(run), open_source(tmp_path / "mt")
  assert sorted(trained.names()) == sorted(converted.names())
  for name in trained.names():
    assert np.array_equal(trained.read(name), converted.read(name)), name
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
  x = tokens(259)
  assert np.abs(maxtrain_logits(maxtrain_model(trained), x) - hf_logits(hf, x)).max() <= TOL


def test_init_from_starts_a_fresh_run_then_resumes_like_any_run(store, tmp_path, capsys, caplog):
  make_hf_model(tmp_path / "hf", "gqa_untied")
  hf_import.from_hf(tmp_path / "hf", tmp_path / "mt")
  run = tmp_path / "run"
  args = [f"--config={tmp_path / 'mt' / 'config.py'}", f"--config.data.path={store}", "--config.data.tokenizer=byte",
          "--config.data.seq_len=32", "--config.data.batch_size=8", "--config.eval.batches=1",
          f"--config.output_dir={run}", "--config.optimizer.lr=1e-12", "--config.optimizer.adam_lr=1e-12"]
  code, out = run_train(args + ["--config.steps=1"], capsys)
  assert code == 0, out
  # One step at a negligible learning rate: the parameters are still the converted ones, the step count
  # started at 0 (checkpoint 1), and the optimizer state is one step old.
  after, converted = open_source(run), open_source(tmp_path / "mt")
  assert after.dir.name == "1"
  for name in converted.names():
    np.testing.assert_allclose(after.read(name), converted.read(name), rtol=0, atol=1e-9, err_msg=name)
  code, out = run_train(args + ["--config.steps=3"], capsys)  # a restart resumes its own checkpoint
  assert code == 0, out
  assert "restored step 1" in caplog.text and open_source(run).dir.name == "3"


def test_init_from_with_other_model_math_exits_2(tmp_path, capsys):
  make_hf_model(tmp_path / "hf", "gqa_untied", tokenizer=False)
  hf_import.from_hf(tmp_path / "hf", tmp_path / "mt")
  code, out = run_train([f"--config={tmp_path / 'mt' / 'config.py'}", "--config.model.rope_theta=1000",
                         f"--config.output_dir={tmp_path / 'run'}", "--config.data.seq_len=32",
                         "--config.data.batch_size=8"], capsys)
  assert code == 2 and "config.model.rope_theta=1000.0" in out, out


@pytest.mark.parametrize("field,value,named", [
    ("architectures", ["MistralForCausalLM"], "architectures"),
    ("attention_bias", True, "attention_bias"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type"),
    ("head_dim", 16, "head_dim"),
    ("hidden_act", "gelu", "hidden_act"),
])
def test_unsupported_hf_models_exit_2_naming_the_field(tmp_path, capsys, field, value, named):
  from maxtrain import convert

  make_hf_model(tmp_path / "hf", "gqa_untied", tokenizer=False)
  config = json.loads((tmp_path / "hf" / "config.json").read_text())
  config[field] = value
  (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
  capsys.readouterr()  # transformers' own progress output
  assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and f"{named}=" in err, err
  assert not (tmp_path / "out").exists()


def test_bias_tensors_exit_2(tmp_path, capsys):
  from maxtrain import convert
  from safetensors.numpy import load_file, save_file

  make_hf_model(tmp_path / "hf", "gqa_untied", tokenizer=False)
  weights = load_file(tmp_path / "hf" / "model.safetensors")
  weights["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
  save_file(weights, tmp_path / "hf" / "model.safetensors")
  assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
  assert "q_proj.bias" in capsys.readouterr().err
