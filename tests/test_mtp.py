"""Multi-token prediction (models/mtp.py): the loss against a NumPy computation of the shifted cross-entropy on a
packed batch, gradients into the MTP parameters, training through the entry point (the loss falls, per-depth
metrics in TensorBoard, bitwise resume), and speculative greedy decoding drafted by it equal to plain greedy."""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtrain.models import registry
from maxtrain.models.decoder import ModelConfig
from maxtrain.program import step as step_lib
from maxtrain.sharding.layout import param_name

T, V = 64, 96
DOC = 40  # the packed batch: one document of positions 0..39, a second of 40..63


@functools.cache
def tiny_model(mtp_layers: int = 2):
  """1 layer, d_model 64, `mtp_layers` depths (loss weight 0.5), initialised in one jit (op by op: seconds)."""
  cfg = ModelConfig(num_layers=1, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, vocab_size=V, max_seq_len=T,
                    attention="dot", mtp_layers=mtp_layers, mtp_loss_weight=0.5)
  graphdef, state = nnx.split(jax.jit(lambda: registry.build(cfg, rngs=nnx.Rngs(params=0)))())
  return nnx.merge(graphdef, state)


def packed_batch(b: int = 2) -> dict[str, jnp.ndarray]:
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, V, (b, T + 1))
  segment = np.where(np.arange(T) < DOC, 1, 2)[None].repeat(b, 0)
  positions = np.where(np.arange(T) < DOC, np.arange(T), np.arange(T) - DOC)[None].repeat(b, 0)
  loss_mask = np.ones((b, T), np.float32)
  loss_mask[:, [DOC - 1, T - 1]] = 0  # a document's last input has no target in its document
  loss_mask[1, 5] = 0  # and one target that does not count
  return {"inputs": jnp.asarray(tokens[:, :T], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
          "segment_ids": jnp.asarray(segment, jnp.int32), "positions": jnp.asarray(positions, jnp.int32),
          "loss_mask": jnp.asarray(loss_mask)}


def jitted(module, fn):
  """fn(module, *args), jitted (op by op the model takes seconds)."""
  graphdef, state = nnx.split(module)
  call = jax.jit(lambda state, *args: fn(nnx.merge(graphdef, state), *args))
  return lambda *args: call(state, *args)


def numpy_mtp_ce(model, batch) -> list[tuple[float, float]]:
  """Per depth k: (the sum of -log p(token i+k+1) over the positions i whose token i+k+1 is a counted target of
  i's own document, their count), from the model's pieces: the embedding, norms, projection and head in NumPy,
  each depth's Block as the model runs it."""
  def rms(x, scale, eps=model.cfg.norm_eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale

  inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
  mask = np.asarray(batch["loss_mask"])
  embed, head = np.asarray(model.embed[...]), np.asarray(model.head[...])
  h = np.asarray(jitted(model, lambda m, *a: m.features(*a)[0])(batch["inputs"], batch["segment_ids"],
                                                                  batch["positions"]))
  out = []
  for k, layer in enumerate(model.mtp, start=1):
    nxt = np.concatenate([inputs[:, k:], np.zeros_like(inputs[:, :k])], axis=1)
    x = np.concatenate([rms(embed[nxt], np.asarray(layer.enorm.scale[...])),
                        rms(h, np.asarray(layer.hnorm.scale[...]))], -1) @ np.asarray(layer.eh_proj[...])
    h = np.asarray(jitted(layer.block, lambda b, *a: b(*a)[0])(jnp.asarray(x), batch["segment_ids"],
                                                                batch["positions"]))
    logits = rms(h, np.asarray(layer.norm.scale[...])) @ head
    logp = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    total, count = 0.0, 0
    for r in range(inputs.shape[0]):
      for i in range(T):
        end = DOC - 1 if i < DOC else T - 1  # the document's last position
        if i + k + 1 <= end and mask[r, i + k]:  # token i+k+1 = targets[i+k], in i's document, counted
          total -= logp[r, i, targets[r, i + k]]
          count += 1
    out.append((total, count))
  return out


def test_mtp_loss_equals_numpy_shifted_cross_entropy():
  model = tiny_model(2)
  batch = packed_batch()
  graphdef, params = nnx.split(model)
  objective, parts = jax.jit(lambda p: step_lib.loss_sums(graphdef, p, batch))(params)
  expected = numpy_mtp_ce(model, batch)
  for k, (total, count) in enumerate(expected, start=1):
    assert float(parts[f"mtp_count_{k}"]) == count
    np.testing.assert_allclose(float(parts[f"mtp_ce_{k}"]), total, rtol=1e-5)
  # DeepSeek-V3: main + weight x mean over depths, each depth's sum over the main loss-token count
  np.testing.assert_allclose(float(objective - parts["ce"]), 0.5 / 2 * sum(t for t, _ in expected), rtol=1e-5)
  # the chunked head (a large vocabulary's default) computes the same per-depth sums
  _, chunked = jax.jit(lambda p: step_lib.loss_sums(graphdef, p, batch, chunk_tokens=16))(params)
  for k in (1, 2):
    np.testing.assert_allclose(float(chunked[f"mtp_ce_{k}"]), float(parts[f"mtp_ce_{k}"]), rtol=1e-5)
  metrics = step_lib.mtp_metrics(parts)
  assert sorted(metrics) == ["mtp/loss_1", "mtp/loss_2"]
  np.testing.assert_allclose(float(metrics["mtp/loss_2"]), expected[1][0] / expected[1][1], rtol=1e-5)


def test_gradients_reach_every_mtp_parameter_and_mtp_off_is_the_plain_model():
  model = tiny_model(2)
  batch = packed_batch()
  graphdef, params = nnx.split(model)
  grads = jax.jit(jax.grad(lambda p: step_lib.loss_sums(graphdef, p, batch)[0]))(params)
  from maxtrain.sharding.layout import param_name

  norms = {param_name(p): float(jnp.linalg.norm(g)) for p, g in jax.tree_util.tree_leaves_with_path(grads)}
  mtp = {n: v for n, v in norms.items() if n.startswith("mtp/")}
  assert {"mtp/0/eh_proj", "mtp/0/enorm/scale", "mtp/0/hnorm/scale", "mtp/0/norm/scale",
          "mtp/0/block/attn/wq"} <= set(mtp), sorted(mtp)
  assert all(v > 0 for v in mtp.values()), mtp
  # The MTP modules come after every other parameter: with them off the same seed builds the same model.
  named = lambda state: {param_name(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(state)}
  plain, full = named(nnx.state(tiny_model(0))), named(nnx.state(model))
  assert plain and all(np.array_equal(x, full[n]) for n, x in plain.items())


def test_speculative_refuses_what_it_cannot_draft():
  from maxtrain.errors import UserError
  from maxtrain.inference import speculative
  from maxtrain.inference.sampling import Sampling

  with pytest.raises(UserError, match="model.mtp_layers=0"):
    speculative.check(tiny_model(0).cfg, Sampling())
  with pytest.raises(UserError, match="--temperature=0.7"):
    speculative.check(tiny_model(2).cfg, Sampling(temperature=0.7))


MTP_RUN = ["--config.model.mtp_layers=1", "--config.model.mtp_loss_weight=0.3", "--config.eval.every_steps=0",
           "--config.log_every=1", "--config.checkpoint.every_steps=4", "--config.optimizer.lr=0.01",
           "--config.optimizer.warmup_steps=1"]


@pytest.fixture(scope="module")
def mtp_run(store, tmp_path_factory):
  """8 steps of the tiny model with one MTP depth through the entry point (8 devices), checkpoints at 4 and 8."""
  from maxtrain.cli import train
  from tiny import TINY_MODEL

  run = tmp_path_factory.mktemp("mtp") / "a"
  assert train.main(TINY_MODEL + MTP_RUN + [f"--config.data.path={store}", "--config.steps=8",
                                            f"--config.output_dir={run}"]) == 0
  return run


def test_training_with_mtp_falls_logs_each_depth_and_resumes_bitwise(mtp_run, store, tmp_path):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  from maxtrain.cli import train
  from test_checkpoint import assert_bitwise_equal, losses, restore_raw
  from tiny import TINY_MODEL

  events = EventAccumulator(str(mtp_run / "tensorboard"))
  events.Reload()
  main = [e.value for e in events.Scalars("train/loss")]
  mtp = [e.value for e in events.Scalars("train/mtp/loss_1")]
  assert len(main) == len(mtp) == 8 and main[-1] < main[0] - 0.3 and mtp[-1] < mtp[0] - 0.3, (main, mtp)
  # Stopped after step 4 of the same schedule, then resumed by a second run: bitwise the run that never stopped.
  base = TINY_MODEL + MTP_RUN + [f"--config.data.path={store}", f"--config.output_dir={tmp_path / 'b'}"]
  assert train.main(base + ["--config.steps=4", "--config.optimizer.decay_steps=8"]) == 0
  assert train.main(base + ["--config.steps=8"]) == 0
  assert_bitwise_equal(restore_raw(mtp_run / "checkpoints", 8), restore_raw(tmp_path / "b/checkpoints", 8))
  assert losses(tmp_path / "b") == losses(mtp_run)


def test_mtp_speculative_greedy_equals_plain_greedy(mtp_run, capsys):
  """The production path (`load`: the run's 8-device mesh, prompt copies fill the batch shards): the drafted text
  is plain greedy's, token for token; the entry point prints the acceptance rate."""
  from maxtrain.cli import generate
  from maxtrain.inference import sampling, speculative

  generator, tokenizer, _ = sampling.load(str(mtp_run))
  prompts = [tokenizer.encode("def main(argv):\n  "), tokenizer.encode("import jax\n")]
  plain, _ = generator.generate(prompts, 24, sampling.Sampling())
  drafted, stats = speculative.SpeculativeGenerator(generator).generate(prompts, 24)
  assert drafted == plain and all(len(p) == 24 for p in plain)
  assert 0 <= stats["acceptance_rate"] <= 1 and 24 <= stats["verify_calls"] * 2
  assert generate.main(["--checkpoint", str(mtp_run), "--prompt", "def f(x):", "--max-new-tokens", "8",
                        "--draft", "mtp"]) == 0
  assert "mtp draft: acceptance rate" in capsys.readouterr().err


def test_mtp_speculative_greedy_of_a_random_deepseek_v3_equals_plain_greedy():
  """MLA with the latent cache, a dense layer then a dropless MoE one, and the MTP depth a MoE layer too: random
  weights (a varied text), one device; the drafted text is plain greedy's."""
  from maxtrain.inference import sampling, speculative
  from test_families import _model, base_moe

  moe = {**base_moe(), "num_experts": 4, "dispatch": "dropless", "router": "sigmoid", "first_dense_layers": 1,
         "num_shared_experts": 1}
  mla = dict(kv_lora_rank=16, q_lora_rank=24, rope_head_dim=8, nope_head_dim=16, v_head_dim=12, rope_interleave=True,
             softmax_mscale=1.0, latent_cache=True)
  cfg = _model("deepseek_v3", moe=moe, mla=mla, mtp_layers=1, attention="dot")
  graphdef, params = registry.abstract(cfg)
  assert "mtp/0/block/moe/router" in {param_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
  rng = np.random.default_rng(5)
  params = jax.tree.map(lambda a: jnp.asarray(0.2 * rng.standard_normal(a.shape), a.dtype), params)
  generator = sampling.Generator(nnx.merge(graphdef, params), jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)))
  prompts = [list(rng.integers(0, 128, 7)), list(rng.integers(0, 128, 12))]
  plain, _ = generator.generate(prompts, 20, sampling.Sampling())
  drafted, stats = speculative.SpeculativeGenerator(generator).generate(prompts, 20)
  assert drafted == plain and len(set(plain[0] + plain[1])) > 5, plain
  assert 0 <= stats["acceptance_rate"] <= 1
  with pytest.raises(speculative.UserError, match="dispatch=dropless"):
    speculative.check(_model("deepseek_v3", moe={**moe, "dispatch": "capacity", "num_experts": 8,
                                                 "capacity_factor": 1.0}, mla=mla, mtp_layers=1), sampling.Sampling())


@pytest.fixture(scope="module")
def hf_with_mtp(tmp_path_factory):
  """A random transformers DeepseekV3ForCausalLM of 3 layers saved as a 2-layer model with one MTP layer, as the
  published checkpoints hold it: layer 2's tensors plus enorm, hnorm, eh_proj, shared_head.norm and the copies of
  the embedding and the head; num_nextn_predict_layers=1. Returns (dir, the 3-layer torch model, MTP tensors)."""
  import json

  import torch
  from safetensors.torch import load_file, save_file
  from test_families import make_family_model

  root = tmp_path_factory.mktemp("hf_mtp")
  hf = make_family_model(root / "hf3", "deepseek_v3", num_hidden_layers=3)
  d = hf.config.hidden_size
  torch.manual_seed(2)
  extra = {"model.layers.2.enorm.weight": 1 + 0.1 * torch.randn(d), "model.layers.2.hnorm.weight": 1 + 0.1 * torch.randn(d),
           "model.layers.2.eh_proj.weight": 0.2 * torch.randn(d, 2 * d),
           "model.layers.2.shared_head.norm.weight": 1 + 0.1 * torch.randn(d)}
  # as save_pretrained writes them (transformers 5 holds the experts fused in memory, one tensor per expert on disk)
  tensors = {}
  for f in sorted((root / "hf3").glob("*.safetensors")):
    tensors.update(load_file(str(f)))
  tensors.update(extra)
  tensors["model.layers.2.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
  tensors["model.layers.2.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
  out = root / "hf"
  out.mkdir()
  save_file(tensors, str(out / "model.safetensors"))
  config = json.loads((root / "hf3" / "config.json").read_text())
  (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2, "num_nextn_predict_layers": 1}))
  return out, hf, extra


def test_from_hf_reads_deepseek_mtp_layer_against_transformers_and_to_hf_drops_it(hf_with_mtp, tmp_path, caplog):
  """from-hf maps the MTP layer (its MoE block included) to model.mtp_layers=1: the depth's logits equal the same
  computation in torch with transformers' own decoder layer (atol 1e-4 x the logits' scale); to-hf leaves it out
  with a logged line; a config without it (num_nextn_predict_layers=0) ignores it with a logged line."""
  import json
  import logging

  import torch

  from maxtrain.interop import hf_export, hf_import
  from maxtrain.interop.sources import open_source
  from test_interop import maxtrain_model

  hf_dir, hf, extra = hf_with_mtp
  hf_import.from_hf(hf_dir, tmp_path / "mt")
  source = open_source(tmp_path / "mt")
  assert source.model["mtp_layers"] == 1 and "mtp/0/block/moe/gate" in source.names()
  model = maxtrain_model(source)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, hf.config.vocab_size, (2, 12)).astype(np.int32)
  seg, pos = np.ones_like(tokens), np.broadcast_to(np.arange(12), tokens.shape)
  graphdef, state = nnx.split(model)
  ours = np.asarray(jax.jit(lambda s: (lambda m: m._logits(m.mtp_features(m.features(tokens, seg, pos)[0], tokens, seg,
                                                                          pos)[0]))(nnx.merge(graphdef, s)))(state))

  # torch: layer 1's output, the final norm: h0; then layer 2 (transformers' DeepseekV3DecoderLayer) fed
  # eh_proj([enorm(embed(next token)); hnorm(h0)]), the shared head's norm and the head.
  def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + hf.config.rms_norm_eps) * w

  layers, captured = hf.model.layers, {}
  first = lambda out: out[0] if isinstance(out, tuple) else out
  hook = layers[1].register_forward_hook(lambda mod, args, out: captured.update(h=first(out)))
  t = torch.tensor(tokens)
  with torch.no_grad():
    hf(t)
    hook.remove()
    h0 = hf.model.norm(captured["h"])
    nxt = torch.cat([t[:, 1:], torch.zeros_like(t[:, :1])], 1)
    x = torch.cat([rms(hf.model.embed_tokens(nxt), extra["model.layers.2.enorm.weight"]),
                   rms(h0, extra["model.layers.2.hnorm.weight"])], -1) @ extra["model.layers.2.eh_proj.weight"].T

    def feed(mod, args, kwargs):
      return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    hook = layers[2].register_forward_pre_hook(feed, with_kwargs=True)
    hf.model.norm.weight.copy_(extra["model.layers.2.shared_head.norm.weight"])
    ref = hf(t).logits.numpy()
    hook.remove()
  V = hf.config.vocab_size
  np.testing.assert_allclose(ours[:, :-1, :V], ref[:, :-1], rtol=0, atol=1e-4 * np.abs(ref).max())

  caplog.set_level(logging.INFO, logger="maxtrain")
  hf_export.to_hf(tmp_path / "mt", tmp_path / "hf2")
  assert "dropped the" in caplog.text and "multi-token-prediction" in caplog.text
  from maxtrain.interop.safetensors_io import Reader

  assert not [n for n in Reader(tmp_path / "hf2").names() if n.startswith("model.layers.2.")]
  assert json.loads((tmp_path / "hf2" / "config.json").read_text())["num_nextn_predict_layers"] == 0

  # The same checkpoint, its config counting no MTP layer: the layer is not read, and said so.
  config = json.loads((hf_dir / "config.json").read_text())
  (hf_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
  caplog.clear()
  try:
    assert open_source(hf_dir).model["mtp_layers"] == 0
  finally:
    (hf_dir / "config.json").write_text(json.dumps(config))
  assert "not read (model.layers.2." in caplog.text


def test_shift_counts_tokens_in_the_context_parallel_order():
  """Under context parallelism a sequence is laid out in its zigzag order (program/batch.py): 'k tokens later' is
  counted in the sequence, so shifting the reordered array is reordering the shifted one (a run with
  mesh.context=2 then logs the same train/mtp/loss_1 as without, to 1e-6)."""
  from maxtrain.models import mtp
  from maxtrain.sharding.context_attention import zigzag_order

  a = jnp.asarray(np.random.default_rng(0).integers(1, 99, (2, 16)), jnp.int32)
  for shards in (2, 4):
    order = zigzag_order(16, shards)
    for k in (1, 3):
      np.testing.assert_array_equal(mtp.shift_left(a[:, order], k, -1, order), mtp.shift_left(a, k, -1)[:, order])
