"""LLaMA-style dense decoder: embed -> [RMSNorm -> GQA -> RMSNorm -> SwiGLU] x L -> RMSNorm -> head.

Shape legend: B batch, T length, D model, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.errors import choice, require
from maxtrain.models import attention
from maxtrain.models.attention import Attention
from maxtrain.models.layers import MLP, RMSNorm, Rope, param, project
from maxtrain.sharding import rules as sharding_rules

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # Keep matmul outputs, recompute the cheap elementwise work in the backward pass.
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
REMAT_CHOICES = tuple(REMAT_POLICIES)
ROPE_SCALINGS = ("none", "llama3")
DTYPES = ("float32", "bfloat16", "float16")
# The config key that sets each logical parameter dim: what a layout error tells the user to change.
CONFIG_KEYS = {"heads": "model.num_heads", "kv_heads": "model.num_kv_heads", "mlp": "model.d_ff",
               "vocab": "model.vocab_size", "embed": "model.d_model", "layers": "model.num_layers"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  num_layers: int
  d_model: int
  num_heads: int
  num_kv_heads: int
  d_ff: int
  vocab_size: int
  max_seq_len: int
  rope_theta: float = 10000.0
  rope_scaling: str = "none"
  rope_scaling_factor: float = 8.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_len: int = 8192
  tie_embeddings: bool = False
  scan_layers: bool = True
  scan_unroll: int = 1
  remat: str = "none"
  attention: str = "dot"  # a kernel of models/attention.py (the config's "auto" is resolved there)
  attention_block_q: int = 128
  attention_block_kv: int = 128
  norm_eps: float = 1e-5
  init_std: float = 0.02
  param_dtype: Any = jnp.float32
  compute_dtype: Any = jnp.float32

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def rope(self) -> Rope:
    return Rope(theta=self.rope_theta, scaling=self.rope_scaling, factor=self.rope_scaling_factor,
                low_freq_factor=self.rope_low_freq_factor, high_freq_factor=self.rope_high_freq_factor,
                original_max_len=self.rope_original_max_len)

  def train_flops_per_token(self, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward = 3 x forward).

    Matmuls: 6 x (matmul parameters), the embedding lookup excluded, the output head included.
    Attention scores and values: causal, so each query attends to (T + 1) / 2 keys on average:
    2 matmuls x 2 FLOPs x N x H x (T + 1) / 2 forward, x 3 for training. Norms, RoPE and softmax
    are not counted (they are not matmuls; the convention of PaLM's MFU).
    """
    n, k, h, d = self.num_heads, self.num_kv_heads, self.head_dim, self.d_model
    per_layer = d * n * h * 2 + d * k * h * 2 + 3 * d * self.d_ff
    matmul_params = self.num_layers * per_layer + d * self.vocab_size
    attention = self.num_layers * 3 * 2 * n * h * (seq_len + 1)
    return 6.0 * matmul_params + attention

  @classmethod
  def from_config(cls, model_cfg) -> "ModelConfig":
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in model_cfg.items() if k in fields}
    for key in ("param_dtype", "compute_dtype"):
      if key in kwargs:
        kwargs[key] = jnp.dtype(kwargs[key])
    return cls(**kwargs)


def validate(m: Any) -> None:
  """UserError naming the key for a bad `config.model`."""
  for key in ("num_layers", "d_model", "num_heads", "num_kv_heads", "d_ff", "vocab_size", "max_seq_len"):
    require(m[key] > 0, f"config.model.{key}={m[key]}: must be > 0")
  require(m.d_model % m.num_heads == 0,
          f"config.model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}")
  require((m.d_model // m.num_heads) % 2 == 0,
          f"head_dim = model.d_model / model.num_heads = {m.d_model // m.num_heads} must be even for RoPE")
  require(m.num_heads % m.num_kv_heads == 0,
          f"config.model.num_heads={m.num_heads} is not divisible by model.num_kv_heads={m.num_kv_heads}")
  require(m.loss_chunk_tokens >= -1, f"config.model.loss_chunk_tokens={m.loss_chunk_tokens}: use a chunk size > 0, "
          "0 (off) or -1 (auto)")
  require(m.scan_unroll >= 1, f"config.model.scan_unroll={m.scan_unroll}: must be >= 1 (1 = a rolled loop)")
  choice("model.remat", m.remat, REMAT_CHOICES)
  choice("model.rope_scaling", m.rope_scaling, ROPE_SCALINGS)
  require(m.norm_eps > 0, f"config.model.norm_eps={m.norm_eps}: must be > 0")
  if m.rope_scaling == "llama3":
    require(m.rope_high_freq_factor > m.rope_low_freq_factor > 0 and m.rope_scaling_factor > 0
            and m.rope_original_max_len > 0,
            f"config.model.rope_*: llama3 scaling needs rope_high_freq_factor={m.rope_high_freq_factor} > "
            f"rope_low_freq_factor={m.rope_low_freq_factor} > 0, rope_scaling_factor={m.rope_scaling_factor} > 0 "
            f"and rope_original_max_len={m.rope_original_max_len} > 0")
  choice("model.attention", m.attention, attention.CHOICES)
  for key in ("attention_block_q", "attention_block_kv"):
    require(m[key] > 0, f"config.model.{key}={m[key]}: must be > 0")
  for key in ("param_dtype", "compute_dtype"):
    choice(f"model.{key}", m[key], DTYPES)


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    # GPT-2/LLaMA practice: shrink residual-branch outputs with depth so activations stay O(1).
    out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
    common = dict(init_std=cfg.init_std, out_std=out_std, param_dtype=cfg.param_dtype,
                  compute_dtype=cfg.compute_dtype, rngs=rngs)
    self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype, rngs=rngs)
    self.attn = Attention(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, rope_theta=cfg.rope,
                          kernel=cfg.attention, block_q=cfg.attention_block_q, block_kv=cfg.attention_block_kv,
                          **common)
    self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype, rngs=rngs)
    self.mlp = MLP(cfg.d_model, cfg.d_ff, **common)

  def __call__(self, x_BTD, segment_ids_BT, positions_BT):
    x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), segment_ids_BT, positions_BT)
    x_BTD = x_BTD + self.mlp(self.mlp_norm(x_BTD))
    return sharding_rules.constrain(x_BTD, ("act_batch", "act_length", "act_embed"))


class Llama(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    # Parameters and activations carry logical names only; placement is decided by the rules the
    # step activates (`sharding/rules.py`) and the jit that creates the sharded train state.
    with nnx.use_eager_sharding(False):
      self._build(cfg, rngs)

  def _build(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
    self.cfg = cfg
    self.embed = param(rngs, nnx.initializers.normal(cfg.init_std), (cfg.vocab_size, cfg.d_model),
                       ("vocab", "embed"), cfg.param_dtype)
    if cfg.scan_layers:
      # One stacked Block whose parameters have a leading `layers` dim: the step compiles one
      # layer body and scans it, so compile time does not grow with depth.
      @nnx.split_rngs(splits=cfg.num_layers)
      @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=cfg.num_layers,
                transform_metadata={nnx.PARTITION_NAME: "layers"})
      def make_blocks(rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs)

      self.blocks = make_blocks(rngs)
    else:
      self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype, rngs=rngs)
    if not cfg.tie_embeddings:
      self.head = param(rngs, nnx.initializers.normal(cfg.init_std), (cfg.d_model, cfg.vocab_size),
                        ("embed", "vocab"), cfg.param_dtype)

  def __call__(self, tokens_BT: jax.Array, segment_ids_BT: jax.Array, positions_BT: jax.Array) -> jax.Array:
    """Returns fp32 logits [B, T, V] (training computes the loss from `features` and `head_weights`
    instead, in chunks when the vocabulary is large: maxtrain/loss.py)."""
    x_BTD = self.features(tokens_BT, segment_ids_BT, positions_BT)
    logits_BTV = project(x_BTD, self.head_weights().astype(self.cfg.compute_dtype), preferred_element_type=jnp.float32)
    return sharding_rules.constrain(logits_BTV, ("act_batch", "act_length", "act_vocab"))

  def head_weights(self) -> jax.Array:
    """The output head [D, V] at the parameter dtype (the embedding transposed when tied)."""
    return self.embed[...].T if self.cfg.tie_embeddings else self.head[...]

  def features(self, tokens_BT: jax.Array, segment_ids_BT: jax.Array, positions_BT: jax.Array) -> jax.Array:
    """The final-norm hidden states [B, T, D] in the compute dtype: the output head's input."""
    cfg = self.cfg
    x_BTD = self.embed[...].astype(cfg.compute_dtype)[tokens_BT]
    x_BTD = sharding_rules.constrain(x_BTD, ("act_batch", "act_length", "act_embed"))

    def apply_block(x_BTD, block_state, graphdef):
      return nnx.merge(graphdef, block_state)(x_BTD, segment_ids_BT, positions_BT)

    policy = REMAT_POLICIES[cfg.remat]
    if policy is not None:
      apply_block = jax.checkpoint(apply_block, policy=policy, static_argnums=(2,))

    if cfg.scan_layers:
      graphdef, stacked = nnx.split(self.blocks)
      x_BTD, _ = jax.lax.scan(lambda x, s: (apply_block(x, s, graphdef), None), x_BTD, stacked,
                              unroll=min(cfg.scan_unroll, cfg.num_layers))
    else:
      for block in self.blocks:
        graphdef, state = nnx.split(block)
        x_BTD = apply_block(x_BTD, state, graphdef)

    return self.final_norm(x_BTD)


def param_count(state: nnx.State) -> int:
  return sum(x.size for x in jax.tree.leaves(state))
