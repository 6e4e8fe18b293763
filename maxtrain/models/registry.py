"""The registry of model families: the one place the rest of maxtrain asks for a model.

A family bundles its typed config defaults (the pieces it turns on over the `model.*` keys), its module,
its Hugging Face adapter (`models/hf_adapter.py`: tensor names and config.json, both ways) and its FLOPs
per token. The memory estimate (`aot/estimate.py`) reads the family's typed config and abstract parameters
from here (head_dim, the window and the parameter table are all it needs so far). `model.family` selects one; nothing outside `models/` names a
family (tests/test_families.py checks it). Adding a family is a module in `models/` with one `FAMILY`
and its line in `_MODULES` below (docs/models.md).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
from typing import Any, Callable

import jax
from flax import nnx

from maxtrain.config.keys import flat_items
from maxtrain.errors import UserError, choice
from maxtrain.models import decoder
from maxtrain.models import stack as stack_lib
from maxtrain.models.decoder import ModelConfig
from maxtrain.models.hf_adapter import HFAdapter
from maxtrain.sharding.rules import NONE, Parallel

# The families, each a module of models/ holding FAMILY (the order of --help and docs/models.md).
_MODULES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "gpt_oss", "deepseek_v3", "gemma2", "gemma3")
DEFAULT = "llama"  # config.model.family's default (config/keys.py), and the family of keys without one
# which layers a family's sliding window covers: "all" (Mistral), "alternate" (even layers; GPT-OSS, Gemma 2:
# their layers are unscanned, model.scan_layers=False, each Block with its own static window); a period
# (Family.window_pattern or the model.window_pattern key: Gemma 3's 6) replaces it
WINDOW_PATTERNS = ("all", "alternate")


@dataclasses.dataclass(frozen=True)
class Family:
  name: str
  pieces: dict[str, Any]  # model.* values the family sets whatever the keys say (qwen2: qkv_bias=True)
  hf: HFAdapter
  module: Callable[..., nnx.Module] = decoder.Decoder  # (ModelConfig, *, rngs, parallel, stack) -> the model
  window_layers: str = "all"  # WINDOW_PATTERNS: the layers model.sliding_window applies to
  window_pattern: int = 0  # model.window_pattern's value when the key is 0 (Gemma 3: 6); 0: window_layers
  validate: Callable[[Any], None] = lambda m: None  # family-specific UserErrors on config.model
  # `config.model` keys (dotted below model.) of the family's published model: what `model.family=X` alone
  # gives, under every key a config file or the command line sets. The module's `DEFAULTS` literal, which
  # config/loader.py reads without importing the module (config loads without jax); {}: the declared keys.
  defaults: dict[str, Any] = dataclasses.field(default_factory=dict)

  def flops_per_token(self, cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (ModelConfig.train_flops_per_token's convention); a pattern's window on
    its local layers only: the count with and without it, mixed by the share of local layers."""
    local = sum(cfg.is_local(i) for i in range(cfg.num_layers))
    windowed = cfg.train_flops_per_token(seq_len)
    if local == cfg.num_layers or not cfg.sliding_window:
      return windowed
    full = dataclasses.replace(cfg, sliding_window=0).train_flops_per_token(seq_len)
    return full + (windowed - full) * local / cfg.num_layers


@functools.cache
def families() -> dict[str, Family]:
  """name -> Family, in _MODULES order (imported on first use: the family modules import this one)."""
  out = {}
  for module in _MODULES:
    family = importlib.import_module(f"maxtrain.models.{module}").FAMILY
    assert family.name == module and family.window_layers in WINDOW_PATTERNS, family
    out[family.name] = family
  return out


def names() -> tuple[str, ...]:
  return tuple(families())


def get(name: str) -> Family:
  choice("model.family", name, names())
  return families()[name]


def of_keys(model_cfg: Any) -> Family:
  """The family of these `config.model` keys (a checkpoint saved before families existed: LLaMA's)."""
  return get(model_cfg.get("family", DEFAULT))


def model_config(model_cfg: Any) -> ModelConfig:
  """The typed config of `config.model` (its typed section or a dict of its keys): the keys, then the family's
  pieces over them (a family's pieces are on whatever the keys say)."""
  family = of_keys(model_cfg)
  cfg = ModelConfig.from_config(model_cfg)
  return dataclasses.replace(cfg, family=family.name, window_layers=family.window_layers,
                             window_pattern=cfg.window_pattern or family.window_pattern, **family.pieces)


def validate(m: Any) -> None:
  """UserError naming the key for a bad `config.model` (the decoder's checks, then the family's)."""
  family = of_keys(m)
  decoder.validate(m)
  family.validate(m)
  cfg = model_config(m)
  kinds = {(cfg.layer_window(i), cfg.layer_rope(i)) for i in range(cfg.num_layers)}
  if cfg.scan_layers and len(kinds) > 1:  # a scanned stack compiles one layer body: one window, one RoPE
    raise UserError(f"config.model.window_pattern={cfg.window_pattern}: layers with different windows or RoPE "
                    f"bases (model.sliding_window={cfg.sliding_window}, model.rope_local_theta={cfg.rope_local_theta}) "
                    "need model.scan_layers=False")


def build(cfg: ModelConfig, *, rngs: nnx.Rngs, parallel: Parallel = NONE,
          stack: stack_lib.Stack | None = None) -> nnx.Module:
  """The model of `cfg`'s family, laid out by `parallel` and run by `stack` (the builder's: program/state.py;
  the defaults: a model on its own, `model.scan_layers`'s stack)."""
  return get(cfg.family).module(cfg, rngs=rngs, parallel=parallel, stack=stack)


def abstract(cfg: ModelConfig, seed: int = 0, *, parallel: Parallel = NONE,
             stack: stack_lib.Stack | None = None) -> tuple[nnx.GraphDef, nnx.State]:
  """(graph definition, parameters as ShapeDtypeStructs with their logical axes): nothing allocated."""
  return nnx.split(nnx.eval_shape(lambda: build(cfg, rngs=nnx.Rngs(params=seed), parallel=parallel, stack=stack)))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  return get(cfg.family).flops_per_token(cfg, seq_len)


def for_architecture(hf: dict, where: str) -> Family:
  """The family of a Hugging Face config.json, by its `architectures`; UserError naming the field."""
  if not isinstance(hf, dict):
    raise UserError(f"{where}: expected a JSON object, found {type(hf).__name__}")
  by_arch = {f.hf.architecture: f for f in families().values()}
  by_type = {f.hf.model_type: f.hf.architecture for f in families().values()}
  arch = hf.get("architectures") or [by_type.get(hf.get("model_type", "llama"), hf.get("model_type"))]
  if not isinstance(arch, list) or len(arch) != 1 or arch[0] not in by_arch:
    raise UserError(f"{where}: architectures={arch}: supported: {', '.join(by_arch)}")
  return by_arch[arch[0]]


def param_count(state: nnx.State) -> int:
  return sum(x.size for x in jax.tree.leaves(state))


# config.model keys that change how the model is computed or trained, not the function its parameters define:
# a resume may change them (everything else under config.model is compared by `math_changes`).
HOW_KEYS = frozenset({
    "scan_layers", "scan_unroll", "remat", "attention", "attention_block_q", "attention_block_kv", "compute_dtype",
    "param_dtype", "loss_chunk_tokens", "max_seq_len", "quantization", "quant_kinds", "quant_min_dim", "quant_margin",
    "quant_saturate", "moe.dispatch", "moe.capacity_factor", "moe.aux_loss_weight", "moe.router_z_loss_weight",
    "moe.bias_update_rate", "moe.collapse_entropy", "moe.collapse_steps", "mla.latent_cache", "mtp_loss_weight"})


def math_changes(saved_model: dict, model: Any) -> list[str]:
  """`key: saved -> now` for each config.model key outside HOW_KEYS whose value differs between a checkpoint's
  saved config.model and this run's: the same parameters would compute another function (a sliding window,
  RoPE base or family switched on). `saved_model` is migrated (config/migrate.py): a key the checkpoint saved
  before it existed holds its declared default, which is what that checkpoint ran."""
  as_saved = lambda d: json.loads(json.dumps(flat_items(d), default=str))  # tuples -> lists, as the meta holds them
  before, now = as_saved(saved_model), as_saved(model)
  return [f"model.{k}: {before[k]!r} -> {now[k]!r}" for k in sorted(set(before) & set(now))
          if k not in HOW_KEYS and before[k] != now[k]]


# The config key that sets each logical parameter dim: what a layout error tells the user to change.
CONFIG_KEYS = {**decoder.CONFIG_KEYS, "head_dim": "model.head_dim"}
