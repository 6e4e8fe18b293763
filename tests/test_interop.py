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
from maxtrain.interop import hf_export, hf_import, names as names_lib  # noqa: E402
from maxtrain.interop.sources import open_source  # noqa: E402
from maxtrain.models import registry  # noqa: E402
from maxtrain.models.llama import Llama  # noqa: E402
from maxtrain.sharding.layout import param_name  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TOL = 1e-4  # max |logits difference|, fp32 (the bound)
BLOCK = 200  # bytes: every tensor of the tiny models moves in several row blocks (a ragged last one)


def maxtrain_model(source) -> Llama:
  """The maxtrain model with the source's parameters, on one device."""
  graphdef, abstract = registry.abstract(registry.model_config({**source.model, "attention": "dot"}))
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
  hf_import.from_hf(tmp_path / "hf", tmp_path / "mt", block_bytes=BLOCK)
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
  hf_import.from_hf(tmp_path / "hf", tmp_path / "mt", block_bytes=BLOCK)
  summary = hf_export.to_hf(tmp_path / "mt", tmp_path / "hf2", max_shard_bytes=20_000, block_bytes=BLOCK)
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


@pytest.mark.parametrize("variant", sorted(VARIANTS))  # GQA, tied and untied, rope_theta 500 / 1e4 / 5e5
def test_export_loads_in_transformers_without_warnings_and_matches(tmp_path, variant):
  import transformers

  make_hf_model(tmp_path / "hf", variant)
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
  from maxtrain.cli import train

  code = train.main(args)
  captured = capsys.readouterr()
  return code, captured.out + captured.err


@pytest.mark.parametrize("scan,model", [(True, []),  # untied, rope_theta 1e4
                                        (False, ["--config.model.tie_embeddings=True", "--config.model.rope_theta=5e5"])])
def test_training_checkpoint_to_hf_and_back_is_bitwise(store, tmp_path, capsys, scan, model):
  import transformers
  from tiny import TINY_MODEL

  run = tmp_path / "run"
  code, out = run_train(TINY_MODEL + [f"--config.data.path={store}", "--config.steps=2",
                                      "--config.model.num_kv_heads=2", f"--config.model.scan_layers={scan}",
                                      f"--config.output_dir={run}", *model], capsys)
  assert code == 0, out
  hf_export.to_hf(run, tmp_path / "hf", max_shard_bytes=40_000, block_bytes=BLOCK)
  hf_import.from_hf(tmp_path / "hf", tmp_path / "mt")
  trained, converted = open_source(run), open_source(tmp_path / "mt")
  # Unscanned layers ('blocks/1/attn/wq') come back stacked ('blocks/attn/wq'[1]): from-hf writes scanned.
  assert sorted({names_lib.split_layer(n)[0] for n in trained.names()}) == sorted(converted.names())
  assert any(names_lib.split_layer(n)[1] is not None for n in trained.names()) == (not scan)
  for name in trained.names():
    base, layer = names_lib.split_layer(name)
    back = converted.read(base)
    assert np.array_equal(trained.read(name), back if layer is None else back[layer]), name
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
  x = tokens(259)
  assert np.abs(maxtrain_logits(maxtrain_model(trained), x) - hf_logits(hf, x)).max() <= TOL


def test_two_processes_each_write_their_files(tmp_path):
  """`to-hf` split over 2 processes (as under srun): each writes every other file, reading only the
  blocks those files hold; together they write exactly what one process writes."""
  import os

  make_hf_model(tmp_path / "hf", "gqa_untied")
  hf_import.from_hf(tmp_path / "hf", tmp_path / "mt", block_bytes=BLOCK)
  one = hf_export.to_hf(tmp_path / "mt", tmp_path / "one", max_shard_bytes=8_000, block_bytes=BLOCK)
  assert one["files"] > 4
  env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
  procs = [subprocess.Popen([sys.executable, "-m", "maxtrain.convert", "to-hf", str(tmp_path / "mt"),
                             str(tmp_path / "two"), "--max-shard-size=8000", f"--process-index={i}",
                             "--num-processes=2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  outputs = [p.communicate(timeout=300)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outputs
  files = sorted(f.name for f in (tmp_path / "one").iterdir())
  assert sorted(f.name for f in (tmp_path / "two").iterdir()) == files
  for f in files:
    assert (tmp_path / "two" / f).read_bytes() == (tmp_path / "one" / f).read_bytes(), f
  tensors = [int(o.split("wrote ")[1].split()[0]) for o in outputs]
  shards = [int(o.split(" files")[0].rsplit(" ", 1)[1]) for o in outputs]
  assert min(tensors) > 0 and sum(tensors) == one["tensors"], outputs
  assert shards == [-(-one["files"] // 2), one["files"] // 2], outputs


def test_sharded_reads_equal_whole_reads(tmp_path):
  """HF dir and converted checkpoint, each read straight onto 8 devices (a shard per layer, and
  shards holding every layer): the shards are the whole parameter's boxes."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  make_hf_model(tmp_path / "hf", "gqa_untied", tokenizer=False)
  hf_import.from_hf(tmp_path / "hf", tmp_path / "mt", block_bytes=BLOCK)
  hf, converted = open_source(tmp_path / "hf"), open_source(tmp_path / "mt")
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
  for name in converted.names():
    shape, dtype = converted.info(name)
    whole = converted.read(name)
    assert np.array_equal(hf.read(name), whole), name
    stacked = bool(names_lib.pieces(name, shape, converted.vocab_size)[0].prefix)
    specs = [P("a", "b"), P(None, "b")] if stacked else [P("b", "a") if len(shape) == 2 else P("b")]
    for spec in specs:
      target = jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=NamedSharding(mesh, spec))
      for source in (hf, converted):
        value = source.read_sharded(name, target)
        assert value.sharding == target.sharding and np.array_equal(np.asarray(value), whole), (name, spec)


PEAK_SCRIPT = """
import json, sys
from maxtrain.interop import hf_export, hf_import

def status(field):  # kB
  return int(open("/proc/self/status").read().split(field + ":")[1].split()[0]) * 1024

def peak_above_now(fn):
  open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
  now = status("VmRSS")
  fn()
  return status("VmHWM") - now

hf, mt, out = sys.argv[1:]
print(json.dumps([peak_above_now(lambda: hf_import.from_hf(hf, mt, block_bytes=1 << 20)),
                  peak_above_now(lambda: hf_export.to_hf(mt, out, block_bytes=1 << 20))]))
"""


def test_conversion_holds_blocks_not_tensors(tmp_path):
  """Peak RSS of each direction (in a fresh process) stays far below the largest tensor (64 MiB:
  the embedding and the head, which export transposes) when blocks are 1 MiB."""
  import os

  from safetensors.numpy import load_file, save_file

  vocab, width = 16384, 1024
  config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": width,
            "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 8, "vocab_size": vocab,
            "tie_word_embeddings": False}
  rng, layer = np.random.default_rng(0), "model.layers.0."
  shapes = {"model.embed_tokens.weight": (vocab, width), "lm_head.weight": (vocab, width),
            "model.norm.weight": (width,),
            layer + "input_layernorm.weight": (width,), layer + "post_attention_layernorm.weight": (width,),
            **{f"{layer}self_attn.{k}_proj.weight": (width, width) for k in "qkvo"},
            layer + "mlp.gate_proj.weight": (64, width), layer + "mlp.up_proj.weight": (64, width),
            layer + "mlp.down_proj.weight": (width, 64)}
  (tmp_path / "hf").mkdir()
  save_file({k: rng.standard_normal(v, np.float32) for k, v in shapes.items()}, tmp_path / "hf" / "model.safetensors")
  (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
  env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
  result = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, *(str(tmp_path / d) for d in ("hf", "mt", "out"))],
                          env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  largest = vocab * width * 4
  from_hf, to_hf = json.loads(result.stdout.splitlines()[-1])
  print(f"peak RSS above the imports: from-hf {from_hf / 2**20:.1f} MiB, to-hf {to_hf / 2**20:.1f} MiB; "
        f"largest tensor {largest / 2**20:.0f} MiB")
  assert from_hf < largest / 2 and to_hf < largest / 2, (from_hf / 2**20, to_hf / 2**20)  # was 3-5 x largest
  original = load_file(tmp_path / "hf" / "model.safetensors")
  exported = load_file(tmp_path / "out" / "model.safetensors")
  assert sorted(original) == sorted(exported)
  for name, value in original.items():
    assert np.array_equal(exported[name], value), name


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


def test_a_rollback_before_any_checkpoint_restores_the_init_from_weights(store, tmp_path, capsys):
  """NaN at step 1, no checkpoint yet: the rollback restores the run's starting state, the init_from weights
  (it used to be the seed's initialisation), and the redone step at a negligible learning rate keeps them."""
  make_hf_model(tmp_path / "hf", "gqa_untied")
  hf_import.from_hf(tmp_path / "hf", tmp_path / "mt")
  run = tmp_path / "run"
  code, out = run_train([f"--config={tmp_path / 'mt' / 'config.py'}", f"--config.data.path={store}",
                         "--config.data.tokenizer=byte", "--config.data.seq_len=32", "--config.data.batch_size=8",
                         "--config.eval.batches=1", f"--config.output_dir={run}", "--config.optimizer.lr=1e-12",
                         "--config.optimizer.adam_lr=1e-12", "--config.steps=1", "--config.faults.nan_at_step=1",
                         "--config.guards.max_consecutive_bad=1"], capsys)
  assert code == 0, out
  rollbacks = [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e["kind"] == "rollback"]
  assert [(e["from_step"], e["to_step"]) for e in rollbacks] == [(1, 0)]
  after, converted = open_source(run), open_source(tmp_path / "mt")
  for name in converted.names():
    np.testing.assert_allclose(after.read(name), converted.read(name), rtol=0, atol=1e-9, err_msg=name)


def test_init_from_with_other_model_math_exits_2(tmp_path, capsys):
  make_hf_model(tmp_path / "hf", "gqa_untied", tokenizer=False)
  hf_import.from_hf(tmp_path / "hf", tmp_path / "mt")
  code, out = run_train([f"--config={tmp_path / 'mt' / 'config.py'}", "--config.model.rope_theta=1000",
                         f"--config.output_dir={tmp_path / 'run'}", "--config.data.seq_len=32",
                         "--config.data.batch_size=8"], capsys)
  assert code == 2 and "config.model.rope_theta=1000.0" in out, out


@pytest.mark.parametrize("field,value,named", [
    ("architectures", ["GPTNeoXForCausalLM"], "architectures"),
    ("architectures", ["MistralForCausalLM"], "model_type"),  # a llama config.json under another class
    ("attention_bias", True, "attention_bias"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type"),
    ("sliding_window", 16, "sliding_window"),
    ("hidden_act", "gelu", "hidden_act"),
])
def test_unsupported_hf_models_exit_2_naming_the_field(tmp_path, capsys, field, value, named):
  from maxtrain.cli import convert

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
  from maxtrain.cli import convert
  from safetensors.numpy import load_file, save_file

  make_hf_model(tmp_path / "hf", "gqa_untied", tokenizer=False)
  weights = load_file(tmp_path / "hf" / "model.safetensors")
  weights["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
  save_file(weights, tmp_path / "hf" / "model.safetensors")
  assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
  assert "q_proj.bias" in capsys.readouterr().err
