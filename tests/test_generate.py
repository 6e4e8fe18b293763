"""Generation: the KV-cache decode (the training model's own cache path) against the full forward pass
(1 and 8 devices; every CPU attention kernel, scanned and unscanned layers, a MoE model), greedy
decode against transformers' greedy `generate`, determinism, and the entry point (dense and MoE)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers", reason="generation tests need the test extra: pip install -e '.[test]'")

from hf_models import make_hf_model  # noqa: E402
from maxtrain.inference import sampling  # noqa: E402
from maxtrain.interop import hf_import  # noqa: E402
from maxtrain.interop.sources import open_source  # noqa: E402
from test_interop import maxtrain_logits, maxtrain_model  # noqa: E402


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  root = tmp_path_factory.mktemp("gen")
  hf = make_hf_model(root / "hf", "llama3_rope")
  hf_import.from_hf(root / "hf", root / "mt")
  return root, hf


def teacher_forced_logits(generator, rows, prefill: int = 1):
  """Logits after each token of each row (left-padded): one call over the cache for the first `prefill`
  columns (the run's attention kernel, padding included), then one call per column (the dot path
  against the cache; a row still in its padding passes an invalid token)."""
  longest = max(len(r) for r in rows)
  n = len(rows) + (-len(rows) % generator.batch_multiple)
  padded = [[0] * (longest - len(r)) + list(r) for r in rows] + [[0] * longest] * (n - len(rows))
  tokens = np.array(padded, np.int32)
  valid = np.array([[t >= longest - len(r) for t in range(longest)] for r in rows] + [[True] * longest] * (n - len(rows)))
  with jax.set_mesh(generator.mesh):
    cache = generator.init_cache(generator.params, n, longest)
    logits, cache = generator.forward(generator.params, tokens[:, :prefill], valid[:, :prefill], cache)
    out = [np.asarray(logits)]
    for t in range(prefill, longest):
      logits, cache = generator.forward(generator.params, tokens[:, t:t + 1], valid[:, t:t + 1], cache)
      out.append(np.asarray(logits))
  return np.concatenate(out, axis=1)[:len(rows)]


def test_cached_decode_equals_full_forward_on_one_device(converted):
  root, _ = converted
  source = open_source(root / "mt")
  model = maxtrain_model(source)
  generator = sampling.Generator(model, jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)))
  rows = [list(np.random.default_rng(1).integers(0, 299, 24)), list(np.random.default_rng(2).integers(0, 299, 17))]
  cached = teacher_forced_logits(generator, rows)
  for i, row in enumerate(rows):
    full = maxtrain_logits(model, np.array([row]))[0]
    got = cached[i, -len(row):]
    assert np.abs(got - full).max() <= 1e-5, i


def test_cached_decode_sharded_on_eight_devices_equals_full_forward(converted):
  root, _ = converted
  generator, _, source = sampling.load(str(root / "mt"))
  assert generator.mesh.devices.size == 8 and generator.batch_multiple == 8
  row = list(np.random.default_rng(3).integers(0, 299, 20))
  cached = teacher_forced_logits(generator, [row])[0]
  full = maxtrain_logits(maxtrain_model(source), np.array([row]))[0]
  assert np.abs(cached - full).max() <= 1e-5


def test_greedy_equals_transformers_generate_and_is_deterministic(converted):
  import torch

  root, hf = converted
  generator, _, _ = sampling.load(str(root / "mt"))
  prompts = [[0, 5, 77, 123, 9], [0, 42, 7]]
  ours, _ = generator.generate(prompts, 12, sampling.Sampling(), vocab_limit=299)
  for prompt, got in zip(prompts, ours):
    with torch.no_grad():
      x = torch.tensor([prompt])
      ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False, eos_token_id=None,
                        pad_token_id=298)[0, len(prompt):].tolist()
    assert got == ref
  again, _ = generator.generate(prompts, 12, sampling.Sampling(), vocab_limit=299)
  assert again == ours
  rule = sampling.Sampling(temperature=1.0, top_k=50, top_p=0.9, seed=7)
  a, _ = generator.generate(prompts, 12, rule, vocab_limit=299)
  b, _ = generator.generate(prompts, 12, rule, vocab_limit=299)
  c, _ = generator.generate(prompts, 12, sampling.Sampling(temperature=1.0, seed=8), vocab_limit=299)
  assert a == b and a != c and all(t < 299 for row in a + c for t in row)


def test_sampling_rules():
  logits = jnp.array([[0.0, 1.0, 2.0, 3.0, 100.0]])
  key = jax.random.key(0)
  assert int(sampling.sample(logits, key, sampling.Sampling(), vocab_limit=4)[0]) == 3  # padding never chosen
  picks = {int(sampling.sample(logits, jax.random.key(i), sampling.Sampling(1.0, top_k=2), 4)[0]) for i in range(50)}
  assert picks == {2, 3}
  # softmax([0, 1, 2, 3]) = [.03, .09, .24, .64]: the smallest set reaching 0.8 is {3, 2}; reaching 0.5, {3}.
  for top_p, expected in ((0.8, {2, 3}), (0.5, {3})):
    picks = {int(sampling.sample(logits, jax.random.key(i), sampling.Sampling(1.0, top_p=top_p), 4)[0])
             for i in range(50)}
    assert picks == expected, top_p


def test_entry_point_prints_text(converted, capsys):
  from maxtrain.cli import generate

  root, _ = converted
  assert generate.main(["--checkpoint", str(root / "mt"), "--prompt", "the quick", "--prompt", "def f(x)",
                        "--max-new-tokens", "5"]) == 0
  captured = capsys.readouterr()
  assert captured.out.startswith("the quick") and "def f(x)" in captured.out and "tokens/s" in captured.err
  assert generate.main(["--checkpoint", str(root / "missing"), "--prompt", "x"]) == 2


def test_entry_point_on_a_training_run_with_the_byte_tokenizer(store, tmp_path, capsys):
  """A run's own checkpoint (the default run's kind: byte tokenizer, no tokenizer.json), read from the
  run dir onto the 8-device training mesh; seeded sampling gives the same text twice."""
  from maxtrain.cli import generate, train
  from tiny import TINY_MODEL

  run = tmp_path / "run"
  assert train.main(TINY_MODEL + [f"--config.data.path={store}", "--config.steps=2", f"--config.output_dir={run}"]) == 0
  capsys.readouterr()
  args = ["--checkpoint", str(run), "--prompt", "def f(x):", "--prompt", "import os", "--max-new-tokens", "16",
          "--temperature", "1.0", "--seed", "3"]
  texts = []
  for _ in range(2):
    assert generate.main(args) == 0
    captured = capsys.readouterr()
    assert "tokens/s" in captured.err
    texts.append(captured.out)
  first, second = texts[0].split("-" * 40 + "\n")[:2]
  assert first.startswith("def f(x):") and len(first) > len("def f(x):\n") and second.startswith("import os")
  assert texts[0] == texts[1]


def test_load_honours_the_runs_mesh_and_overrides(store, tmp_path):
  """A run trained on data=2 x fsdp=2 x tensor=2 generates on that mesh; --config.mesh.* overrides win, and
  are validated as training validates them."""
  from maxtrain.cli import train
  from maxtrain.errors import UserError
  from tiny import TINY_MODEL

  run = tmp_path / "run"
  mesh = ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]
  assert train.main(TINY_MODEL + mesh + [f"--config.data.path={store}", "--config.steps=1",
                                         f"--config.output_dir={run}"]) == 0
  generator, tokenizer, _ = sampling.load(str(run))
  assert dict(generator.mesh.shape) == {"pipeline": 1, "data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
  assert generator.batch_multiple == 4
  out, _ = generator.generate([[tokenizer.bos_id, 5, 6]], 4, sampling.Sampling())
  assert len(out) == 1 and len(out[0]) <= 4
  generator, _, _ = sampling.load(str(run), overrides=["--config.mesh.data=1", "--config.mesh.fsdp=-1",
                                                       "--config.mesh.tensor=1"])
  assert dict(generator.mesh.shape)["fsdp"] == 8 and generator.batch_multiple == 8
  with pytest.raises(UserError, match="mesh"):
    sampling.load(str(run), overrides=["--config.mesh.tensor=3"])
  with pytest.raises(UserError, match="--config.KEY=VALUE"):
    sampling.load(str(run), overrides=["--config=configs/default.py"])


# ---- one model for training and decoding: every kernel, both layer layouts, MoE -------------------------

# Capacity factor E / K = 2: an expert's C = T slots hold every token that picks it, so no assignment
# drops and a prefix routes as the whole sequence does (drops would make the full pass non-causal).
MOE = ["--config.model.moe.num_experts=4", "--config.model.moe.experts_per_token=2",
       "--config.model.moe.expert_d_ff=16", "--config.model.moe.capacity_factor=2.0",
       "--config.model.moe.first_dense_layers=1", "--config.model.moe.num_shared_experts=1"]
ROWS = [list(np.random.default_rng(4).integers(0, 299, 24)), list(np.random.default_rng(5).integers(0, 299, 17))]


def one_device_generator(model):
  return sampling.Generator(model, jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)))


def model_with(source, **overrides):
  """The checkpoint's model, its config changed by `overrides` (kernel, layer layout), on one device.
  Unscanned layers ('blocks/3/attn/wq') are rows of the stored stacked parameters."""
  from flax import nnx

  from maxtrain.models.llama import Llama, ModelConfig
  from maxtrain.sharding.layout import param_name

  cfg = ModelConfig.from_config({**source.model, **overrides})
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(params=0))))

  def read(path, leaf):
    parts = param_name(path).split("/")
    if len(parts) > 2 and parts[1].isdigit():
      return jnp.asarray(source.read("/".join([parts[0], *parts[2:]]))[int(parts[1])], leaf.dtype)
    return jnp.asarray(source.read(param_name(path)), leaf.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(read, abstract))


def assert_decode_equals_full_forward(generator, model, rows=ROWS, prefill=12):
  """A prefill of `prefill` columns (left padding included), then one token per call, against the
  full forward pass of each row alone, at every position."""
  from flax import nnx

  cached = teacher_forced_logits(generator, rows, prefill=prefill)
  graphdef, state = nnx.split(model)
  # maxtrain_logits's call, jitted: op by op, unscanned layers take seconds.
  full_logits = jax.jit(lambda state, t_BT: nnx.merge(graphdef, state)(
      t_BT, jnp.ones(t_BT.shape, jnp.int32), jnp.broadcast_to(jnp.arange(t_BT.shape[1]), t_BT.shape)))
  for i, row in enumerate(rows):
    full = np.asarray(full_logits(state, np.array([row])))[0]
    np.testing.assert_allclose(cached[i, -len(row):], full, rtol=1e-5, atol=1e-5, err_msg=f"row {i}")


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unscanned"])
@pytest.mark.parametrize("kernel", ["dot", "flash", "blocked"])
def test_cached_decode_equals_full_forward_for_every_kernel(converted, kernel, scan):
  """The run's kernel serves the prefill (8-blocks: several, a ragged last one), the dot path the
  one-token steps; `auto` resolves to one of these three on CPU."""
  model = model_with(open_source(converted[0] / "mt"), attention=kernel, scan_layers=scan, attention_block_q=8,
                     attention_block_kv=8)
  assert_decode_equals_full_forward(one_device_generator(model), model)


@pytest.fixture(scope="module")
def moe_run(store, tmp_path_factory):
  """A training run's checkpoint of a tiny MoE model (one dense layer, one MoE layer with a shared expert)."""
  from maxtrain.cli import train
  from tiny import TINY_MODEL

  run = tmp_path_factory.mktemp("moe") / "run"
  assert train.main(TINY_MODEL + MOE + [f"--config.data.path={store}", "--config.steps=2",
                                        f"--config.output_dir={run}"]) == 0
  return run


def test_moe_cached_decode_equals_full_forward_on_eight_devices(moe_run):
  """The production path: `load` puts the MoE checkpoint on the 8-device training mesh (scanned layers)."""
  generator, _, source = sampling.load(str(moe_run))
  assert generator.mesh.devices.size == 8 and generator.cfg.moe.num_experts == 4 and generator.cfg.scan_layers
  assert_decode_equals_full_forward(generator, model_with(source))


def test_moe_cached_decode_equals_full_forward_unscanned(moe_run):
  model = model_with(open_source(moe_run), scan_layers=False)
  assert_decode_equals_full_forward(one_device_generator(model), model)


def test_entry_point_runs_a_moe_checkpoint(moe_run, capsys):
  from maxtrain.cli import generate

  assert generate.main(["--checkpoint", str(moe_run), "--prompt", "def f(x):", "--max-new-tokens", "6"]) == 0
  captured = capsys.readouterr()
  assert captured.out.startswith("def f(x):") and "tokens/s" in captured.err
