"""Model families through one registry (models/registry.py): nothing outside models/ names a family, the
pieces (q/k/v biases, qk-norm, head_dim, sliding windows) against a NumPy/plain-JAX reference, and the
flash and blocked kernels skip the key blocks a window leaves out."""

import ast
import dataclasses
import functools
import json
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
# model.family's declared default, and the typed section's default that must equal it (test_config.py)
ALLOWED = {("maxtrain/config/keys.py", registry.DEFAULT), ("maxtrain/config/schema.py", registry.DEFAULT)}


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
    @jax.jit
    def run(q, k, v, kernel=kernel):
      out, vjp = jax.vjp(lambda q, k, v: kernel(q, k, v, jnp.asarray(segments)), q, k, v)
      return out, vjp(jnp.asarray(cotangent))

    out, grads[name] = run(q, k, v)
    np.testing.assert_allclose(np.asarray(out), want, rtol=0, atol=2e-5, err_msg=name)
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
  m.update({**dict(family=family, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=96, vocab_size=128,
                  max_seq_len=64), **keys})
  return registry.model_config(m)


# gemma3: 3 layers of pattern 3 (local, local, global), local RoPE base 1e4 beside a global 1e6, (1 + w) qk-norm
GEMMA3_KEYS = dict(num_layers=3, window_pattern=3, head_dim=16, rope_theta=1e6, rope_local_theta=1e4)


@pytest.mark.parametrize("family,keys", [("mistral", {}), ("gemma3", GEMMA3_KEYS),
                                         ("gemma2", dict(head_dim=16, query_pre_attn_scalar=12, attn_logit_softcap=0.05))])
def test_flash_equals_dot_with_a_window_shorter_than_the_sequence(family, keys):
  """The same random model (window 12 < T = 64, two documents; Mistral: every layer, Gemma 3: its local layers,
  Gemma 2: its even layers, the attention scores soft-capped) under the dot and flash kernels: the same loss
  (rtol 1e-5) and gradients."""
  assert_flash_equals_dot(lambda kernel: _model(family, sliding_window=12, attention=kernel, attention_block_q=16,
                                                attention_block_kv=16, **keys))


# ---------------------------------------------------------------------------------------------------------
# Each family against transformers: a tiny random model built from its config class (nothing downloaded),
# converted with from-hf; greedy generation equals transformers' greedy generate, and to-hf gives back its
# logits within 1e-4.

TOL = 1e-4
GEMMA_ATTN_CAP, GEMMA_FINAL_CAP = 0.05, 0.5  # small: the tiny model's scores and logits are small
VOCAB = 299
HF_FAMILIES = {  # family: (config class, model class, config kwargs)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    # head_dim 16 != hidden_size / heads = 8: Qwen3's own head width
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=False)),
    # a window of 6 tokens, shorter than the prompts below
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6, tie_word_embeddings=False)),
    # 8 experts of width 24, top 2 renormalised; the experts saved one tensor each, stacked on import
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=16, tie_word_embeddings=False, num_experts=8,
                                                              num_experts_per_tok=2, moe_intermediate_size=24,
                                                              norm_topk_prob=True)),
    # sinks, biases everywhere, the clamped SwiGLU (a limit the activations reach), alternating 6-token windows
    # (shorter than the prompts), YaRN with an attention factor (factor 4 over an original 16 positions)
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        head_dim=16, tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2, sliding_window=6,
        swiglu_limit=2.0, rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                           "truncate": False, "original_max_position_embeddings": 16,
                                           "rope_theta": 150000.0})),
    # MLA (q and kv latents, an interleaved RoPE head of 8, v narrower than q.k), YaRN with mscale_all_dim, one
    # dense layer then MoE: sigmoid router with a non-zero correction bias, 4 groups of which 2 compete,
    # routed_scaling_factor, a shared expert
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, tie_word_embeddings=False, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, n_shared_experts=1, moe_intermediate_size=16, routed_scaling_factor=2.5, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "rope_theta": 10000.0})),
    # Gemma's norms, GELU-tanh GLU, embedding scale, query_pre_attn_scalar 12 != head_dim 16, alternating 6-token
    # windows (shorter than the prompts), soft-capping on at caps the scores and logits of this tiny model reach
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=12, sliding_window=6, attn_logit_softcapping=GEMMA_ATTN_CAP,
        final_logit_softcapping=GEMMA_FINAL_CAP, tie_word_embeddings=True)),
    # Gemma 2's pieces plus the (1 + w) qk-norm, 3 layers of pattern 3 (local, local, global: the 5 : 1 rule's
    # period, shortened) with 6-token windows, a local RoPE base (1e4) beside a linear-scaled global one (1e6)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=12, sliding_window=6, num_hidden_layers=3, sliding_window_pattern=3,
        tie_word_embeddings=True, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}


def family_config(family: str, **overrides):
  """The family's tiny transformers config (its class's, so every field is as transformers writes it)."""
  import transformers

  config_cls, _, kwargs = HF_FAMILIES[family]
  shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)
  return getattr(transformers, config_cls)(**{**shape, **kwargs, **overrides})


def make_family_model(directory: Path, family: str, **overrides):
  import torch
  import transformers

  _, model_cls, _ = HF_FAMILIES[family]
  torch.manual_seed(1)
  cfg = family_config(family, **overrides)
  model = getattr(transformers, model_cls)(cfg).eval()
  with torch.no_grad():  # norms away from 1 and biases away from 0, so that a swapped or dropped one shows
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1 + 0.1 * torch.randn_like(p))
      elif name.endswith("bias"):
        p.copy_(0.5 * torch.randn_like(p))
      elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # a decisive router: a wrong expert shows
        p.copy_(torch.randn_like(p))
      elif name.endswith(("sinks", "_bias")):  # GPT-OSS's sinks and expert biases
        p.copy_(0.5 * torch.randn_like(p))
      elif "mlp.experts." in name:  # experts large enough that the clamp acts
        p.copy_(0.3 * torch.randn_like(p))
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):  # DeepSeek's: it chooses, so a wrong one changes the experts
        b.copy_(0.3 * torch.randn_like(b))
  model.save_pretrained(directory)
  return model


@pytest.fixture(scope="module", params=sorted(HF_FAMILIES))
def converted(request, tmp_path_factory):
  from maxtrain.interop import hf_export, hf_import

  root = tmp_path_factory.mktemp(request.param)
  hf = make_family_model(root / "hf", request.param)
  hf_import.from_hf(root / "hf", root / "mt", block_bytes=200)
  hf_export.to_hf(root / "mt", root / "hf2", max_shard_bytes=30_000, block_bytes=200)
  return request.param, root, hf


def test_from_hf_picks_the_family_and_its_pieces(converted):
  from maxtrain.interop.sources import open_source

  family, root, _ = converted
  model = open_source(root / "mt").model
  assert model["family"] == family
  # its config.py preset loads back to the same keys: the family's published defaults fill none of them, also
  # where the tiny model's value is base_config()'s (num_kv_heads 2; gpt_oss's default is 8)
  from maxtrain import config as config_lib

  loaded = config_lib.load([f"--config={root / 'mt' / 'config.py'}"]).model.to_dict()
  assert {k: loaded[k] for k in model if k not in ("param_dtype",)} == {k: v for k, v in model.items()
                                                                       if k not in ("param_dtype",)}
  assert (model.get("head_dim"), model.get("sliding_window", 0)) == {"qwen2": (0, 0), "qwen3": (16, 0),
                                                                       "mistral": (0, 6), "qwen3_moe": (16, 0),
                                                                       "gpt_oss": (16, 6), "deepseek_v3": (0, 0),
                                                                       "gemma2": (16, 6), "gemma3": (16, 6)}[family]
  cfg = registry.model_config(model)
  assert (cfg.qkv_bias, cfg.qk_norm, cfg.head_dim) == {"qwen2": (True, False, 8), "qwen3": (False, True, 16),
                                                       "mistral": (False, False, 8), "qwen3_moe": (False, True, 16),
                                                       "gpt_oss": (True, False, 16), "deepseek_v3": (False, False, 8),
                                                       "gemma2": (False, False, 16), "gemma3": (False, True, 16)}[family]
  moe = cfg.moe
  assert (moe.num_experts, moe.experts_per_token, moe.expert_d_ff, moe.norm_topk_prob, moe.dispatch) == {
      "qwen3_moe": (8, 2, 24, True, "dropless"), "gpt_oss": (8, 2, 48, True, "dropless"),
      "deepseek_v3": (8, 2, 16, True, "dropless")}.get(
          family, (0, 2, 256, True, "capacity"))
  if family == "gpt_oss":
    assert (cfg.attention_sinks, cfg.o_bias, moe.expert_bias, moe.activation, moe.swiglu_limit, cfg.rope_scaling,
            cfg.rope_truncate, cfg.scan_layers) == (True, True, True, "clamped_swiglu", 2.0, "yarn", False, False)
    assert [cfg.layer_window(i) for i in range(4)] == [6, 0, 6, 0]
  if family == "gemma2":
    assert (cfg.norm_one_plus, cfg.post_norms, cfg.embed_scale, cfg.mlp_activation, cfg.query_pre_attn_scalar,
            cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.tie_embeddings, cfg.scan_layers) == (
                True, True, True, "gelu_tanh", 12.0, GEMMA_ATTN_CAP, GEMMA_FINAL_CAP, True, False)
    assert [cfg.layer_window(i) for i in range(4)] == [6, 0, 6, 0]
  if family == "gemma3":
    assert (cfg.norm_one_plus, cfg.post_norms, cfg.embed_scale, cfg.query_pre_attn_scalar, cfg.attn_logit_softcap,
            cfg.scan_layers, cfg.window_pattern, cfg.rope_theta, cfg.rope_scaling, cfg.rope_scaling_factor,
            cfg.rope_local_theta) == (True, True, True, 12.0, 0.0, False, 3, 1e6, "linear", 4.0, 1e4)
    assert [cfg.layer_window(i) for i in range(6)] == [6, 6, 0, 6, 6, 0]
    assert [cfg.layer_rope(i).theta for i in range(3)] == [1e4, 1e4, 1e6]
  if family == "deepseek_v3":
    assert (moe.router, moe.n_group, moe.topk_group, moe.routed_scaling_factor, moe.num_shared_experts,
            moe.first_dense_layers) == ("sigmoid", 4, 2, 2.5, 1, 1)
    assert (cfg.mla.kv_lora_rank, cfg.mla.q_lora_rank, cfg.mla.rope_head_dim, cfg.mla.nope_head_dim,
            cfg.mla.v_head_dim, cfg.mla.rope_interleave) == (16, 24, 8, 16, 12, True)
    assert cfg.mla.softmax_mscale == pytest.approx(0.1 * np.log(4.0) + 1)


def test_greedy_generate_equals_transformers(converted):
  """Prompts of 9 and 13 tokens (longer than Mistral's 6-token window), 10 new tokens each."""
  import torch

  from maxtrain.inference import sampling

  family, root, hf = converted
  generator, _, _ = sampling.load(str(root / "mt"))
  prompts = [[0, 5, 77, 123, 9, 31, 250, 4, 18], [0, 42, 7, 99, 3, 3, 181, 64, 12, 7, 200, 15, 8]]
  ours, _ = generator.generate(prompts, 10, sampling.Sampling(), vocab_limit=VOCAB)
  for prompt, got in zip(prompts, ours):
    with torch.no_grad():
      x = torch.tensor([prompt])
      ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False, eos_token_id=None,
                        pad_token_id=VOCAB - 1)[0, len(prompt):].tolist()
    assert got == ref, family


def test_to_hf_gives_back_the_logits(converted):
  import torch
  import transformers

  family, root, hf = converted
  model, info = transformers.AutoModelForCausalLM.from_pretrained(root / "hf2", output_loading_info=True)
  assert type(model).__name__ == HF_FAMILIES[family][1]
  assert all(not v for v in info.values()), info  # no missing, unexpected or mismatched keys
  x = torch.tensor(np.random.default_rng(0).integers(0, VOCAB, (2, 24)))
  with torch.no_grad():
    assert np.abs(model.eval()(x).logits.numpy() - hf(x).logits.numpy()).max() <= TOL


def test_converted_logits_equal_transformers(converted):
  """The full forward pass (24 tokens: 4x Mistral's window) against transformers' own; for Mistral, also
  that the window matters here (the logits without it differ), so the equality tests the window."""
  import torch
  from flax import nnx

  from maxtrain.interop.sources import open_source
  from test_interop import maxtrain_logits, maxtrain_model

  family, root, hf = converted
  model = maxtrain_model(open_source(root / "mt"))
  x = np.random.default_rng(0).integers(0, VOCAB, (2, 24))
  with torch.no_grad():
    want = hf(torch.tensor(x)).logits.numpy()
  assert np.abs(maxtrain_logits(model, x)[..., :VOCAB] - want).max() <= TOL
  graphdef, params = nnx.split(model)
  changes = {"mistral": [dict(sliding_window=0)], "gpt_oss": [dict(sliding_window=0)],  # each must matter here
             "gemma2": [dict(sliding_window=0), dict(attn_logit_softcap=0.0), dict(final_logit_softcap=0.0)],
             "gemma3": [dict(sliding_window=0), dict(window_pattern=2), dict(rope_local_theta=0.0),
                        dict(norm_one_plus=False)]}
  for change in changes.get(family, []):
    other = registry.abstract(dataclasses.replace(model.cfg, **change))[0]
    assert np.abs(maxtrain_logits(nnx.merge(other, params), x)[..., :VOCAB] - want).max() > 100 * TOL, change


def test_transformers_4_and_5_spellings_read_alike(converted):
  """config.json as transformers 5.x writes it (rope_parameters, layer_types) and as 4.x did (rope_theta at the
  top, no layer_types, Qwen's use_sliding_window=false beside an unused sliding_window): the same model keys."""
  from maxtrain.interop import hf_config

  family, root, _ = converted
  v5 = json.loads((root / "hf" / "config.json").read_text())
  assert "rope_parameters" in v5
  v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "layer_types")}
  if family == "gemma3":  # 4.x Gemma 3: the global RoPE at the top, the local base apart, the pattern as a period
    full, local = v5["rope_parameters"]["full_attention"], v5["rope_parameters"]["sliding_attention"]
    v4 = {k: v for k, v in v4.items() if k != "_sliding_window_pattern"}
    v4.update(rope_theta=full["rope_theta"], rope_scaling={k: v for k, v in full.items() if k != "rope_theta"},
              rope_local_base_freq=local["rope_theta"], sliding_window_pattern=v5["_sliding_window_pattern"],
              hidden_act=v5["hidden_activation"], transformers_version="4.50.0")
    assert hf_config.to_model_keys(v4, "v4") == hf_config.to_model_keys(v5, "v5")
    return
  v4.update(rope_theta=v5["rope_parameters"]["rope_theta"], rope_scaling=None, transformers_version="4.51.3")
  if family == "gemma2":  # 4.x Gemma 2 wrote both activation fields and no layer_types (even layers slide)
    v4.update(hidden_act=v5["hidden_activation"])
  if family not in ("mistral", "gpt_oss", "gemma2"):
    v4.update(use_sliding_window=False, sliding_window=4096, max_window_layers=28)
  if v5["rope_parameters"].get("rope_type") == "yarn":  # as published: YaRN under rope_scaling
    v4.update(rope_scaling={k: v for k, v in v5["rope_parameters"].items() if k != "rope_theta"})
  if family == "gpt_oss":  # gpt-oss-20b's config.json keeps its layer_types
    v4.update(layer_types=v5["layer_types"])
  if family == "qwen3_moe":  # 5.x writes the expert count under its attribute-map name
    assert "num_experts" not in v5
    v4["num_experts"] = v4.pop("num_local_experts")
  assert hf_config.to_model_keys(v4, "v4") == hf_config.to_model_keys(v5, "v5")


REFUSED = [  # (family, field changed, value, the field the one-line error names)
    ("qwen2", "use_sliding_window", True, "use_sliding_window"),
    ("qwen2", "layer_types", ["sliding_attention", "full_attention"], "layer_types"),
    ("qwen3", "attention_bias", True, "attention_bias"),
    ("qwen3", "rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}, "rope_parameters.rope_type"),
    ("mistral", "layer_types", ["sliding_attention", "full_attention"], "layer_types"),
    ("mistral", "attention_bias", True, "attention_bias"),
    ("mistral", "hidden_act", "gelu", "hidden_act"),
    ("qwen3_moe", "mlp_only_layers", [0], "mlp_only_layers"),
    ("qwen3_moe", "decoder_sparse_step", 2, "decoder_sparse_step"),
    ("gpt_oss", "quantization_config", {"quant_method": "gptq"}, "quantization_config.quant_method"),
    ("gpt_oss", "layer_types", ["full_attention", "sliding_attention"], "layer_types"),
    ("deepseek_v3", "quantization_config", {"quant_method": "fp8", "weight_block_size": [128]},
     "quantization_config.weight_block_size"),
    ("deepseek_v3", "quantization_config", {"quant_method": "fp8", "fmt": "e5m2"}, "quantization_config.fmt"),
    ("deepseek_v3", "n_group", 3, "n_group"),
    ("gemma2", "layer_types", ["full_attention", "sliding_attention"], "layer_types"),
    ("gemma2", "hidden_activation", "gelu", "hidden_activation"),
    ("gemma2", "attention_bias", True, "attention_bias"),
    ("gemma2", "final_logit_softcapping", "30", "final_logit_softcapping"),
    ("gemma3", "layer_types", ["sliding_attention", "full_attention", "sliding_attention"], "layer_types"),
    ("gemma3", "rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": 1e6}, "sliding_attention": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_parameters.sliding_attention.rope_type"),
    ("gemma3", "use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("gemma3", "architectures", ["Gemma3ForConditionalGeneration"], "architectures"),
]


@pytest.mark.parametrize("family,field,value,named", REFUSED)
def test_what_would_change_the_math_is_exit_2_naming_the_field(family, tmp_path, capsys, field, value, named):
  """Refused from config.json alone, before any tensor is read (the directory holds no weights)."""
  from maxtrain.cli import convert

  hf_dir = tmp_path / "hf"
  cfg = family_config(family)
  cfg.architectures = [HF_FAMILIES[family][1]]
  cfg.save_pretrained(hf_dir)
  config = json.loads((hf_dir / "config.json").read_text())
  config[field] = value
  (hf_dir / "config.json").write_text(json.dumps(config))
  capsys.readouterr()
  assert convert.main(["from-hf", str(hf_dir), str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and f"{named}=" in err, err
  assert not (tmp_path / "out").exists()


def test_to_hf_refuses_a_piece_the_class_cannot_express():
  """A piece the family's HF class has no place for (LLaMA with qk-norm, Qwen2 with a window, Mistral with
  q/k/v biases) is a UserError naming the key, before any file is written; the family's own pieces pass."""
  from maxtrain import config as config_lib
  from maxtrain.errors import UserError
  from maxtrain.interop import hf_config

  keys = config_lib.base_config().model.to_dict()
  write = lambda **m: hf_config.from_model_keys({**keys, **m}, vocab_size=VOCAB, dtype="float32", bos_id=0, eos_id=1)
  for family, key, value in (("llama", "qk_norm", True), ("qwen2", "sliding_window", 8), ("mistral", "qkv_bias", True),
                             ("qwen3", "qkv_bias", True), ("qwen3_moe", "qkv_bias", True),
                             ("deepseek_v3", "qkv_bias", True), ("llama", "final_logit_softcap", 30.0),
                             ("qwen3", "post_norms", True), ("mistral", "mlp_activation", "gelu_tanh"),
                             ("gemma2", "qk_norm", True)):
    with pytest.raises(UserError, match=f"model.{key}={value!r}: {HF_FAMILIES.get(family, ('', 'LlamaForCausalLM'))[1]}"):
      write(family=family, **{key: value})
  assert write(family="qwen2")["architectures"] == ["Qwen2ForCausalLM"]
  assert write(family="mistral", sliding_window=8)["sliding_window"] == 8
  assert write(family="qwen3", head_dim=128)["head_dim"] == 128
  gemma = write(family="gemma2", sliding_window=8, attn_logit_softcap=50.0, num_layers=3)
  assert (gemma["layer_types"], gemma["attn_logit_softcapping"], gemma["final_logit_softcapping"]) == (
      ["sliding_attention", "full_attention", "sliding_attention"], 50.0, None)
  gemma3 = write(family="gemma3", sliding_window=8, num_layers=7, rope_theta=1e6, rope_local_theta=1e4)
  assert (gemma3["layer_types"], gemma3["sliding_window_pattern"], gemma3["rope_local_base_freq"]) == (
      ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"], 6, 1e4)
  assert write(family="gemma3", sliding_window=0, max_seq_len=512)["sliding_window"] == 512  # no window: T's
  with pytest.raises(UserError, match="model.rope_local_theta=0.0: Gemma 3 scales the global layers' RoPE only"):
    write(family="gemma3", rope_scaling="linear", rope_scaling_factor=8.0)


def test_attention_softcap_refuses_the_kernels_without_it():
  """Soft-capping runs in the dot and flash kernels: an explicit blocked / cudnn / nki is a UserError naming the
  key (exit 2 before compiling); auto, dot and flash pass."""
  from maxtrain import config as config_lib
  from maxtrain.errors import UserError

  m = config_lib.base_config().model
  m.attn_logit_softcap = 50.0
  for kernel in ("blocked", "cudnn", "nki"):
    m.attention = kernel
    with pytest.raises(UserError, match=f"model.attention={kernel} has no attention logit soft-capping"):
      registry.validate(m)
  for kernel in ("auto", "dot", "flash"):
    m.attention = kernel
    registry.validate(m)


def test_attention_softcap_in_dot_and_flash_matches_the_reference():
  """c tanh(s / c) on the scaled scores (c = 1.5, where the tiny scores saturate it) with a window of 21 over
  T = 72 and two documents: dot and flash against NumPy (values, at the window test's tolerance), flash's
  gradients (its own backward: dS times 1 - tanh^2) against the dot kernel's autodiff; the cap matters."""
  t, window, cap = 72, 21, 1.5
  rng = np.random.default_rng(11)
  b, n, kv, h = 2, 4, 2, 8
  q, k, v = (rng.standard_normal((b, t, m, h)).astype(np.float32) for m in (n, kv, kv))
  segments = np.ones((b, t), np.int32)
  segments[1, t // 3:] = 2
  g = n // kv
  kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  scores = cap * np.tanh(np.einsum("bqnh,bknh->bnqk", q.astype(np.float64), kk) / np.sqrt(h) / cap)
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  visible = (j <= i) & (i - j < window) & (segments[:, :, None] == segments[:, None, :])[:, None]
  scores = np.where(visible, scores, -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  want = np.einsum("bnqk,bknh->bqnh", p / p.sum(-1, keepdims=True), vv)
  assert np.abs(want - _window_reference(q, k, v, segments, window)).max() > 1e-2  # the cap changes the output
  kernels = {"dot": lambda *a: dot_product_attention(*a, jnp.asarray(segments), window=window, logit_cap=cap),
             "flash": lambda *a: fa.flash_attention(*a, jnp.asarray(segments), block_q=16, block_kv=16, window=window,
                                                    logit_cap=cap)}
  cotangent = jnp.asarray(rng.standard_normal(q.shape).astype(np.float32))
  grads = {}
  for name, kernel in kernels.items():
    out, grads[name] = jax.jit(lambda q, k, v, kernel=kernel: (lambda o, f: (o, f(cotangent)))(
        *jax.vjp(kernel, q, k, v)))(q, k, v)
    np.testing.assert_allclose(np.asarray(out), want, rtol=0, atol=2e-5, err_msg=name)
  for a, b_ in zip(grads["flash"], grads["dot"]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=0, atol=1e-4 * np.abs(np.asarray(b_)).max())


def train_losses(args: list[str], out: Path, capsys) -> tuple[list[float], object]:
  """Train through the real entry point (exit 0 asserted); the logged train losses and the TensorBoard events."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  from maxtrain.cli import train

  assert train.main(args) == 0, capsys.readouterr().err[-2000:]
  events = EventAccumulator(str(out / "tensorboard"))
  events.Reload()
  return [e.value for e in events.Scalars("train/loss")], events


def test_a_family_with_every_piece_trains_through_the_entry_point(store, tmp_path, capsys):
  """qwen3 (qk-norm) with q/k/v biases, a head_dim of its own and a window shorter than the sequence under
  the flash kernel, Muon: the real entry point trains it (state, routing, step, eval, checkpoint) and the
  loss falls; biases and norm scales are on Adam."""
  from tiny import TINY_MODEL

  out = tmp_path / "run"
  args = TINY_MODEL + [f"--config.data.path={store}", "--config.steps=8", f"--config.output_dir={out}",
                       "--config.log_every=2", "--config.model.family=qwen3", "--config.model.qkv_bias=True",
                       "--config.model.head_dim=16", "--config.model.sliding_window=8", "--config.model.attention=flash",
                       "--config.model.attention_block_q=8", "--config.model.attention_block_kv=8",
                       "--config.optimizer.name=muon", "--config.optimizer.lr=0.02", "--config.optimizer.adam_lr=0.01",
                       "--config.optimizer.warmup_steps=1"]
  losses, _ = train_losses(args, out, capsys)
  assert len(losses) == 4 and losses[-1] < losses[0] - 0.3, losses
  assert json.loads((out / "config.json").read_text())["model"]["family"] == "qwen3"


def test_decode_memory_of_a_window_layer_is_window_sized(converted):
  """A cache for 40 slots: a window layer holds its window's slots (Mistral: 6 per layer; GPT-OSS: its even
  layers 6, its odd full layers 40), every other layer all 40. Greedy generation past the window
  (test_greedy_generate_equals_transformers) runs through these rings."""
  from maxtrain.interop.sources import open_source
  from test_interop import maxtrain_model

  family, root, _ = converted
  model = maxtrain_model(open_source(root / "mt"))
  cache = model.init_cache(2, 40)
  slots = []  # per layer, in the model's order (dense stack, then the MoE stack)
  for name in ("blocks", "moe_blocks"):
    stack = cache.kv.get(name)
    if stack is not None:
      slots += [kv.k_BSKH.shape[-3] for kv in stack] if isinstance(stack, list) else [stack.k_BSKH.shape[2]] * stack.k_BSKH.shape[0]
  windows = {"mistral": [6, 6], "gpt_oss": [6, 40], "gemma2": [6, 40], "gemma3": [6, 6, 40]}.get(family, [40, 40])
  assert slots == windows, (family, slots)
  assert cache.valid_BS.shape == (2, 40)


@pytest.mark.slow
def test_a_windowed_family_resumes_bitwise_after_sigkill(store, tmp_path):
  """Mistral-family (window 8 < seq_len 32, flash): a run SIGKILLed after step 5 (checkpoints every 2 steps)
  and restarted ends bitwise where the run that never stopped does, with the same loss at every step."""
  from test_checkpoint import assert_bitwise_equal, losses, restore_raw, trainer
  from tiny import TINY_MODEL

  base = TINY_MODEL + [f"--config.data.path={store}", "--config.model.family=mistral", "--config.model.sliding_window=8",
                       "--config.model.attention=flash", "--config.model.attention_block_q=8",
                       "--config.model.attention_block_kv=8", "--config.checkpoint.every_steps=2", "--config.log_every=1",
                       "--config.steps=6"]
  a = trainer(base + [f"--config.output_dir={tmp_path / 'a'}"], devices=1)
  assert a.returncode == 0, a.stderr[-3000:]
  b1 = trainer(base + [f"--config.output_dir={tmp_path / 'b'}", "--config.faults.kill_at_step=5"], devices=1)
  assert b1.returncode == -9, b1.stderr[-3000:]
  b2 = trainer(base + [f"--config.output_dir={tmp_path / 'b'}"], devices=1)
  assert b2.returncode == 0 and "restored step 4" in b2.stderr, b2.stderr[-3000:]
  assert_bitwise_equal(restore_raw(tmp_path / "a/checkpoints", 6), restore_raw(tmp_path / "b/checkpoints", 6))
  assert losses(tmp_path / "b") == losses(tmp_path / "a")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_a_moe_family_resumes_bitwise_after_sigkill(family, store, tmp_path):
  """gpt_oss (window 8 < seq_len 32 on its even layers, sinks) and deepseek_v3 (MLA, the aux-loss-free bias
  moving), both from their family's defaults under tiny keys, under flash: SIGKILLed after step 3 (checkpoints
  every 2 steps) and restarted, the run ends bitwise where the one that never stopped does, the same loss at
  every step."""
  from test_checkpoint import assert_bitwise_equal, losses, restore_raw, trainer
  from tiny import TINY_MODEL

  keys = GPT_OSS_KEYS if family == "gpt_oss" else DEEPSEEK_KEYS + ["--config.model.attention_block_q=8",
                                                                   "--config.model.attention_block_kv=8"]
  base = TINY_MODEL + keys + [f"--config.data.path={store}", "--config.model.attention=flash",
                              "--config.checkpoint.every_steps=2", "--config.log_every=1", "--config.steps=4"]
  a = trainer(base + [f"--config.output_dir={tmp_path / 'a'}"], devices=1)
  assert a.returncode == 0, a.stderr[-3000:]
  b1 = trainer(base + [f"--config.output_dir={tmp_path / 'b'}", "--config.faults.kill_at_step=3"], devices=1)
  assert b1.returncode == -9, b1.stderr[-3000:]
  b2 = trainer(base + [f"--config.output_dir={tmp_path / 'b'}"], devices=1)
  assert b2.returncode == 0 and "restored step 2" in b2.stderr, b2.stderr[-3000:]
  assert_bitwise_equal(restore_raw(tmp_path / "a/checkpoints", 4), restore_raw(tmp_path / "b/checkpoints", 4))
  assert losses(tmp_path / "b") == losses(tmp_path / "a")


def test_linear_rope_scaling_matches_transformers(tmp_path):
  """rope_type `linear` (position interpolation, factor 4) read, computed and written back: logits within 1e-4
  of transformers' both ways (written in the 4.x spelling, which transformers 5 reads)."""
  import torch
  import transformers

  from maxtrain.interop import hf_export, hf_import
  from maxtrain.interop.sources import open_source
  from test_interop import maxtrain_logits, maxtrain_model

  rope = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
  hf = make_family_model(tmp_path / "hf", "qwen2", rope_parameters=rope)
  hf_import.from_hf(tmp_path / "hf", tmp_path / "mt")
  source = open_source(tmp_path / "mt")
  assert (source.model["rope_scaling"], source.model["rope_scaling_factor"]) == ("linear", 4.0)
  x = np.random.default_rng(0).integers(0, VOCAB, (2, 24))
  with torch.no_grad():
    want = hf(torch.tensor(x)).logits.numpy()
  assert np.abs(maxtrain_logits(maxtrain_model(source), x)[..., :VOCAB] - want).max() <= TOL
  hf_export.to_hf(tmp_path / "mt", tmp_path / "hf2")
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2").eval()
  with torch.no_grad():
    assert np.abs(back(torch.tensor(x)).logits.numpy() - want).max() <= TOL


# What a tiny run of a family with published defaults (model.family=gpt_oss alone is gpt-oss-20b) sets besides
# TINY_MODEL's widths: a byte-sized vocabulary, short RoPE tables, 2 experts a token (the families' RoPE stays).
TINY_SHAPES = ["--config.model.vocab_size=384", "--config.model.max_seq_len=256",
               "--config.model.moe.experts_per_token=2"]


def test_a_moe_family_trains_through_the_entry_point(store, tmp_path, capsys):
  """qwen3_moe (qk-norm, every layer 4 experts, top 2 not renormalised, dropless dispatch): the real entry
  point trains it and the loss falls; the MoE statistics reach TensorBoard."""
  from tiny import TINY_MODEL

  out = tmp_path / "run"
  args = TINY_MODEL + TINY_SHAPES + [f"--config.data.path={store}", "--config.steps=8", f"--config.output_dir={out}",
                       "--config.log_every=2", "--config.model.family=qwen3_moe", "--config.model.head_dim=16",
                       "--config.model.moe.num_experts=4", "--config.model.moe.experts_per_token=2",
                       "--config.model.moe.expert_d_ff=32", "--config.model.moe.norm_topk_prob=False",
                       "--config.model.moe.dispatch=dropless", "--config.optimizer.lr=0.01",
                       "--config.optimizer.warmup_steps=1"]
  losses, events = train_losses(args, out, capsys)
  assert len(losses) == 4 and losses[-1] < losses[0] - 0.3, losses
  assert any("moe" in tag for tag in events.Tags()["scalars"]), events.Tags()["scalars"]


def test_attention_sinks_in_dot_and_flash_match_the_reference():
  """GPT-OSS's sinks (one logit per head joining each row's softmax normaliser, no value) with a window of 21
  over T = 72 and two documents: dot and flash against NumPy (values), flash's gradients (q, k, v and the
  sinks) against the dot kernel's autodiff; the sinks matter (without them the output differs)."""
  t, window = 72, 21
  rng = np.random.default_rng(7)
  b, n, kv, h = 2, 4, 2, 8
  q, k, v = (rng.standard_normal((b, t, m, h)).astype(np.float32) for m in (n, kv, kv))
  sinks = rng.standard_normal(n).astype(np.float32) + 1.0
  segments = np.ones((b, t), np.int32)
  segments[1, t // 3:] = 2
  # NumPy: the reference's weights times the share left over by the sink column
  g = n // kv
  kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  scores = np.einsum("bqnh,bknh->bnqk", q, kk) / np.sqrt(h)
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  visible = (j <= i) & (i - j < window) & (segments[:, :, None] == segments[:, None, :])[:, None]
  scores = np.where(visible, scores, -np.inf)
  full = np.concatenate([scores, np.broadcast_to(sinks[None, :, None, None], (b, n, t, 1))], -1)
  p = np.exp(full - full.max(-1, keepdims=True))
  p = (p / p.sum(-1, keepdims=True))[..., :-1]
  want = np.einsum("bnqk,bknh->bqnh", p, vv)
  kernels = {"dot": lambda q, k, v, s: dot_product_attention(q, k, v, jnp.asarray(segments), window=window, sinks_N=s),
             "flash": lambda q, k, v, s: fa.flash_attention(q, k, v, jnp.asarray(segments), block_q=16, block_kv=16,
                                                            window=window, sinks_N=s)}
  cotangent = jnp.asarray(rng.standard_normal(q.shape).astype(np.float32))
  grads = {}
  for name, kernel in kernels.items():
    out, vjp = jax.vjp(kernel, q, k, v, sinks)
    np.testing.assert_allclose(np.asarray(out), want, rtol=0, atol=2e-5, err_msg=name)
    grads[name] = vjp(cotangent)
  assert np.abs(want - _window_reference(q, k, v, segments, window)).max() > 1e-2  # the sinks change the output
  for a, b_ in zip(grads["flash"], grads["dot"]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=0, atol=1e-4 * np.abs(np.asarray(b_)).max())
  assert np.abs(np.asarray(grads["dot"][3])).max() > 1e-3  # the sinks get a gradient


GPT_OSS_KEYS = TINY_SHAPES + ["--config.model.family=gpt_oss", "--config.model.head_dim=16", "--config.model.sliding_window=8",
                "--config.model.moe.num_experts=4", "--config.model.moe.expert_d_ff=32",
                "--config.model.moe.activation=clamped_swiglu", "--config.model.moe.expert_bias=True",
                "--config.model.moe.dispatch=dropless", "--config.model.moe.swiglu_limit=2.0",
                "--config.model.attention_block_q=8", "--config.model.attention_block_kv=8"]


def test_gpt_oss_trains_through_the_entry_point(store, tmp_path, capsys):
  """gpt_oss with a window of 8 < data.seq_len = 32 on its even layers, sinks, every bias and the clamped SwiGLU,
  under the flash kernel: the entry point trains it and the loss falls."""
  from tiny import TINY_MODEL

  out = tmp_path / "run"
  args = TINY_MODEL + GPT_OSS_KEYS + [f"--config.data.path={store}", "--config.steps=6", f"--config.output_dir={out}",
                                      "--config.log_every=2", "--config.model.attention=flash",
                                      "--config.optimizer.lr=0.01", "--config.optimizer.warmup_steps=1"]
  losses, _ = train_losses(args, out, capsys)
  assert len(losses) == 3 and losses[-1] < losses[0] - 0.3, losses


def test_gpt_oss_flash_equals_dot():
  """The same random gpt_oss model (sinks non-zero, window 12 < T = 64 on layer 0, two documents) under dot and
  flash: the same loss (rtol 1e-5) and gradients, the sinks' included."""
  moe = dict(num_experts=4, experts_per_token=2, expert_d_ff=32, activation="clamped_swiglu", expert_bias=True,
             dispatch="dropless", swiglu_limit=2.0)
  grads = assert_flash_equals_dot(lambda kernel: _model("gpt_oss", sliding_window=12, head_dim=16, attention=kernel,
                                                        attention_block_q=16, attention_block_kv=16,
                                                        moe={**base_moe(), **moe}))
  assert any("sinks" in str(p) for p, _ in jax.tree_util.tree_leaves_with_path(grads))


def test_deepseek_v3_flash_equals_dot():
  """The same random deepseek_v3 model (MLA: v narrower than q.k, padded for the kernels; YaRN's softmax mscale;
  two documents) under dot and flash: the same loss (rtol 1e-5) and gradients."""
  moe = dict(num_experts=4, experts_per_token=2, expert_d_ff=32, router="sigmoid", first_dense_layers=1,
             num_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, dispatch="dropless")
  mla = dict(kv_lora_rank=16, q_lora_rank=24, rope_head_dim=8, nope_head_dim=16, v_head_dim=12, rope_interleave=True,
             softmax_mscale=1.2, latent_cache=False)
  assert_flash_equals_dot(lambda kernel: _model("deepseek_v3", attention=kernel, attention_block_q=16,
                                                attention_block_kv=16, moe={**base_moe(), **moe}, mla=mla))


def assert_flash_equals_dot(make):
  """One random model (`make(kernel)`: its config under `dot` or `flash`) on two packed documents: the same
  loss (rtol 1e-5) and gradients (1e-4 of each leaf's largest) under both kernels; returns dot's gradients."""
  from flax import nnx

  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 128, (2, 64))
  segments = np.ones((2, 64), np.int32)
  segments[0, 40:] = 2
  positions = np.where(segments == 2, np.arange(64) - 40, np.arange(64))
  _, params = registry.abstract(make("dot"))
  params = jax.tree.map(lambda a: jnp.asarray(0.1 * rng.standard_normal(a.shape), a.dtype), params)
  losses, grads = {}, {}
  for kernel in ("dot", "flash"):
    graphdef, _ = registry.abstract(make(kernel))

    def loss(p):
      logits = nnx.merge(graphdef, p)(tokens[:, :-1], segments[:, :-1], positions[:, :-1])
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

    losses[kernel], grads[kernel] = jax.jit(jax.value_and_grad(loss))(params)
  np.testing.assert_allclose(float(losses["flash"]), float(losses["dot"]), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads["flash"]), jax.tree.leaves(grads["dot"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-4 * np.abs(np.asarray(b)).max() + 1e-9)
  return grads["dot"]


def base_moe() -> dict:
  from maxtrain import config as config_lib

  return config_lib.base_config().model.moe.to_dict()


DEEPSEEK_KEYS = TINY_SHAPES + [
    "--config.model.family=deepseek_v3", "--config.model.mla.kv_lora_rank=16", "--config.model.mla.q_lora_rank=16",
    "--config.model.mla.rope_head_dim=8", "--config.model.mla.nope_head_dim=8", "--config.model.mla.v_head_dim=8",
    "--config.model.moe.num_experts=4", "--config.model.moe.router=sigmoid", "--config.model.moe.first_dense_layers=1",
    "--config.model.moe.num_shared_experts=1", "--config.model.moe.n_group=2", "--config.model.moe.topk_group=1",
    "--config.model.moe.routed_scaling_factor=2.5", "--config.model.moe.expert_d_ff=32",
    "--config.model.moe.dispatch=dropless", "--config.model.moe.bias_update_rate=0.001"]


def test_deepseek_v3_trains_through_the_entry_point(store, tmp_path, capsys):
  """deepseek_v3: MLA (q and kv latents, a RoPE head of 8), one dense layer, then 4 sigmoid-routed experts in 2
  groups (one competes per token), a shared expert, routed_scaling_factor 2.5, the aux-loss-free bias moving:
  the entry point trains it and the loss falls."""
  from tiny import TINY_MODEL

  out = tmp_path / "run"
  args = TINY_MODEL + DEEPSEEK_KEYS + [f"--config.data.path={store}", "--config.steps=6", f"--config.output_dir={out}",
                              "--config.log_every=2", "--config.optimizer.lr=0.01", "--config.optimizer.warmup_steps=1"]
  losses, _ = train_losses(args, out, capsys)
  assert len(losses) == 3 and losses[-1] < losses[0] - 0.3, losses


def test_moe_families_flops_count_their_attention():
  """FLOPs per token: deepseek_v3 counts MLA's projections and q.k / p.v widths (against a hand count), gpt_oss
  windows half its layers (between the all-windowed and the unwindowed counts, at their mean for 2 layers),
  gemma3 five of its six."""
  import math

  moe = {**base_moe(), "num_experts": 4, "dispatch": "dropless"}
  mla = dict(kv_lora_rank=16, q_lora_rank=24, rope_head_dim=8, nope_head_dim=16, v_head_dim=12, rope_interleave=True,
             softmax_mscale=1.0)
  ds = _model("deepseek_v3", moe={**moe, "router": "sigmoid"}, mla=mla)
  plain = dataclasses.replace(ds, family="llama", mla=dataclasses.replace(ds.mla, kv_lora_rank=0))
  d, n, T = 64, 4, 64
  gqa = 6 * 2 * (2 * d * n * 16 + 2 * d * 2 * 16) + 2 * 6 * n * 16 * (T + 1)  # 4 query, 2 kv heads of 16
  mla_params = d * 24 + 24 * n * 24 + d * (16 + 8) + 16 * n * 28 + n * 12 * d
  want = registry.flops_per_token(plain, T) - gqa + 6 * 2 * mla_params + 2 * 3 * n * (24 + 12) * (T + 1)
  assert math.isclose(registry.flops_per_token(ds, T), want, rel_tol=1e-12)
  oss = _model("gpt_oss", sliding_window=8, moe={**moe, "activation": "clamped_swiglu", "expert_bias": True})
  all_windowed, unwindowed = oss.train_flops_per_token(T), dataclasses.replace(oss, sliding_window=0).train_flops_per_token(T)
  assert all_windowed < registry.flops_per_token(oss, T) < unwindowed
  assert math.isclose(registry.flops_per_token(oss, T), (all_windowed + unwindowed) / 2)
  gemma3 = _model("gemma3", sliding_window=8, num_layers=6)  # its default pattern: 5 local layers, 1 global
  all_windowed, unwindowed = gemma3.train_flops_per_token(T), dataclasses.replace(gemma3, sliding_window=0).train_flops_per_token(T)
  assert math.isclose(registry.flops_per_token(gemma3, T), unwindowed + (all_windowed - unwindowed) * 5 / 6)


def test_mla_latent_cache_decode_equals_the_uncompressed_one():
  """A random deepseek_v3 model (YaRN's softmax mscale on) decodes a left-padded prompt then 6 tokens with the
  expanded k/v cache and with the latent cache (wkv_b absorbed): the same logits at every step (atol 1e-5), and
  the latent cache holds kv_lora_rank + rope_head_dim values per token per layer."""
  from flax import nnx

  moe = {**base_moe(), "num_experts": 4, "dispatch": "dropless", "router": "sigmoid", "first_dense_layers": 1,
         "num_shared_experts": 1}
  mla = dict(kv_lora_rank=16, q_lora_rank=24, rope_head_dim=8, nope_head_dim=16, v_head_dim=12, rope_interleave=True,
             softmax_mscale=1.2, latent_cache=False)
  cfgs = {latent: _model("deepseek_v3", moe=moe, mla={**mla, "latent_cache": latent}) for latent in (False, True)}
  rng = np.random.default_rng(3)
  _, params = registry.abstract(cfgs[False])
  params = jax.tree.map(lambda a: jnp.asarray(0.2 * rng.standard_normal(a.shape), a.dtype), params)
  prompt = jnp.asarray(rng.integers(0, 128, (2, 9)))
  valid = jnp.ones((2, 9), bool).at[1, :3].set(False)  # row 1 left-padded
  steps = jnp.asarray(rng.integers(0, 128, (6, 2, 1)))
  logits = {}
  for latent, cfg in cfgs.items():
    model = nnx.merge(registry.abstract(cfg)[0], params)
    decode = nnx.jit(lambda m, t, v, c: m.decode(t, v, c))
    cache = model.init_cache(2, 16)
    out, cache = decode(model, prompt, valid, cache)
    got = [out[:, -1]]
    for tok in steps:
      out, cache = decode(model, tok, jnp.ones((2, 1), bool), cache)
      got.append(out[:, -1])
    logits[latent] = np.stack(got)
    if latent:
      per_token = sum(x.shape[-1] for x in jax.tree.leaves(cache.kv["moe_blocks"]))
      assert per_token == 16 + 8, per_token
  np.testing.assert_allclose(logits[True], logits[False], rtol=0, atol=1e-5)


def test_gemma2_trains_through_the_entry_point(store, tmp_path, capsys):
  """gemma2 (Gemma's norms, GELU-tanh GLU, embedding scale, query_pre_attn_scalar) with a window of 8 <
  data.seq_len = 32 on its even layers and both soft-caps on, kernel auto (flash: soft-capped), the chunked loss
  forced on (its capped backward): the entry point trains it and the loss falls."""
  from tiny import TINY_MODEL

  out = tmp_path / "run"
  args = TINY_MODEL + ["--config.model.family=gemma2", "--config.model.head_dim=16", "--config.model.sliding_window=8",
                       "--config.model.query_pre_attn_scalar=12", "--config.model.attn_logit_softcap=50.0",
                       "--config.model.final_logit_softcap=30.0", "--config.model.tie_embeddings=True",
                       "--config.model.loss_chunk_tokens=16", f"--config.data.path={store}", "--config.steps=6",
                       f"--config.output_dir={out}", "--config.log_every=2", "--config.optimizer.lr=0.01",
                       "--config.optimizer.warmup_steps=1"]
  losses, _ = train_losses(args, out, capsys)
  assert len(losses) == 3 and losses[-1] < losses[0] - 0.3, losses


def test_gemma3_trains_through_the_entry_point(store, tmp_path, capsys):
  """gemma3 (Gemma 2's pieces, (1 + w) qk-norm) with 3 layers of pattern 3 (local, local, global), a window of 8 <
  data.seq_len = 32 on the local layers, a local RoPE base beside the global one, under the flash kernel: the
  entry point trains it and the loss falls."""
  from tiny import TINY_MODEL

  out = tmp_path / "run"
  args = TINY_MODEL + ["--config.model.family=gemma3", "--config.model.num_layers=3", "--config.model.head_dim=16",
                       "--config.model.sliding_window=8", "--config.model.window_pattern=3",
                       "--config.model.rope_theta=1000000.0", "--config.model.rope_local_theta=10000.0",
                       "--config.model.tie_embeddings=True", "--config.model.attention=flash",
                       "--config.model.attention_block_q=8", "--config.model.attention_block_kv=8",
                       f"--config.data.path={store}", "--config.steps=6", f"--config.output_dir={out}",
                       "--config.log_every=2", "--config.optimizer.lr=0.01", "--config.optimizer.warmup_steps=1"]
  losses, _ = train_losses(args, out, capsys)
  assert len(losses) == 3 and losses[-1] < losses[0] - 0.3, losses


def test_gemma3_context4_equals_context1(monkeypatch):
  """The same random gemma3 model (3 layers of pattern 3: a window of 12 < T = 64 on two, two documents per row)
  on fsdp=2 x context=4 (the zigzag token order, flash on each shard against gathered keys, the window a mask
  on explicit positions) and unsharded: the same loss (rtol 1e-5) and gradients."""
  from flax import nnx

  from maxtrain.sharding import context_attention as ca
  from maxtrain.sharding import rules as rules_lib
  from maxtrain.sharding.mesh import make_mesh

  rng = np.random.default_rng(5)
  tokens = rng.integers(0, 128, (2, 65))
  segments = np.ones((2, 65), np.int32)
  segments[0, 40:] = 2
  positions = np.where(segments == 2, np.arange(65) - 40, np.arange(65))
  cfg = _model("gemma3", sliding_window=12, attention="flash", attention_block_q=8, attention_block_kv=8,
               **GEMMA3_KEYS)
  graphdef, params = registry.abstract(cfg)
  params = jax.tree.map(lambda a: jnp.asarray(0.1 * rng.standard_normal(a.shape), a.dtype), params)

  def loss(p, inputs, targets, seg, pos, graphdef=graphdef):
    logits = nnx.merge(graphdef, p)(inputs, seg, pos)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

  args = (tokens[:, :-1], tokens[:, 1:], segments[:, :-1], positions[:, :-1])
  want, want_grads = jax.jit(jax.value_and_grad(loss))(params, *args)
  laid_out, _ = registry.abstract(cfg, parallel=rules_lib.Parallel.of(rules_lib.DEFAULT_RULES))  # the builder's model
  mesh = make_mesh({"data": 1, "fsdp": 2, "context": 4, "tensor": 1}, jax.devices()[:8])
  order = ca.zigzag_order(64, 4)
  traced = []  # the shards of every context-parallel attention traced
  sharded = ca.sharded
  monkeypatch.setattr(ca, "sharded", lambda mesh, rules, **kw: traced.append(mesh.shape["context"]) or
                      sharded(mesh, rules, **kw))
  with jax.set_mesh(mesh):
    got, grads = jax.jit(jax.value_and_grad(functools.partial(loss, graphdef=laid_out)))(
        params, *(jnp.asarray(a[:, order]) for a in args))
  assert traced and set(traced) == {4}
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-4 * np.abs(np.asarray(b)).max() + 1e-9)


# The published config.json of each family with defaults (the fields from-hf reads; Hugging Face hub copies).
PUBLISHED = {
    "deepseek_v3": {  # deepseek-ai/DeepSeek-V3
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
        "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
        "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
        "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "rope_theta": 10000, "attention_bias": False,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"}},
    "gpt_oss": {  # openai/gpt-oss-20b
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "vocab_size": 201088,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 150000, "sliding_window": 128,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "swiglu_limit": 7.0, "tie_word_embeddings": False, "router_aux_loss_coef": 0.9, "attention_bias": True,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "hidden_act": "silu"},
    "qwen3_moe": {  # Qwen/Qwen3-30B-A3B
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_scaling": None, "tie_word_embeddings": False,
        "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 48,
        "hidden_act": "silu"},
}


def _model_key(cfg, key: str):
  node = cfg.model
  for part in key.split("."):
    node = node[part]
  return node


def test_a_family_alone_is_its_published_model(tmp_path):
  """`model.family=X` alone gives the published model (the family's defaults, equal to what from-hf makes of
  the published config.json); a key on the command line or in a config file overrides its default, also one
  set to base_config()'s own value; llama (the default run) has no defaults: its config is base_config()."""
  from maxtrain import config as config_lib
  from maxtrain.config.loader import family_defaults
  from maxtrain.interop import hf_config

  assert family_defaults(registry.DEFAULT) == {}  # the default run's config is as it was
  assert {f for f in registry.names() if registry.get(f).defaults} == set(PUBLISHED)
  for family in registry.names():
    defaults = registry.get(family).defaults
    assert family_defaults(family) == defaults, family  # the loader's reading of the literal = the registry's
    cfg = config_lib.load([f"--config.model.family={family}"])
    assert {k: _model_key(cfg, k) for k in defaults} == defaults, family
    if family in PUBLISHED:
      imported = hf_config.to_model_keys(PUBLISHED[family], family, vocab_multiple=1)
      flat = {**{k: v for k, v in imported.items() if not isinstance(v, dict)},
              **{f"{s}.{k}": v for s in ("moe", "mla") for k, v in (imported.get(s) or {}).items()}}
      assert {k: flat.get(k, _model_key(config_lib.base_config(), k)) for k in defaults} == pytest.approx(defaults)
      registry.validate(cfg.model)  # the published model is a valid config
  cfg = config_lib.load(["--config.model.family=gpt_oss", "--config.model.d_model=64", "--config.model.moe.num_experts=4"])
  assert (cfg.model.d_model, cfg.model.moe.num_experts, cfg.model.num_heads) == (64, 4, 64)
  preset = tmp_path / "tiny_oss.py"
  preset.write_text("from maxtrain.config import base_config\n\n\ndef get_config():\n  c = base_config()\n"
                    "  c.model.family = 'gpt_oss'\n  c.model.num_kv_heads = 2  # base_config()'s value, set on purpose\n"
                    "  c.model.moe.expert_d_ff = 32\n  return c\n")
  for argv in ([f"--config={preset}"], [f"--config={preset}", "--config.model.family=gpt_oss"]):
    cfg = config_lib.load(argv)
    assert (cfg.model.num_kv_heads, cfg.model.moe.expert_d_ff, cfg.model.d_model, cfg.model.sliding_window) == (
        2, 32, 2880, 128), argv
  cfg = config_lib.load([f"--config={preset}", "--config.model.family=llama"])  # the command line's family wins
  assert (cfg.model.family, cfg.model.d_model, cfg.model.moe.expert_d_ff) == ("llama", 256, 32)
