"""The shared decoder of every family: embed -> [RMSNorm -> GQA -> RMSNorm -> SwiGLU or MoE] x L -> RMSNorm -> head.

A family (`models/registry.py`) is this decoder with some of its pieces on, each a `model.*` key any family
may set: q/k/v biases (`qkv_bias`), per-head RMS qk-norm (`qk_norm`), a head_dim independent of d_model /
num_heads (`head_dim`), sliding-window attention (`sliding_window`, on the layers of the family's pattern).

The layers form up to two stacks: `blocks` (dense SwiGLU: all layers of a dense model, the first
`model.moe.first_dense_layers` of a MoE one) then `moe_blocks` (mixture of experts, `models/moe.py`).
Each stack is scanned on its own (`model.scan_layers`), so compile time stays independent of depth.
`model.mtp_layers` > 0 adds multi-token-prediction depths after them (`mtp`, models/mtp.py): `mtp_features` in
training, `mtp_decode` over its own cache as a speculative draft.

One model, several modes: training and evaluation call the model on whole sequences; generation
(`inference/sampling.py`) calls `decode` with a KV cache (`init_cache`): a prefill of the prompts, then
one token per call, through the same Blocks and Attention (`models/attention/layer.py`).

Shape legend: B batch, T length, S cache slots, D model, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxtrain.config.keys import check_known
from maxtrain.errors import choice, require
from maxtrain.models.attention import layer as attention
from maxtrain.models import mla as mla_lib
from maxtrain.models import moe as moe_lib
from maxtrain.models import mtp as mtp_lib
from maxtrain.models import quant as quant_lib
from maxtrain.models.attention.layer import Attention, CacheWrite, KVCache
from maxtrain.models.layers import ACTIVATIONS, MLP, RMSNorm, Rope, param, project
from maxtrain.models.moe import MoE, MoEConfig
from maxtrain.models import stack as stack_lib
from maxtrain.sharding import pipeline as pipeline_lib
from maxtrain.sharding.rules import NONE, Parallel

# Activations a Block names (jax.ad_checkpoint.checkpoint_name) for `model.remat=offload`: saved to host
# memory in the forward pass and brought back for the backward; the rest of the layer is recomputed.
OFFLOADED = ("attn_out", "mlp_in", "residual")
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # Keep matmul outputs, recompute the cheap elementwise work in the backward pass.
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(OFFLOADED), offload_src="device",
        offload_dst="pinned_host"),
}
# auto: the program builder picks one of the above for the target (maxtrain/program/fit.py) before the model is built.
REMAT_CHOICES = (*REMAT_POLICIES, "auto")
ROPE_SCALINGS = ("none", "llama3", "linear", "yarn")
DTYPES = ("float32", "bfloat16", "float16")
# The config key that sets each logical parameter dim: what a layout error tells the user to change.
CONFIG_KEYS = {"heads": "model.num_heads", "kv_heads": "model.num_kv_heads", "mlp": "model.d_ff",
               "vocab": "model.vocab_size", "embed": "model.d_model", "layers": "model.num_layers",
               "experts": "model.moe.num_experts", "expert_embed": "model.d_model", "expert_mlp": "model.moe.expert_d_ff"}


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
  rope_beta_fast: float = 32.0
  rope_beta_slow: float = 1.0
  rope_truncate: bool = True
  rope_attention_factor: float = 0.0
  family: str = "llama"  # the registry entry (models/registry.py) whose pieces and HF adapter this is
  head_dim_setting: int = 0  # model.head_dim; 0: d_model / num_heads
  qkv_bias: bool = False
  qk_norm: bool = False
  attention_sinks: bool = False  # GPT-OSS: a learned softmax-normaliser logit per head
  o_bias: bool = False  # a bias on the attention output projection (GPT-OSS)
  sliding_window: int = 0  # tokens a query sees (itself included) on window layers; 0: off
  window_layers: str = "all"  # which layers use the window: the family's pattern (registry.Family)
  # model.window_pattern: layer i is global (full attention) iff (i + 1) % it == 0, the others local (windowed);
  # Gemma 3: 6 (5 local : 1 global). 0: the family's window_layers. Set by the key, or by the family's default.
  window_pattern: int = 0
  rope_local_theta: float = 0.0  # the RoPE base of local layers, plain (no rope_scaling); 0: the global RoPE
  # Gemma's pieces (any family): (1 + w) RMSNorm, norms after attention and after the MLP too, the embedding
  # times sqrt(d_model), scores scaled by query_pre_attn_scalar^-1/2 (0: head_dim's), GELU-tanh GLU, tanh
  # soft-capping of the attention scores and of the output logits (0: off)
  norm_one_plus: bool = False
  post_norms: bool = False
  embed_scale: bool = False
  query_pre_attn_scalar: float = 0.0
  mlp_activation: str = "silu"
  attn_logit_softcap: float = 0.0
  final_logit_softcap: float = 0.0
  tie_embeddings: bool = False
  scan_layers: bool = True
  scan_unroll: int = 1
  remat: str = "none"
  attention: str = "dot"  # a kernel of models/attention/layer.py (the config's "auto" is resolved there)
  attention_block_q: int = 128
  attention_block_kv: int = 128
  norm_eps: float = 1e-5
  init_std: float = 0.02
  param_dtype: Any = jnp.float32
  compute_dtype: Any = jnp.float32
  moe: MoEConfig = MoEConfig()
  mla: mla_lib.MLAConfig = mla_lib.MLAConfig()  # model.mla.*: multi-head latent attention when kv_lora_rank > 0
  quant: quant_lib.QuantConfig = quant_lib.QuantConfig()  # model.quantization and model.quant_*
  mtp_layers: int = 0  # multi-token prediction depths (models/mtp.py); 0: none
  mtp_loss_weight: float = 0.3  # their loss's weight in the objective (DeepSeek-V3: 0.3, then 0.1)
  # Not a config key: set only by ahead-of-time compiles (program/fit.py memory_standin), never for a run.
  memory_standin: bool = False

  @property
  def head_dim(self) -> int:
    return self.head_dim_setting or self.d_model // self.num_heads

  def is_local(self, layer: int) -> bool:
    """Whether layer `layer` is a local (window) layer of the pattern, whatever the window's size."""
    if self.window_pattern:  # Gemma 3 (6): five local layers, then one global
      return (layer + 1) % self.window_pattern != 0
    if self.window_layers == "alternate":  # GPT-OSS, Gemma 2: even layers windowed, odd ones full
      return layer % 2 == 0
    return True

  def layer_window(self, layer: int) -> int:
    """The sliding window of layer `layer` (0: full causal attention)."""
    return self.sliding_window if self.is_local(layer) else 0

  def layer_rope(self, layer: int) -> Rope:
    """Layer `layer`'s RoPE: a local layer's own base (`rope_local_theta`, unscaled: Gemma 3's 10k beside its
    global 1M with linear scaling) when set, else the model's."""
    if self.rope_local_theta and self.is_local(layer):
      return Rope(theta=self.rope_local_theta)
    return self.rope

  @property
  def rope(self) -> Rope:
    return Rope(theta=self.rope_theta, scaling=self.rope_scaling, factor=self.rope_scaling_factor,
                low_freq_factor=self.rope_low_freq_factor, high_freq_factor=self.rope_high_freq_factor,
                original_max_len=self.rope_original_max_len, beta_fast=self.rope_beta_fast,
                beta_slow=self.rope_beta_slow, truncate=self.rope_truncate, attention_factor=self.rope_attention_factor)

  def train_flops_per_token(self, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward = 3 x forward).

    Matmuls: 6 x (matmul parameters), the embedding lookup excluded, the output head included.
    Attention scores and values: causal, so each query attends to (T + 1) / 2 keys on average:
    2 matmuls x 2 FLOPs x N x H x (T + 1) / 2 forward, x 3 for training. Norms, RoPE and softmax
    are not counted (they are not matmuls; the convention of PaLM's MFU).
    MoE layers count their active parameters: the router, experts_per_token routed experts and the
    shared experts (what one token is multiplied by), not all experts. Multi-token prediction depths count
    as one more layer, their projection and the output head each.
    """
    n, k, h, d = self.num_heads, self.num_kv_heads, self.head_dim, self.d_model
    attention_params = d * n * h * 2 + d * k * h * 2
    # A window layer's query sees min(t + 1, W) keys: the mean over t = 0..T-1 replaces (T + 1) / 2.
    w = self.sliding_window if 0 < self.sliding_window < seq_len else 0
    mean_keys_x2 = (seq_len + 1) if not w else (w * (w + 1) + 2 * w * (seq_len - w)) / seq_len
    moe, num_moe = self.moe, self.moe.num_moe_layers(self.num_layers)
    active_experts = moe.experts_per_token + moe.num_shared_experts
    moe_ffn = d * moe.num_experts + 3 * d * moe.expert_d_ff * active_experts
    matmul_params = (self.num_layers * attention_params + (self.num_layers - num_moe) * 3 * d * self.d_ff
                     + num_moe * moe_ffn + d * self.vocab_size)
    attention = self.num_layers * 3 * 2 * n * h * mean_keys_x2
    if self.mtp_layers:  # each MTP depth: eh_proj [2D, D], one layer (MoE when the last one is), the head again
      matmul_params += self.mtp_layers * (2 * d * d + attention_params + (moe_ffn if num_moe else 3 * d * self.d_ff)
                                          + d * self.vocab_size)
      attention += self.mtp_layers * 3 * 2 * n * h * mean_keys_x2
    return 6.0 * matmul_params + attention

  @classmethod
  def from_config(cls, model_cfg: Any) -> "ModelConfig":
    """From `config.model` (its typed section, or a dict of its keys: a migrated saved config, an HF import); a key
    missing takes its default, an undeclared one is a UserError naming it (never dropped unread)."""
    check_known(model_cfg, "model")
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in model_cfg.items() if k in fields}
    if "head_dim" in model_cfg:
      kwargs["head_dim_setting"] = model_cfg["head_dim"]
    for key in ("param_dtype", "compute_dtype"):
      if key in kwargs:
        kwargs[key] = jnp.dtype(kwargs[key])
    if "moe" in kwargs:
      kwargs["moe"] = MoEConfig.from_config(kwargs["moe"])
    if "mla" in kwargs:
      kwargs["mla"] = mla_lib.MLAConfig.from_config(kwargs["mla"])
    if "quantization" in model_cfg:
      kwargs["quant"] = quant_lib.QuantConfig.from_config(model_cfg)
    return cls(**kwargs)


def validate(m: Any) -> None:
  """UserError naming the key for a bad `config.model`."""
  for key in ("num_layers", "d_model", "num_heads", "num_kv_heads", "d_ff", "vocab_size", "max_seq_len"):
    require(m[key] > 0, f"config.model.{key}={m[key]}: must be > 0")
  require(m.head_dim >= 0, f"config.model.head_dim={m.head_dim}: must be >= 0 (0: d_model / num_heads)")
  if m.head_dim:
    require(m.head_dim % 2 == 0, f"config.model.head_dim={m.head_dim} must be even for RoPE")
  else:
    require(m.d_model % m.num_heads == 0,
            f"config.model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads} (or set model.head_dim)")
    require((m.d_model // m.num_heads) % 2 == 0,
            f"head_dim = model.d_model / model.num_heads = {m.d_model // m.num_heads} must be even for RoPE")
  require(m.sliding_window >= 0, f"config.model.sliding_window={m.sliding_window}: must be >= 0 (0: off)")
  require(m.get("window_pattern", 0) >= 0,
          f"config.model.window_pattern={m.get('window_pattern')}: must be >= 0 (0: the family's pattern)")
  require(m.get("rope_local_theta", 0.0) >= 0,
          f"config.model.rope_local_theta={m.get('rope_local_theta')}: must be >= 0 (0: local layers use rope_theta)")
  require(m.sliding_window == 0 or m.attention != "nki",
          f"config.model.attention={m.attention} has no sliding window: use model.attention=flash, blocked or dot "
          f"with model.sliding_window={m.sliding_window}")
  require(not m.get("attention_sinks") or m.attention in ("dot", "flash", "auto"),
          f"config.model.attention={m.attention} has no attention sinks: use model.attention=flash or dot with "
          "model.attention_sinks=True")
  choice("model.mlp_activation", m.get("mlp_activation", "silu"), tuple(ACTIVATIONS))
  for key in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
    require(m.get(key, 0.0) >= 0, f"config.model.{key}={m.get(key)}: must be >= 0 (0: off)")
  require(not m.get("attn_logit_softcap") or m.attention in ("dot", "flash", "auto"),
          f"config.model.attention={m.attention} has no attention logit soft-capping (dot and flash have): use "
          f"model.attention=flash, dot or auto with model.attn_logit_softcap={m.get('attn_logit_softcap')}")
  require(not m.get("attn_logit_softcap") or not m.mla.kv_lora_rank,
          "config.model.attn_logit_softcap: multi-head latent attention (model.mla.kv_lora_rank > 0) has no "
          "soft-capping; set model.attn_logit_softcap=0")
  require(m.num_heads % m.num_kv_heads == 0,
          f"config.model.num_heads={m.num_heads} is not divisible by model.num_kv_heads={m.num_kv_heads}")
  require(m.loss_chunk_tokens >= -1, f"config.model.loss_chunk_tokens={m.loss_chunk_tokens}: use a chunk size > 0, "
          "0 (off) or -1 (auto)")
  require(m.scan_unroll >= 1, f"config.model.scan_unroll={m.scan_unroll}: must be >= 1 (1 = a rolled loop)")
  choice("model.remat", m.remat, REMAT_CHOICES)
  choice("model.rope_scaling", m.rope_scaling, ROPE_SCALINGS)
  require(m.norm_eps > 0, f"config.model.norm_eps={m.norm_eps}: must be > 0")
  if m.rope_scaling == "linear":
    require(m.rope_scaling_factor > 0, f"config.model.rope_scaling_factor={m.rope_scaling_factor}: linear RoPE "
            "scaling divides every frequency by it; must be > 0")
  if m.rope_scaling == "llama3":
    require(m.rope_high_freq_factor > m.rope_low_freq_factor > 0 and m.rope_scaling_factor > 0
            and m.rope_original_max_len > 0,
            f"config.model.rope_*: llama3 scaling needs rope_high_freq_factor={m.rope_high_freq_factor} > "
            f"rope_low_freq_factor={m.rope_low_freq_factor} > 0, rope_scaling_factor={m.rope_scaling_factor} > 0 "
            f"and rope_original_max_len={m.rope_original_max_len} > 0")
  if m.rope_scaling == "yarn":
    require(m.rope_scaling_factor > 0 and m.rope_original_max_len > 0 and m.rope_beta_fast > m.rope_beta_slow > 0
            and m.rope_attention_factor >= 0,
            f"config.model.rope_*: yarn scaling needs rope_scaling_factor={m.rope_scaling_factor} > 0, "
            f"rope_original_max_len={m.rope_original_max_len} > 0, rope_beta_fast={m.rope_beta_fast} > "
            f"rope_beta_slow={m.rope_beta_slow} > 0 and rope_attention_factor={m.rope_attention_factor} >= 0")
  choice("model.attention", m.attention, attention.CHOICES)
  for key in ("attention_block_q", "attention_block_kv"):
    require(m[key] > 0, f"config.model.{key}={m[key]}: must be > 0")
  for key in ("param_dtype", "compute_dtype"):
    choice(f"model.{key}", m[key], DTYPES)
  moe_lib.validate(m)
  mla_lib.validate(m)
  require(m.get("mtp_layers", 0) >= 0, f"config.model.mtp_layers={m.get('mtp_layers')}: must be >= 0 (0: off)")
  require(m.get("mtp_loss_weight", 0.0) >= 0,
          f"config.model.mtp_loss_weight={m.get('mtp_loss_weight')}: must be >= 0")
  # The chunked loss runs by default from CHUNK_MIN_VOCAB (program/loss.py) up: the head check needs the resolved size.
  quant_lib.validate(m, m.loss_chunk_tokens if m.loss_chunk_tokens >= 0 else int(m.vocab_size >= 4096))


class Block(nnx.Module):
  """One decoder layer; its feed-forward part is a dense SwiGLU (`mlp`) or a mixture of experts (`moe`)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, moe: bool = False, layer: int = 0,
               parallel: Parallel = NONE):
    # GPT-2/LLaMA practice: shrink residual-branch outputs with depth so activations stay O(1).
    out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
    common = dict(init_std=cfg.init_std, out_std=out_std, param_dtype=cfg.param_dtype,
                  compute_dtype=cfg.compute_dtype, rngs=rngs, parallel=parallel)
    self.parallel = parallel
    norm = functools.partial(RMSNorm, cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype, rngs=rngs,
                             one_plus=cfg.norm_one_plus)
    self.attn_norm = norm()
    if cfg.mla.enabled:
      self.attn = mla_lib.MLAttention(cfg.d_model, cfg.num_heads, cfg.mla, rope=cfg.rope, norm_eps=cfg.norm_eps,
                                      kernel=cfg.attention, block_q=cfg.attention_block_q,
                                      block_kv=cfg.attention_block_kv, **common)
    else:
      self.attn = Attention(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, rope_theta=cfg.layer_rope(layer),
                            kernel=cfg.attention, block_q=cfg.attention_block_q, block_kv=cfg.attention_block_kv,
                            quant=cfg.quant.for_kind("attention"), head_dim=cfg.head_dim, qkv_bias=cfg.qkv_bias,
                            qk_norm_eps=cfg.norm_eps if cfg.qk_norm else None, qk_norm_one_plus=cfg.norm_one_plus,
                            window=cfg.layer_window(layer),
                            sinks=cfg.attention_sinks, o_bias=cfg.o_bias,
                            query_pre_attn_scalar=cfg.query_pre_attn_scalar, logit_cap=cfg.attn_logit_softcap,
                            **common)
    self.mlp_norm = norm()
    self.post_norms = cfg.post_norms
    if cfg.post_norms:  # Gemma: each branch's output normed before the residual add
      self.post_attn_norm, self.post_mlp_norm = norm(), norm()
    self.is_moe = moe
    if moe:
      self.moe = MoE(cfg.d_model, cfg.moe, quant=cfg.quant.for_kind("experts"),
                     shared_quant=cfg.quant.for_kind("mlp"), balanced_standin=cfg.memory_standin, **common)
    else:
      self.mlp = MLP(cfg.d_model, cfg.d_ff, quant=cfg.quant.for_kind("mlp"), activation=cfg.mlp_activation, **common)

  def __call__(self, x_BTD: jax.Array, segment_ids_BT: jax.Array, positions_BT: jax.Array,
               cache: KVCache | None = None, write: CacheWrite | None = None,
               ) -> tuple[jax.Array, dict[str, jax.Array], KVCache | None]:
    """(the layer's output, its MoE statistics: models/moe.py STATS, empty for a dense layer, its KV
    cache updated: None without one)."""
    y_BTD, cache = self.attn(self.attn_norm(x_BTD), segment_ids_BT, positions_BT, cache, write)
    if self.post_norms:
      y_BTD = self.post_attn_norm(y_BTD)
    x_BTD = checkpoint_name(x_BTD + checkpoint_name(y_BTD, "attn_out"), "residual")
    h_BTD = checkpoint_name(self.mlp_norm(x_BTD), "mlp_in")
    if self.is_moe:
      y_BTD, stats = self.moe(h_BTD)
    else:
      y_BTD, stats = self.mlp(h_BTD), {}
    if self.post_norms:
      y_BTD = self.post_mlp_norm(y_BTD)
    x_BTD = x_BTD + y_BTD
    return self.parallel.constrain(x_BTD, ("act_batch", "act_length", "act_embed")), stats, cache


class Decoder(nnx.Module):
  """The model of every family (models/registry.py): `Decoder(cfg, rngs=..., parallel=..., stack=...)`.

  How it is laid out and run comes from the builder at construction (program/state.py), kept as static
  attributes: `parallel` (sharding/rules.py Parallel: the logical -> mesh rules its layers constrain their
  activations by; the default, none: a model on its own) and `stack` (models/stack.py: scanned, a list, or a
  pipeline with its schedule; the default: `model.scan_layers`'s, no pipeline)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, parallel: Parallel = NONE,
               stack: stack_lib.Stack | None = None):
    # Parameters and activations carry logical names only; placement is decided by `parallel`'s rules and the
    # jit that creates the sharded train state.
    with nnx.use_eager_sharding(False):
      self._build(cfg, rngs, parallel, stack_lib.for_model(cfg) if stack is None else stack)

  def _build(self, cfg: ModelConfig, rngs: nnx.Rngs, parallel: Parallel, stack: stack_lib.Stack) -> None:
    self.cfg, self.parallel, self.stack = cfg, parallel, stack
    self.embed = param(rngs, nnx.initializers.normal(cfg.init_std), (cfg.vocab_size, cfg.d_model),
                       ("vocab", "embed"), cfg.param_dtype)
    num_moe = cfg.moe.num_moe_layers(cfg.num_layers)
    if cfg.num_layers - num_moe:
      self.blocks = _stack(cfg, stack, parallel, rngs, cfg.num_layers - num_moe, moe=False)
    if num_moe:
      self.moe_blocks = _stack(cfg, stack, parallel, rngs, num_moe, moe=True)
    self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype, rngs=rngs,
                              one_plus=cfg.norm_one_plus)
    if not cfg.tie_embeddings:
      self.head = param(rngs, nnx.initializers.normal(cfg.init_std), (cfg.d_model, cfg.vocab_size),
                        ("embed", "vocab"), cfg.param_dtype)
    if cfg.mtp_layers:  # after every other parameter: the default model's initial values do not move
      norm = functools.partial(RMSNorm, cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype, rngs=rngs,
                               one_plus=cfg.norm_one_plus)
      self.mtp = nnx.List([
          mtp_lib.MTPLayer(cfg.d_model, Block(cfg, rngs, moe=num_moe > 0, layer=cfg.num_layers + j, parallel=parallel),
                           norm,
                           init_std=cfg.init_std, param_dtype=cfg.param_dtype, compute_dtype=cfg.compute_dtype,
                           rngs=rngs)
          for j in range(cfg.mtp_layers)])

  def __call__(self, tokens_BT: jax.Array, segment_ids_BT: jax.Array, positions_BT: jax.Array) -> jax.Array:
    """Returns fp32 logits [B, T, V] (training computes the loss from `features` and `head_weights`
    instead, in chunks when the vocabulary is large: maxtrain/program/loss.py)."""
    x_BTD, _ = self.features(tokens_BT, segment_ids_BT, positions_BT)
    return self._logits(x_BTD)

  def _logits(self, x_BTD: jax.Array) -> jax.Array:
    logits_BTV = project(x_BTD, self.head_weights().astype(self.cfg.compute_dtype), preferred_element_type=jnp.float32,
                         quant=self.cfg.quant.for_kind("head"))
    logits_BTV = attention.softcap(logits_BTV, self.cfg.final_logit_softcap)  # Gemma 2 (0: off)
    return self.parallel.constrain(logits_BTV, ("act_batch", "act_length", "act_vocab"))

  def init_cache(self, batch: int, length: int, rings: bool = True) -> "Cache":
    """An empty cache of `length` slots per row, in the compute dtype, laid out like the stacks. `rings=False`:
    window layers keep every slot too (continuous batching moves rows' slots, which a ring's slot mod R forbids)."""
    cfg = self.cfg

    # A window layer keeps a ring of window-many slots (models/attention/layer.py _attend_ring); the window
    # pattern is per layer (GPT-OSS alternates), so each unscanned layer sizes its own.
    slots_of = lambda layer: min(length, cfg.layer_window(layer)) if cfg.layer_window(layer) and rings else length

    def kv(layers: int | None, slots: int) -> KVCache:
      # MLA caches every head's expanded k and v, or (latent_cache) one kv latent and one RoPE key (models/mla.py)
      shape = (batch, slots, *((cfg.num_heads, cfg.mla.head_dim) if cfg.mla.enabled else (cfg.num_kv_heads, cfg.head_dim)))
      shapes = [shape, shape]
      if cfg.mla.enabled and cfg.mla.latent_cache:
        shapes = [(batch, slots, 1, cfg.mla.kv_lora_rank), (batch, slots, 1, cfg.mla.rope_head_dim)]
      logical = ("act_batch", None, "act_kv_heads", None) if not cfg.mla.latent_cache else ("act_batch", None, None, None)
      if layers is not None:
        shapes, logical = [(layers,) + s for s in shapes], (None,) + logical
      return KVCache(*(self.parallel.constrain(jnp.zeros(s, cfg.compute_dtype), logical) for s in shapes))

    stacks = {}
    for name in ("blocks", "moe_blocks"):
      if hasattr(self, name):
        blocks = getattr(self, name)
        first = cfg.num_layers - len(blocks) if name == "moe_blocks" and not self.stack.scanned else 0
        stacks[name] = (kv(_stack_length(blocks), slots_of(0)) if self.stack.scanned
                        else [kv(None, slots_of(first + i)) for i in range(len(blocks))])
    return Cache(stacks, jnp.zeros((batch, length), jnp.bool_), jnp.zeros((), jnp.int32), fresh=True)

  def decode(self, tokens_BT: jax.Array, valid_BT: jax.Array, cache: "Cache") -> tuple[jax.Array, "Cache"]:
    """fp32 logits [B, T, V] of `tokens_BT` written at the cache's next T slots, and the new cache.

    Left-padded prompts: a slot holds a real token iff `valid`; a token's RoPE position counts only the
    real tokens before it, so every row computes what it would alone (the full forward pass of its
    tokens: tests/test_generate.py). Remat is off (nothing is differentiated)."""
    x_BTD, cache = self.decode_features(tokens_BT, valid_BT, cache)
    return self._logits(x_BTD), cache

  def decode_features(self, tokens_BT: jax.Array, valid_BT: jax.Array, cache: "Cache") -> tuple[jax.Array, "Cache"]:
    """`decode`'s final-norm hidden states [B, T, D] in place of its logits (what an MTP draft reads)."""
    t = tokens_BT.shape[1]
    valid_BS = jax.lax.dynamic_update_slice_in_dim(cache.valid_BS, valid_BT.astype(jnp.bool_), cache.length, axis=1)
    positions_BT = jax.lax.dynamic_slice_in_dim(jnp.cumsum(valid_BS, axis=1, dtype=jnp.int32) - 1, cache.length, t,
                                                axis=1)
    write = CacheWrite(valid_BS=valid_BS, start=cache.length, fresh=cache.fresh)
    # A prefill's padding is its own segment (0): real tokens never see it.
    x_BTD, _, kv = self._forward(tokens_BT, valid_BT.astype(jnp.int32), positions_BT, cache.kv, write)
    return x_BTD, Cache(kv, valid_BS, cache.length + t, fresh=False)

  def head_weights(self) -> jax.Array:
    """The output head [D, V] at the parameter dtype (the embedding transposed when tied)."""
    return self.embed[...].T if self.cfg.tie_embeddings else self.head[...]

  def features(self, tokens_BT: jax.Array, segment_ids_BT: jax.Array, positions_BT: jax.Array,
               stack_hook: pipeline_lib.StackHook | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(the final-norm hidden states [B, T, D] in the compute dtype: the output head's input, the MoE
    layers' statistics stacked over them: models/moe.py STATS, {} for a dense model). `stack_hook`: run in
    place of a pipelined layer stack (sharding/schedules.py, while it traces the model; models/stack.py)."""
    x_BTD, moe_stats, _ = self._forward(tokens_BT, segment_ids_BT, positions_BT, None, None, stack_hook)
    return x_BTD, moe_stats

  def mtp_features(self, x_BTD: jax.Array, tokens_BT: jax.Array, segment_ids_BT: jax.Array,
                   positions_BT: jax.Array, order: Any = None) -> list[jax.Array]:
    """Per multi-token-prediction depth k = 1..K (models/mtp.py), the normed hidden states [B, T, D] whose head
    predicts token t_{i+k+1} at position i; `x_BTD` is `features`' output, `tokens_BT` the inputs (the depth
    reads the embedding of t_{i+k}: the inputs shifted by k, padded with token 0 past the end); `order`: the
    sequence order of the length dim's positions (context parallelism's layout; None: natural)."""
    out, h_BTD = [], x_BTD
    for k, layer in enumerate(self.mtp, start=1):
      e_BTD = self._embed(mtp_lib.shift_left(tokens_BT, k, order=order))
      h_BTD, normed_BTD, _ = layer(h_BTD, e_BTD, segment_ids_BT, positions_BT)
      out.append(normed_BTD)
    return out

  def mtp_decode(self, h_BTD: jax.Array, next_tokens_BT: jax.Array, cache: "Cache") -> tuple[jax.Array, "Cache"]:
    """Depth 1 over the cache: fp32 logits [B, T, V] of the token after next at the cache's next T slots, from
    the main model's normed hidden states `h_BTD` there and the tokens that follow them; `cache` is the depth's own
    (`init_mtp_cache`), every slot valid (speculative decoding runs unpadded rows)."""
    t = h_BTD.shape[1]
    valid_BS = jax.lax.dynamic_update_slice_in_dim(cache.valid_BS, jnp.ones(h_BTD.shape[:2], jnp.bool_),
                                                   cache.length, axis=1)
    positions_BT = jnp.broadcast_to(cache.length + jnp.arange(t, dtype=jnp.int32), h_BTD.shape[:2])
    write = CacheWrite(valid_BS=valid_BS, start=cache.length, fresh=cache.fresh)
    _, normed_BTD, kv = self.mtp[0](h_BTD, self._embed(next_tokens_BT), jnp.ones(h_BTD.shape[:2], jnp.int32),
                                   positions_BT, cache.kv["mtp"], write)
    return self._logits(normed_BTD), Cache({"mtp": kv}, valid_BS, cache.length + t, fresh=False)

  def init_mtp_cache(self, batch: int, length: int) -> "Cache":
    """An empty cache of `length` slots for depth 1's block (`mtp_decode`)."""
    cfg = self.cfg
    if cfg.mla.enabled and cfg.mla.latent_cache:
      shapes = [(batch, length, 1, cfg.mla.kv_lora_rank), (batch, length, 1, cfg.mla.rope_head_dim)]
    else:
      heads = (cfg.num_heads, cfg.mla.head_dim) if cfg.mla.enabled else (cfg.num_kv_heads, cfg.head_dim)
      shapes = [(batch, length, *heads)] * 2
    kv = KVCache(*(jnp.zeros(s, cfg.compute_dtype) for s in shapes))
    return Cache({"mtp": kv}, jnp.zeros((batch, length), jnp.bool_), jnp.zeros((), jnp.int32), fresh=True)

  def _embed(self, tokens_BT: jax.Array) -> jax.Array:
    cfg = self.cfg
    x_BTD = self.embed[...].astype(cfg.compute_dtype)[tokens_BT]
    if cfg.embed_scale:  # Gemma: times sqrt(d_model), rounded to the compute dtype as transformers does
      x_BTD = x_BTD * jnp.asarray(cfg.d_model**0.5, cfg.compute_dtype)
    return self.parallel.constrain(x_BTD, ("act_batch", "act_length", "act_embed"))

  def _forward(self, tokens_BT, segment_ids_BT, positions_BT, kv: dict | None, write: CacheWrite | None,
               stack_hook: pipeline_lib.StackHook | None = None):
    cfg = self.cfg
    assert cfg.remat != "auto", "model.remat=auto is resolved by the program builder (maxtrain/program/fit.py)"
    x_BTD = self._embed(tokens_BT)
    moe_stats: dict[str, jax.Array] = {}
    new_kv = None if kv is None else {}
    for name in ("blocks", "moe_blocks"):
      if hasattr(self, name):
        x_BTD, moe_stats, stack_kv = self.stack.run(getattr(self, name), x_BTD, segment_ids_BT, positions_BT,
                                                    None if kv is None else kv[name], write,
                                                    REMAT_POLICIES[cfg.remat], stack_hook)
        if kv is not None:
          new_kv[name] = stack_kv
    return self.final_norm(x_BTD), moe_stats, new_kv


@functools.partial(jax.tree_util.register_dataclass, data_fields=["kv", "valid_BS", "length"], meta_fields=["fresh"])
@dataclasses.dataclass(frozen=True)
class Cache:
  """The model's KV cache: per stack (`blocks`, `moe_blocks`) a KVCache stacked over its layers [L, B, S, K, H]
  (scan_layers) or a list of them; which slots hold real tokens; how many slots are written."""
  kv: dict[str, Any]
  valid_BS: jax.Array
  length: jax.Array  # int32 []
  fresh: bool  # nothing written yet: the next call is a prefill (static: it picks the attention path)


def _stack(cfg: ModelConfig, stack: stack_lib.Stack, parallel: Parallel, rngs: nnx.Rngs, num: int, *,
           moe: bool) -> nnx.Module:
  """`num` Blocks as `stack` keeps them: one stacked Block whose parameters have a leading `layers` dim
  (scanned), or a list."""
  make_block = lambda rngs, layer: Block(cfg, rngs, moe=moe, layer=layer, parallel=parallel)
  return stack.build(make_block, rngs, num, first=cfg.num_layers - num if moe else 0)


def _stack_length(blocks: nnx.Module) -> int:
  return jax.tree.leaves(nnx.state(blocks))[0].shape[0]


def param_count(state: nnx.State) -> int:
  return sum(x.size for x in jax.tree.leaves(state))
