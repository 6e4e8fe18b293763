"""Model math against an independent NumPy reference; causality and document isolation."""

import jax
import numpy as np
import pytest
from flax import nnx

from maxtrain.models.llama import Llama, ModelConfig

CFG = ModelConfig(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=48, vocab_size=61,
                  max_seq_len=32, rope_theta=500.0)


def np_rmsnorm(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def np_rope(x, pos, theta):  # x [T, H], pos [T]
  h = x.shape[-1]
  out = np.empty_like(x)
  for i in range(h // 2):
    freq = theta ** (-2.0 * i / h)
    c, s = np.cos(pos * freq), np.sin(pos * freq)
    a, b = x[:, i], x[:, i + h // 2]
    out[:, i], out[:, i + h // 2] = a * c - b * s, b * c + a * s
  return out


def np_forward(p, cfg: ModelConfig, tokens, segs, pos):
  """Per-sequence, per-head loops: deliberately a different formulation from the model."""
  out = []
  n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  for b in range(tokens.shape[0]):
    x = np.asarray(p["embed"])[tokens[b]].astype(np.float64)
    t = x.shape[0]
    for l in range(cfg.num_layers):
      blk = jax.tree.map(lambda a: np.asarray(a[l], np.float64), p["blocks"])
      y = np_rmsnorm(x, blk["attn_norm"]["scale"], cfg.norm_eps)
      heads = []
      for qh in range(n):
        kh = qh // (n // k)
        q = np_rope(y @ blk["attn"]["wq"][:, qh], pos[b], cfg.rope_theta)
        kk = np_rope(y @ blk["attn"]["wk"][:, kh], pos[b], cfg.rope_theta)
        v = y @ blk["attn"]["wv"][:, kh]
        o = np.zeros((t, h))
        for ti in range(t):
          visible = [s for s in range(ti + 1) if segs[b, s] == segs[b, ti]]
          sc = np.array([q[ti] @ kk[s] for s in visible]) / np.sqrt(h)
          w = np.exp(sc - sc.max())
          w /= w.sum()
          o[ti] = sum(wi * v[s] for wi, s in zip(w, visible))
        heads.append(o)
      x = x + sum(heads[qh] @ blk["attn"]["wo"][qh] for qh in range(n))
      y = np_rmsnorm(x, blk["mlp_norm"]["scale"], cfg.norm_eps)
      g, u = y @ blk["mlp"]["gate"], y @ blk["mlp"]["up"]
      x = x + (g / (1 + np.exp(-g)) * u) @ blk["mlp"]["down"]
    x = np_rmsnorm(x, np.asarray(p["final_norm"]["scale"], np.float64), cfg.norm_eps)
    head = np.asarray(p["embed"], np.float64).T if cfg.tie_embeddings else np.asarray(p["head"], np.float64)
    out.append(x @ head)
  return np.stack(out)


def make_inputs(seed=0, b=2, t=12, vocab=CFG.vocab_size):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (b, t)).astype(np.int32)
  # Row 0: two documents (boundary at 5); row 1: a document continuing from an earlier window.
  segs = np.array([[1] * 5 + [2] * (t - 5), [1] * t], np.int32)
  pos = np.array([list(range(5)) + list(range(t - 5)), list(range(7, 7 + t))], np.int32)
  return tokens, segs, pos


def forward(model, tokens, segs, pos):
  return np.asarray(jax.jit(lambda m, *a: m(*a))(model, tokens, segs, pos))


@pytest.mark.parametrize("tie", [False, True])
def test_forward_matches_numpy_reference(tie):
  cfg = ModelConfig(**{**CFG.__dict__, "tie_embeddings": tie})
  model = Llama(cfg, rngs=nnx.Rngs(params=1))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  tokens, segs, pos = make_inputs()
  np.testing.assert_allclose(forward(model, tokens, segs, pos), np_forward(params, cfg, tokens, segs, pos),
                             rtol=1e-4, atol=1e-5)


def test_scan_and_unrolled_layers_agree():
  scanned = Llama(CFG, rngs=nnx.Rngs(params=3))
  unrolled = Llama(ModelConfig(**{**CFG.__dict__, "scan_layers": False}), rngs=nnx.Rngs(params=4))
  # Copy the stacked weights into the unrolled blocks, layer by layer.
  stacked = nnx.state(scanned.blocks, nnx.Param)
  for l, block in enumerate(unrolled.blocks):
    nnx.update(block, jax.tree.map(lambda a: a[l], stacked))
  for name in ("embed", "head"):
    getattr(unrolled, name)[...] = getattr(scanned, name)[...]
  unrolled.final_norm.scale[...] = scanned.final_norm.scale[...]
  tokens, segs, pos = make_inputs(seed=1)
  np.testing.assert_allclose(forward(unrolled, tokens, segs, pos), forward(scanned, tokens, segs, pos),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("unroll", [2, 3])
def test_scan_unroll_does_not_change_loss_or_gradients(unroll):
  """Unrolling the layer scan (all 3 layers, or 2 per iteration with a remainder) is the same math."""
  cfg = ModelConfig(**{**CFG.__dict__, "num_layers": 3})
  tokens, segs, pos = make_inputs(seed=4)

  def loss_and_grads(cfg):
    graphdef, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(params=7)))
    loss = lambda p: nnx.merge(graphdef, p)(tokens, segs, pos).mean()
    return jax.jit(jax.value_and_grad(loss))(params)

  (base_loss, base), (loss, other) = loss_and_grads(cfg), loss_and_grads(ModelConfig(**{**cfg.__dict__, "scan_unroll": unroll}))
  np.testing.assert_allclose(loss, base_loss, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(other)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("remat", ["full", "dots", "offload"])
def test_remat_does_not_change_gradients(remat):
  tokens, segs, pos = make_inputs(seed=2)

  def grads(cfg):
    model = Llama(cfg, rngs=nnx.Rngs(params=5))
    graphdef, params = nnx.split(model)
    loss = lambda p: nnx.merge(graphdef, p)(tokens, segs, pos).mean()
    return jax.jit(jax.grad(loss))(params)

  base, other = grads(CFG), grads(ModelConfig(**{**CFG.__dict__, "remat": remat}))
  for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(other)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_causal_and_document_isolation():
  model = Llama(CFG, rngs=nnx.Rngs(params=6))
  t = 12
  tokens, _, _ = make_inputs(seed=3, b=1, t=t)
  segs = np.array([[1] * 5 + [2] * 7], np.int32)
  pos = np.array([list(range(5)) + list(range(7))], np.int32)
  base = forward(model, tokens, segs, pos)

  # Future tokens change: logits up to and including t=7 must not.
  future = tokens.copy()
  future[0, 8:] = (future[0, 8:] + 1) % CFG.vocab_size
  changed = forward(model, future, segs, pos)
  np.testing.assert_array_equal(changed[0, :8], base[0, :8])
  assert not np.allclose(changed[0, 8:], base[0, 8:])

  # Tokens of document 1 change: logits of document 2 must not.
  other_doc = tokens.copy()
  other_doc[0, :5] = (other_doc[0, :5] + 7) % CFG.vocab_size
  changed = forward(model, other_doc, segs, pos)
  np.testing.assert_array_equal(changed[0, 5:], base[0, 5:])
  assert not np.allclose(changed[0, :5], base[0, :5])


def test_rope_tables_are_computed_once_not_per_element():
  """XLA:CPU fuses sin/cos into every consumer and evaluates them per consumer element (per head,
  half and pass: a tenth of the default step) unless `layers._computed_once` stops it."""
  import re

  import jax.numpy as jnp

  from maxtrain.models.layers import apply_rope

  b, t, n, h = 2, 64, 4, 32
  x = jax.random.normal(jax.random.key(0), (b, t, n, h))
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  grad = jax.jit(jax.grad(lambda x: jnp.sum(apply_rope(x, positions, 10000.0) ** 2)))
  hlo = grad.lower(x).compile().as_text()
  # Every computation that evaluates sin produces at most the [2, B, T, H/2] tables.
  computations = [c for c in hlo.split("\n\n") if "sine(" in c]
  assert computations
  for computation in computations:
    root = re.search(r"ROOT %\S+ = \w+\[([\d,]*)\]", computation).group(1)
    assert np.prod([int(d) for d in root.split(",") if d]) <= 2 * b * t * (h // 2), computation[:400]
