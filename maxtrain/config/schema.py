"""Typed config sections: one frozen dataclass per section of `keys.base_config()` (nested sections, `model.moe`
and `model.mla`, as nested dataclasses), built once at load by `Config.from_dict` from the ConfigDict that stays
the file and command-line format (and `--help`'s source). Components take their own section (`cfg.optimizer`,
`cfg.guards`, ...) or the whole `Config` where they need several; nothing outside config/ and cli/ sees a
ConfigDict (tests/test_architecture.py).

- Fields and defaults are exactly the declared keys and their declared defaults (llama's model keys: a family's
  published values are values, not defaults); tests/test_config.py checks every section against keys.py, where
  each key's meaning is written once.
- Strict: an undeclared key is a UserError (exit 2) naming it with the nearest declared one; a missing key too.
- Immutable: a changed copy is `with_values(cfg, {"model.remat": "full"})` (a trial of the fitter, a stage of
  the data schedule, the rollout mesh's config), never a mutation.
- Read like a mapping too (`section["key"]`, `"key" in section`, `.items()`, `.to_dict()`), because the model's
  `from_config` and validators also read a migrated saved config, which is a plain dict.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping

from maxtrain.config.keys import check_known, unknown_key
from maxtrain.errors import UserError, require


_NAMES: dict[type, tuple[str, ...]] = {}  # a section's field names, sorted (computed once per class)


@dataclasses.dataclass(frozen=True)
class _Section:
  """A read-only mapping view over the fields, sorted by name as the ConfigDict iterates (so what is saved,
  hashed or logged from it is the same text as before the sections were typed)."""

  def __getitem__(self, key: str) -> Any:
    if key not in self._names():
      raise KeyError(key)
    return getattr(self, key)

  def __contains__(self, key: object) -> bool:
    return key in self._names()

  def __iter__(self) -> Iterator[str]:
    return iter(self._names())

  def get(self, key: str, default: Any = None) -> Any:
    return getattr(self, key) if key in self._names() else default

  def keys(self) -> list[str]:
    return list(self._names())

  def items(self) -> list[tuple[str, Any]]:
    return [(name, getattr(self, name)) for name in self._names()]

  def to_dict(self) -> dict[str, Any]:
    """Nested plain dicts (the ConfigDict's `to_dict`, its order included): what the checkpoint saves."""
    return {name: value.to_dict() if isinstance(value, _Section) else value for name, value in self.items()}

  @classmethod
  def _names(cls) -> tuple[str, ...]:
    names = _NAMES.get(cls)
    if names is None:
      names = _NAMES[cls] = tuple(sorted(f.name for f in dataclasses.fields(cls)))
    return names

  @classmethod
  def from_dict(cls, values: Mapping[str, Any], prefix: str = "") -> Any:
    """This section from a ConfigDict or a dict of its keys (`prefix`: its dotted path, for errors): every field
    from its key; an undeclared key or a missing one is a UserError naming it."""
    check_known(values, prefix)
    kwargs = {}
    for f in dataclasses.fields(cls):
      path = f"{prefix}.{f.name}" if prefix else f.name
      if f.name not in values:
        raise UserError(f"config.{path} is missing: every declared key must be present (start from "
                        "maxtrain.config.base_config(), or migrate a saved config with maxtrain.config.migrate)")
      value = values[f.name]
      kind = SECTIONS.get(path)
      kwargs[f.name] = value if kind is None or isinstance(value, kind) else kind.from_dict(value, path)
    return cls(**kwargs)


@dataclasses.dataclass(frozen=True)
class MoE(_Section):
  """`config.model.moe`."""
  num_experts: int = 0
  experts_per_token: int = 2
  num_shared_experts: int = 0
  expert_d_ff: int = 256
  first_dense_layers: int = 0
  router: str = "softmax"
  norm_topk_prob: bool = True
  dispatch: str = "capacity"
  capacity_factor: float = 1.25
  aux_loss_weight: float = 0.01
  router_z_loss_weight: float = 0.001
  bias_update_rate: float = 0.0
  collapse_entropy: float = 0.5
  collapse_steps: int = 100
  n_group: int = 1
  topk_group: int = 1
  routed_scaling_factor: float = 1.0
  activation: str = "swiglu"
  expert_bias: bool = False
  swiglu_alpha: float = 1.702
  swiglu_limit: float = 7.0


@dataclasses.dataclass(frozen=True)
class MLA(_Section):
  """`config.model.mla`."""
  kv_lora_rank: int = 0
  q_lora_rank: int = 0
  rope_head_dim: int = 64
  nope_head_dim: int = 128
  v_head_dim: int = 128
  rope_interleave: bool = True
  latent_cache: bool = False
  softmax_mscale: float = 1.0


@dataclasses.dataclass(frozen=True)
class Model(_Section):
  """`config.model`."""
  family: str = "llama"
  num_layers: int = 4
  d_model: int = 256
  num_heads: int = 4
  head_dim: int = 0
  qkv_bias: bool = False
  qk_norm: bool = False
  attention_sinks: bool = False
  o_bias: bool = False
  sliding_window: int = 0
  window_pattern: int = 0
  rope_local_theta: float = 0.0
  norm_one_plus: bool = False
  post_norms: bool = False
  embed_scale: bool = False
  query_pre_attn_scalar: float = 0.0
  mlp_activation: str = "silu"
  attn_logit_softcap: float = 0.0
  final_logit_softcap: float = 0.0
  num_kv_heads: int = 2
  d_ff: int = 768
  vocab_size: int = 384
  max_seq_len: int = 1024
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
  norm_eps: float = 1e-05
  tie_embeddings: bool = False
  scan_layers: bool = True
  scan_unroll: int = 1
  remat: str = "none"
  attention: str = "auto"
  attention_block_q: int = 128
  attention_block_kv: int = 128
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  mtp_layers: int = 0
  mtp_loss_weight: float = 0.3
  loss_chunk_tokens: int = -1
  quantization: str = "none"
  quant_kinds: str = "attention,mlp,experts"
  quant_min_dim: int = 128
  quant_margin: int = 0
  quant_saturate: bool = True
  moe: MoE = dataclasses.field(default_factory=MoE)
  mla: MLA = dataclasses.field(default_factory=MLA)


@dataclasses.dataclass(frozen=True)
class Fit(_Section):
  """`config.fit`."""
  headroom: float = 0.1


@dataclasses.dataclass(frozen=True)
class Mesh(_Section):
  """`config.mesh`."""
  data: int = 1
  fsdp: int = -1
  context: int = 1
  tensor: int = 1
  expert: int = 1
  pipeline: int = 1
  dcn_pipeline: int = 1
  dcn_data: int = 1
  dcn_fsdp: int = 1
  dcn_expert: int = 1
  rules: str = "default"


@dataclasses.dataclass(frozen=True)
class Pipeline(_Section):
  """`config.pipeline`."""
  microbatches: int = 1
  repeats: int = 1
  schedule: str = "gpipe"
  stage_remat: bool = False


@dataclasses.dataclass(frozen=True)
class Data(_Section):
  """`config.data`."""
  corpus: str = "python-stdlib"
  path: str = ""
  tokenizer: str = "byte"
  seq_len: int = 256
  batch_size: int = 16
  sources: str = ""
  stages: str = ""
  max_epochs: float = 0.0
  stop_at_max_epochs: bool = False
  resume_new_batch_size: bool = False
  read_ahead: int = 4
  read_threads: int = 2


@dataclasses.dataclass(frozen=True)
class Optimizer(_Section):
  """`config.optimizer`."""
  name: str = "adamw"
  lr: float = 0.0015
  adam_lr: float = 0.0015
  schedule: str = "cosine"
  warmup_steps: int = 20
  min_lr_ratio: float = 0.1
  decay_steps: int = 0
  decay_fraction: float = 0.2
  wsd_decay: str = "linear"
  weight_decay: float = 0.1
  no_decay: str = "embed,norm,bias"
  clip_norm: float = 1.0
  z_loss: float = 0.0
  grad_accum_steps: int = 1
  microbatch_size: int = 0
  state_dtype: str = "float32"
  offload: str = "none"
  offload_groups: int = 16
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-08
  muon_momentum: float = 0.95
  muon_ns_steps: int = 5
  muon_ns_coeffs: str = "3.4445,-4.7750,2.0315"
  muon_ns_dtype: str = "float32"
  muon_consistent_rms: float = 0.0


@dataclasses.dataclass(frozen=True)
class Checkpoint(_Section):
  """`config.checkpoint`."""
  dir: str = ""
  every_steps: int = 100
  max_to_keep: int = 3
  keep_every: int = 0
  resume: str = "auto"
  async_save: bool = True
  verify: bool = True
  branch: bool = False
  resume_new_model: bool = False
  start_over_if_corrupt: bool = False
  s3_connect_timeout_s: float = 10.0
  s3_read_timeout_s: float = 60.0
  s3_max_attempts: int = 5
  init_from: str = ""
  local_dir: str = ""
  local_every_steps: int = 0
  local_max_to_keep: int = 2
  every_minutes: float = 0.0
  cadence: str = "fixed"
  mtbf_prior_minutes: float = 1440.0
  max_durable_lag: int = 2
  preemption_grace_s: float = 0.0
  promote_local: bool = True


@dataclasses.dataclass(frozen=True)
class Runtime(_Section):
  """`config.runtime`."""
  compile_cache_dir: str = ""
  num_processes: int = 0
  process_id: int = -1
  coordinator: str = ""
  cluster: str = "auto"
  init_timeout_s: float = 300.0
  heartbeat_timeout_s: float = 100.0
  shutdown_timeout_s: float = 300.0
  coordinator_port: int = 0
  platform: str = "auto"
  neuron_target: str = ""
  neuron_lnc: int = 0
  xla_flags: str = ""
  neuron_cc_flags: str = ""
  check_memory: bool = True
  env: str = ""


@dataclasses.dataclass(frozen=True)
class Mfu(_Section):
  """`config.mfu`."""
  peak_flops: float = 0.0


@dataclasses.dataclass(frozen=True)
class Profile(_Section):
  """`config.profile`."""
  start_step: int = -1
  num_steps: int = 3


@dataclasses.dataclass(frozen=True)
class Monitor(_Section):
  """`config.monitor`."""
  prometheus_port: int = 0
  prometheus_host: str = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class Tracking(_Section):
  """`config.tracking`."""
  mlflow_uri: str = ""
  mlflow_experiment: str = "maxtrain"
  otel_endpoint: str = ""
  otel_interval_s: float = 30.0


@dataclasses.dataclass(frozen=True)
class FaultDrills(_Section):
  """`config.faults`."""
  sigterm_at_step: int = -1
  kill_during_save_at_step: int = -1
  corrupt_checkpoint_at_step: int = -1
  crash_at_step: int = -1
  hang_at_step: int = -1
  nan_at_step: int = -1
  spike_at_step: int = -1
  spike_factor: float = 100.0
  process: int = -1
  sigterm_process: int = -1
  slow_step_s: float = 0.0
  kill_at_step: int = -1
  kill_every_steps: int = 0
  kill_times: int = 0
  rollout_hang_at_step: int = -1
  rollout_die_at_step: int = -1
  publish_stall_at_step: int = -1


@dataclasses.dataclass(frozen=True)
class Guards(_Section):
  """`config.guards`."""
  max_consecutive_bad: int = 3
  spike_window: int = 32
  spike_warmup: int = 20
  spike_zscore: float = 6.0
  spike_action: str = "skip"
  max_rollbacks: int = 3


@dataclasses.dataclass(frozen=True)
class Watchdog(_Section):
  """`config.watchdog`."""
  timeout_s: float = 600.0
  startup_timeout_s: float = 1800.0


@dataclasses.dataclass(frozen=True)
class Fleet(_Section):
  """`config.fleet`: the straggler verdict over the processes' step times (monitor/stragglers.py); checked as
  it is built."""
  straggler_threshold: float = 0.2
  straggler_min_s: float = 0.01
  exchange_timeout_s: float = 60.0

  def __post_init__(self) -> None:
    for key in ("straggler_threshold", "straggler_min_s"):
      require(getattr(self, key) >= 0, f"config.fleet.{key}={getattr(self, key)}: must be >= 0")
    require(self.exchange_timeout_s > 0, f"config.fleet.exchange_timeout_s={self.exchange_timeout_s}: must be > 0")


@dataclasses.dataclass(frozen=True)
class Post(_Section):
  """`config.post`."""
  mode: str = ""
  algorithm: str = "grpo"
  data: str = "arithmetic"
  resume_new_data: bool = False
  eval_prompts: int = 200
  max_new_tokens: int = 6
  reward: str = "maxtrain.data.arithmetic:reward"
  prompts_per_step: int = 8
  group_size: int = 8
  ppo_epochs: int = 1
  minibatches: int = 1
  clip_eps: float = -1.0
  clip_eps_high: float = -1.0
  kl_coef: float = -1.0
  overlong_buffer: int = -1
  max_draws: int = -1
  gamma: float = 1.0
  lam: float = 0.95
  value_clip: float = 0.2
  critic_lr: float = 0.01
  temperature: float = 1.0
  negate_reward: bool = False
  log_rollouts: bool = False
  continuous_batching: int = 0
  pack_updates: bool = False
  rollout_devices: int = 0
  max_staleness: int = 0
  correction: str = "none"
  is_cap: float = 2.0
  rollout_dtype: str = ""
  sync_timeout_s: float = 300.0


@dataclasses.dataclass(frozen=True)
class Eval(_Section):
  """`config.eval`."""
  every_steps: int = 50
  batches: int = 4
  tasks: str = ""
  tasks_include_path: str = ""


@dataclasses.dataclass(frozen=True)
class Config(_Section):
  """The whole config: the top-level keys and every section."""

  hardware: str = "auto"
  seed: int = 0
  steps: int = 200
  output_dir: str = "runs/default"
  log_every: int = 10
  model: Model = dataclasses.field(default_factory=Model)
  fit: Fit = dataclasses.field(default_factory=Fit)
  mesh: Mesh = dataclasses.field(default_factory=Mesh)
  pipeline: Pipeline = dataclasses.field(default_factory=Pipeline)
  data: Data = dataclasses.field(default_factory=Data)
  optimizer: Optimizer = dataclasses.field(default_factory=Optimizer)
  checkpoint: Checkpoint = dataclasses.field(default_factory=Checkpoint)
  runtime: Runtime = dataclasses.field(default_factory=Runtime)
  mfu: Mfu = dataclasses.field(default_factory=Mfu)
  profile: Profile = dataclasses.field(default_factory=Profile)
  monitor: Monitor = dataclasses.field(default_factory=Monitor)
  tracking: Tracking = dataclasses.field(default_factory=Tracking)
  faults: FaultDrills = dataclasses.field(default_factory=FaultDrills)
  guards: Guards = dataclasses.field(default_factory=Guards)
  watchdog: Watchdog = dataclasses.field(default_factory=Watchdog)
  fleet: Fleet = dataclasses.field(default_factory=Fleet)
  post: Post = dataclasses.field(default_factory=Post)
  eval: Eval = dataclasses.field(default_factory=Eval)

  @classmethod
  def of(cls, cfg: Any) -> "Config":
    """`cfg` typed: itself when it is, else built (strictly) from the ConfigDict or dict. The entry-point shell
    builds it once at load; the entry functions a test or a tool calls with a ConfigDict type it here."""
    return cfg if isinstance(cfg, Config) else cls.from_dict(cfg)


# Dotted path -> the dataclass of that (sub)section.
SECTIONS: dict[str, type[_Section]] = {}


def _index(cls: type[_Section], prefix: str = "") -> None:
  for f in dataclasses.fields(cls):
    kind = f.default_factory if f.default_factory is not dataclasses.MISSING else None
    if isinstance(kind, type) and issubclass(kind, _Section):
      SECTIONS[f"{prefix}{f.name}"] = kind
      _index(kind, f"{prefix}{f.name}.")


_index(Config)


def with_values(section: Any, changes: Mapping[str, Any]) -> Any:
  """A copy of `section` (a Config or any section) with the dotted keys of `changes` set, nested sections
  replaced on the way down; an undeclared key is a UserError naming it (with the nearest declared one)."""
  where = next((f"{path}." for path, cls in SECTIONS.items() if cls is type(section)), "")
  grouped: dict[str, dict[str, Any]] = {}
  direct = {}
  for key, value in changes.items():
    head, _, rest = key.partition(".")
    if head not in section or bool(rest) != (f"{where}{head}" in SECTIONS):
      raise unknown_key(f"{where}{key}")
    if rest:
      grouped.setdefault(head, {})[rest] = value
    else:
      direct[head] = value
  direct.update({head: with_values(section[head], sub) for head, sub in grouped.items()})
  return dataclasses.replace(section, **direct)
