"""Multi-token prediction (models/mtp.py): the loss against a NumPy computation of the shifted cross-entropy on a
packed batch, gradients into the MTP parameters, training through the entry point (the loss falls, per-depth
metrics in TensorBoard, bitwise resume), and speculative greedy decoding drafted by it equal to plain greedy."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtrain.models import registry
from maxtrain.models.decoder import ModelConfig
from maxtrain.program import step as step_lib

T, V = 64, 96
DOC = 40  # the packed batch: one document of positions 0..39, a second of 40..63


def tiny_model(mtp_layers: int = 2, weight: float = 0.5, **kw):
  cfg = ModelConfig(num_layers=1, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, vocab_size=V, max_seq_len=T,
                    attention="dot", mtp_layers=mtp_layers, mtp_loss_weight=weight, **kw)
  return registry.build(cfg, rngs=nnx.Rngs(params=0))


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


def numpy_mtp_ce(model, batch) -> list[tuple[float, float]]:
  """Per depth k: (the sum of -log p(token i+k+1) over the positions i whose token i+k+1 is a counted target of
  i's own document, their count), from the model's pieces: the embedding, norms, projection and head in NumPy,
  each depth's Block as the model runs it."""
  def rms(x, scale, eps=model.cfg.norm_eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale

  inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
  mask = np.asarray(batch["loss_mask"])
  embed, head = np.asarray(model.embed[...]), np.asarray(model.head[...])
  h = np.asarray(model.features(batch["inputs"], batch["segment_ids"], batch["positions"])[0])
  out = []
  for k, layer in enumerate(model.mtp, start=1):
    nxt = np.concatenate([inputs[:, k:], np.zeros_like(inputs[:, :k])], axis=1)
    x = np.concatenate([rms(embed[nxt], np.asarray(layer.enorm.scale[...])),
                        rms(h, np.asarray(layer.hnorm.scale[...]))], -1) @ np.asarray(layer.eh_proj[...])
    h = np.asarray(layer.block(jnp.asarray(x), batch["segment_ids"], batch["positions"])[0])
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
  model = tiny_model(mtp_layers=2, weight=0.5)
  batch = packed_batch()
  graphdef, params = nnx.split(model)
  objective, parts = jax.jit(lambda p: step_lib.loss_sums(graphdef, p, batch))(params)
  main, _ = jax.jit(lambda p: step_lib.loss_sums(graphdef, p, batch, with_mtp=False))(params)
  expected = numpy_mtp_ce(model, batch)
  for k, (total, count) in enumerate(expected, start=1):
    assert float(parts[f"mtp_count_{k}"]) == count
    np.testing.assert_allclose(float(parts[f"mtp_ce_{k}"]), total, rtol=1e-5)
  # DeepSeek-V3: main + weight x mean over depths, each depth's sum over the main loss-token count
  np.testing.assert_allclose(float(objective - main), 0.5 / 2 * sum(t for t, _ in expected), rtol=1e-5)
  metrics = step_lib.mtp_metrics(parts)
  assert sorted(metrics) == ["mtp/loss_1", "mtp/loss_2"]
  np.testing.assert_allclose(float(metrics["mtp/loss_2"]), expected[1][0] / expected[1][1], rtol=1e-5)


def test_gradients_reach_every_mtp_parameter_and_mtp_off_is_the_plain_model():
  model = tiny_model(mtp_layers=1)
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
  plain, full = named(nnx.state(tiny_model(mtp_layers=0))), named(nnx.state(model))
  assert plain and all(np.array_equal(x, full[n]) for n, x in plain.items())
