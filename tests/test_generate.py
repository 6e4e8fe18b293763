"""Generation: the KV-cache decode against the full forward pass (1 and 8 devices), greedy decode
against transformers' greedy `generate`, determinism, and the entry point."""

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


def teacher_forced_logits(generator, rows):
  """Logits after each token of each row (left-padded), prefilling the first token then decoding the rest."""
  longest = max(len(r) for r in rows)
  n = len(rows) + (-len(rows) % generator.batch_multiple)
  padded = [[0] * (longest - len(r)) + list(r) for r in rows] + [[0] * longest] * (n - len(rows))
  tokens = np.array(padded, np.int32)
  first = np.array([[len(r) == longest] for r in rows] + [[True]] * (n - len(rows)))
  with jax.set_mesh(generator.mesh):
    logits, cache = generator._prefill(generator.params, tokens[:, :1], first, longest)
    out = [np.asarray(logits)]
    for t in range(1, longest):
      valid = np.array([t >= longest - len(r) for r in rows] + [True] * (n - len(rows)))
      logits, cache = generator._step(generator.params, cache, jnp.asarray(tokens[:, t]), jnp.int32(t)) \
          if valid.all() else _masked_step(generator, cache, tokens[:, t], valid, t)
      out.append(np.asarray(logits))
  return np.stack(out, axis=1)[:len(rows)]


def _masked_step(generator, cache, token, valid, t):
  from flax import nnx

  from maxtrain.models import decode

  model = nnx.merge(generator.graphdef, generator.params)
  logits, cache = decode.forward(model, jnp.asarray(token)[:, None], jnp.asarray(valid)[:, None], cache, jnp.int32(t))
  return logits[:, 0], cache


def test_cached_decode_equals_full_forward_on_one_device(converted):
  root, _ = converted
  source = open_source(root / "mt")
  model = maxtrain_model(source)
  generator = sampling.Generator(model, jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)), None)
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
  assert dict(generator.mesh.shape) == {"data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
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
