"""Model families through one registry (models/registry.py): nothing outside models/ names a family, the
pieces (q/k/v biases, qk-norm, head_dim, sliding windows) against a NumPy/plain-JAX reference, and the
flash and blocked kernels skip the key blocks a window leaves out."""

import ast
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.models import registry
from maxtrain.models.attention import flash as fa
from maxtrain.models.attention.blocked import blocked_attention
from maxtrain.models.attention.layer import dot_product_attention

REPO = Path(__file__).resolve().parent.parent
# The declaration of model.family's default (config/ sits below models/ and cannot ask the registry).
ALLOWED = {("maxtrain/config/keys.py", registry.DEFAULT)}


def _family_words() -> set[str]:
  words = set()
  for family in registry.families().values():
    words |= {family.name, family.hf.architecture, family.hf.model_type, family.name.capitalize()}
    words.add(type(family.module).__name__ if not isinstance(family.module, type) else "")
  return words - {""} | {"Llama", "Qwen2", "Qwen3", "Mistral"}


def test_no_module_outside_models_names_a_family():
  """A family is its module in models/ plus a registry line: elsewhere no string literal is a family's name,
  HF architecture or model_type, no identifier is a family's class, and no import reaches a family module
  (prose in docstrings and comments may mention them)."""
  words = _family_words()
  modules = {f"maxtrain.models.{name}" for name in registry.names()}
  found = []
  for path in sorted((REPO / "maxtrain").rglob("*.py")):
    if path.is_relative_to(REPO / "maxtrain" / "models"):
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      where = str(path.relative_to(REPO))
      if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in words and (
          where, node.value) not in ALLOWED:
        found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
      elif isinstance(node, (ast.Name, ast.Attribute)) and (getattr(node, "id", None) or node.attr) in words:
        found.append(f"{path.relative_to(REPO)}:{node.lineno}: {getattr(node, 'id', None) or node.attr}")
      elif isinstance(node, ast.ImportFrom) and (node.module in modules or any(
          f"{node.module}.{a.name}" in modules for a in node.names)):
        found.append(f"{path.relative_to(REPO)}:{node.lineno}: import {node.module}")
      elif isinstance(node, ast.Import) and any(a.name in modules for a in node.names):
        found.append(f"{path.relative_to(REPO)}:{node.lineno}: import")
  assert not found, "\n".join(found)


# ---------------------------------------------------------------------------------------------------------
# Sliding windows in every kernel: the dot kernel against NumPy, flash and blocked against the dot kernel
# (values and gradients), and the key blocks flash visits.

def _window_reference(q, k, v, segments, window):
  """NumPy attention: key j visible from query i iff same document, j <= i and i - j < window."""
  b, t, n, h = q.shape
  g = n // k.shape[2]
  kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  scores = np.einsum("bqnh,bknh->bnqk", q, kk) / np.sqrt(h)
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  visible = (j <= i) & (i - j < window) & (segments[:, :, None] == segments[:, None, :])[:, None]
  scores = np.where(visible, scores, -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bnqk,bknh->bqnh", p, vv)


def test_window_kernels_match_the_reference():
  """T = 72 (not a multiple of the 16-blocks: padding), a window of 21 spanning two to three key blocks."""
  t, window = 72, 21
  rng = np.random.default_rng(t)
  b, n, kv, h = 2, 4, 2, 8
  q, k, v = (rng.standard_normal((b, t, m, h)).astype(np.float32) for m in (n, kv, kv))
  segments = np.ones((b, t), np.int32)
  segments[1, t // 3:] = 2  # a second document in row 1
  want = _window_reference(q, k, v, segments, window)
  kernels = {"dot": lambda *a: dot_product_attention(*a, window=window),
             "flash": lambda *a: fa.flash_attention(*a, block_q=16, block_kv=16, window=window),
             "blocked": lambda *a: blocked_attention(*a, block_q=16, window=window)}
  cotangent = rng.standard_normal(q.shape).astype(np.float32)
  grads = {}
  for name, kernel in kernels.items():
    out, vjp = jax.vjp(lambda q, k, v: kernel(q, k, v, jnp.asarray(segments)), q, k, v)
    np.testing.assert_allclose(np.asarray(out), want, rtol=0, atol=2e-5, err_msg=name)
    grads[name] = vjp(jnp.asarray(cotangent))
  for name in ("flash", "blocked"):
    for a, b_ in zip(grads[name], grads["dot"]):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=0, atol=1e-4 * np.abs(np.asarray(b_)).max(),
                                 err_msg=name)


def test_flash_visits_the_key_blocks_of_the_window_only():
  """Pairs per query block: at most ceil((W - 1) / block) + 1 key blocks whatever T, so the work grows with
  the window, not with the sequence; every pair left out is wholly outside the window or after the diagonal."""
  block, window = 32, 48
  for t in (256, 1024):
    pairs = fa._block_pairs(t // block, t // block, block, block, t, True, window)
    per_q = np.bincount([i for i, _ in pairs])
    assert per_q.max() == -(-(window - 1) // block) + 1 and len(pairs) <= (t // block) * per_q.max()
    for i in range(t // block):
      for j in range(t // block):
        needed = j * block <= (i + 1) * block - 1 and (j + 1) * block - 1 > i * block - window
        assert ((i, j) in pairs) == needed, (t, i, j)
  assert len(fa._block_pairs(32, 32, 32, 32, 1024, True, 48)) * 4 < len(fa._block_pairs(32, 32, 32, 32, 1024, True))


def _model(family: str, **keys):
  from maxtrain import config as config_lib

  m = config_lib.base_config().model
  m.update(dict(family=family, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=96, vocab_size=128,
                max_seq_len=64, **keys))
  return registry.model_config(m)


def test_flash_equals_dot_with_a_window_shorter_than_the_sequence():
  """The same random Mistral-family model (window 12 < T = 64, two documents) under the dot and flash kernels:
  the same loss (rtol 1e-5) and gradients."""
  from flax import nnx

  losses, grads = {}, {}
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 128, (2, 64))
  segments = np.ones((2, 64), np.int32)
  segments[0, 40:] = 2
  positions = np.where(segments == 2, np.arange(64) - 40, np.arange(64))
  _, params = registry.abstract(_model("mistral", sliding_window=12))
  params = jax.tree.map(lambda a: jnp.asarray(0.1 * rng.standard_normal(a.shape), a.dtype), params)
  for kernel in ("dot", "flash"):
    cfg = _model("mistral", sliding_window=12, attention=kernel, attention_block_q=16, attention_block_kv=16)
    graphdef, _ = registry.abstract(cfg)

    def loss(p):
      logits = nnx.merge(graphdef, p)(tokens[:, :-1], segments[:, :-1], positions[:, :-1])
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

    losses[kernel], grads[kernel] = jax.value_and_grad(loss)(params)
  np.testing.assert_allclose(float(losses["flash"]), float(losses["dot"]), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads["flash"]), jax.tree.leaves(grads["dot"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-4 * np.abs(np.asarray(b)).max() + 1e-9)
