"""Config: the base definition (every key documented where declared), loading with overrides,
and validation with errors that name the key, the values and the fix.

`configs/*.py` presets call `base_config()` and change a few keys.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
from pathlib import Path
from typing import Any, Sequence

import ml_collections

from maxtrain.errors import UserError
from maxtrain.guards import SPIKE_ACTIONS
from maxtrain.sharding.mesh import AXES, DCN_AXES, MeshLayout, resolve_layout

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.py"
REMAT_CHOICES = ("none", "full", "dots")
DTYPES = ("float32", "bfloat16", "float16")
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd", "constant")
WSD_DECAYS = ("linear", "cosine")
STATE_DTYPES = ("float32", "bfloat16")
PARAM_KINDS = ("embed", "head", "norm", "bias", "matrix")  # maxtrain.optim.param_kind's classes


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.hardware = ""  # Hardware preset (e.g. cpu, h100x8, trn2.48xlarge) applied before --config.* overrides; "" = none.
  c.seed = 0  # All randomness (init, data order) derives from this.
  c.steps = 200  # Optimizer steps to train.
  c.output_dir = "runs/default"  # config.json, tensorboard/ and logs go here.
  c.log_every = 10  # Console line and TensorBoard scalars every N steps.

  c.model = m = ml_collections.ConfigDict()
  m.num_layers = 4  # Decoder blocks.
  m.d_model = 256  # Residual stream width.
  m.num_heads = 4  # Query heads; head_dim = d_model / num_heads.
  m.num_kv_heads = 2  # Key/value heads (grouped-query attention); divides num_heads.
  m.d_ff = 768  # SwiGLU hidden width.
  m.vocab_size = 384  # Embedding rows; >= the tokenizer's vocab (byte tokenizer: 259), padded for sharding.
  m.max_seq_len = 1024  # Longest sequence the model accepts (RoPE positions).
  m.rope_theta = 10000.0  # RoPE base frequency.
  m.tie_embeddings = False  # Reuse the input embedding as the output head.
  m.scan_layers = True  # Stack layers and lax.scan them: compile time independent of depth.
  m.remat = "none"  # Activation checkpointing per layer: none | full | dots (save matmul outputs).
  m.param_dtype = "float32"  # Storage dtype of parameters.
  m.compute_dtype = "float32"  # Matmul dtype (bf16 on accelerators; fp32 is faster on CPU).

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1  # Pure data parallel replicas.
  c.mesh.fsdp = -1  # Parameter-sharded data parallel; -1 takes the remaining devices.
  c.mesh.tensor = 1  # Tensor (model) parallel: heads, MLP and vocab dims.
  # The three above lay out one granule (a node: NVLink/NeuronLink/ICI); these lay out the granules
  # (across the network). At most one of all five may be -1.
  c.mesh.dcn_data = 1  # Data-parallel replicas across nodes.
  c.mesh.dcn_fsdp = 1  # FSDP across nodes (parameters sharded over the network too).

  c.data = d = ml_collections.ConfigDict()
  d.corpus = "python-stdlib"  # Embedded corpus, built and cached on first use; ignored when data.path is set.
  d.path = ""  # Token-store prefix from tools/index_data.py (reads PREFIX.train.* and PREFIX.val.*).
  d.tokenizer = "byte"  # "byte" or a path to a Hugging Face tokenizer.json (embedded corpus only).
  d.seq_len = 256  # Tokens per training sequence (documents are packed).
  d.batch_size = 16  # Global batch, in sequences, across all processes.

  c.optimizer = o = ml_collections.ConfigDict()
  o.name = "adamw"  # adamw | muon (Muon for hidden weight matrices, AdamW for embeddings, head, norms, biases).
  o.lr = 1.5e-3  # Peak learning rate: of every parameter (adamw), of the Muon matrices (muon).
  o.adam_lr = 1.5e-3  # Peak learning rate of the AdamW group when name=muon; unused by adamw.
  o.schedule = "cosine"  # cosine | wsd (warmup-stable-decay) | constant; every group follows the same shape.
  o.warmup_steps = 20  # Linear warmup from 0 at step 0 to the peak at step warmup_steps.
  o.min_lr_ratio = 0.1  # cosine and wsd decay to peak * min_lr_ratio (a ratio: each group has its own peak).
  o.decay_steps = 0  # Length of the LR schedule; 0 = steps. Set it to stop a run early on its planned schedule.
  o.decay_fraction = 0.2  # wsd: the last decay_fraction of the steps decay; the rest after warmup is flat.
  o.wsd_decay = "linear"  # wsd decay shape: linear | cosine.
  o.weight_decay = 0.1  # Decoupled weight decay, multiplied by the group's learning rate.
  o.no_decay = "embed,norm,bias"  # Parameter kinds without weight decay (of embed, head, norm, bias, matrix).
  o.clip_norm = 1.0  # Global gradient-norm clip; 0 disables.
  o.z_loss = 0.0  # Coefficient of the z-loss, mean log(Z)^2 of the softmax normaliser (PaLM: 1e-4); 0 disables.
  o.grad_accum_steps = 1  # Microbatches per step (scanned in the one jitted step): activation memory / k.
  o.microbatch_size = 0  # > 0: sequences per batch shard in each microbatch; sets grad_accum_steps for any node count.
  o.state_dtype = "float32"  # Dtype of optimizer moments (Adam mu and nu, Muon momentum).
  o.b1 = 0.9  # Adam first-moment decay.
  o.b2 = 0.95  # Adam second-moment decay.
  o.eps = 1e-8  # Adam epsilon.
  o.muon_momentum = 0.95  # Muon (Nesterov) momentum decay.
  o.muon_ns_steps = 5  # Newton-Schulz iterations orthogonalising the Muon momentum.
  o.muon_ns_coeffs = "3.4445,-4.7750,2.0315"  # a,b,c of the quintic step X <- aX + (bA + cA^2)X, A = XX^T.
  o.muon_consistent_rms = 0.0  # > 0: scale Muon updates to this RMS x sqrt(max dim) (Moonlight: 0.2); 0: sqrt(max(1, out/in)).

  c.checkpoint = k = ml_collections.ConfigDict()
  k.dir = ""  # Where checkpoints go; "" = <output_dir>/checkpoints.
  k.every_steps = 100  # Save every N steps (and always at the end and on preemption); 0: only those.
  k.max_to_keep = 3  # Newest checkpoints kept; 0 keeps all.
  k.keep_every = 0  # Also keep every checkpoint whose step is a multiple of this, forever; 0: none.
  k.resume = "auto"  # auto (newest complete checkpoint, if any) | never | a step number | a checkpoint path.
  k.async_save = True  # Write in the background; the loop blocks only for the device-to-host copy.

  c.runtime = ml_collections.ConfigDict()
  c.runtime.compile_cache_dir = ""  # Persistent XLA compile cache: "" = <maxtrain cache>/xla, "none" = off.
  c.runtime.num_processes = 0  # JAX processes of the job; 0 = detect (SLURM, Open MPI, Kubernetes; none found: 1).
  c.runtime.process_id = -1  # This process's index in 0..num_processes-1; -1 = detect (none found: 0).
  c.runtime.coordinator = ""  # host:port of process 0's coordinator service; "" = detect.
  c.runtime.cluster = "auto"  # Launcher to detect the layout from: auto | none | slurm | openmpi | kubernetes.
  c.runtime.coordinator_port = 0  # Port of a detected coordinator; 0 = derived from the job id (maxtrain/cluster.py).
  c.runtime.platform = "auto"  # auto (JAX picks, no presets) | cpu | gpu | neuron | tpu: sets the platform's flags and env.
  c.runtime.neuron_target = ""  # trn1 | trn2; "" = --target of $NEURON_CC_FLAGS, else trn2 (checked against the devices).
  c.runtime.neuron_lnc = 0  # Logical NeuronCore config, 1 or 2, for compiler and runtime alike; 0 = the target's default.
  c.runtime.xla_flags = ""  # Extra XLA flags ("--a=1 --b=2"); replace preset and $XLA_FLAGS flags of the same name.
  c.runtime.neuron_cc_flags = ""  # Extra Neuron compiler flags; replace preset and $NEURON_CC_FLAGS flags by name.
  c.runtime.env = ""  # Extra environment variables "KEY=VALUE,KEY=VALUE"; win over presets and the environment.

  c.mfu = ml_collections.ConfigDict()
  c.mfu.peak_flops = 0.0  # Peak FLOP/s per device for MFU; 0 = the device table, or measured on CPU.

  c.profile = ml_collections.ConfigDict()
  c.profile.start_step = -1  # First step traced by jax.profiler into <output_dir>/tensorboard; -1 = off.
  c.profile.num_steps = 3  # Steps in the trace.

  c.monitor = ml_collections.ConfigDict()
  c.monitor.prometheus_port = 0  # Serve Prometheus /metrics on this port (each process, its own host); 0 = off.

  c.faults = f = ml_collections.ConfigDict()  # Fault injection for tests and drills; -1 = off.
  f.sigterm_at_step = -1  # Send SIGTERM to itself after this step (exercises preemption).
  f.kill_during_save_at_step = -1  # SIGKILL itself while this step's checkpoint is being written.
  f.crash_at_step = -1  # Raise an exception after this step (exit 1, a crash).
  f.hang_at_step = -1  # Block forever after this step (the watchdog must fire).
  f.nan_at_step = -1  # Make this step's loss and gradients NaN (in-graph).
  f.spike_at_step = -1  # Multiply this step's loss and gradients by spike_factor (in-graph).
  f.spike_factor = 100.0

  c.guards = g = ml_collections.ConfigDict()
  g.max_consecutive_bad = 3  # Non-finite steps in a row (each skipped in-graph) before a rollback.
  g.spike_window = 32  # Recorded losses the spike statistics use.
  g.spike_warmup = 20  # Recorded losses needed before spikes are detected.
  g.spike_zscore = 6.0  # A loss above mean + spike_zscore x std of the window is a spike (its update is skipped).
  g.spike_action = "skip"  # skip (just the update) | rollback (to the newest checkpoint, data skips ahead) | abort.
  g.max_rollbacks = 3  # Rollbacks allowed per run (counted across restarts), then abort.

  c.watchdog = ml_collections.ConfigDict()
  c.watchdog.timeout_s = 600.0  # Exit 76 with stack dumps when no step completes for this long; 0 = off.
  c.watchdog.startup_timeout_s = 1800.0  # Allowance before the first step (restore + compile).

  c.eval = ml_collections.ConfigDict()
  c.eval.every_steps = 50  # Eval loss on the validation store every N steps (and at the end); 0: end only.
  c.eval.batches = 4  # Validation batches (of data.batch_size) per eval.
  return c


def _flat_keys(cfg: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  keys = []
  for k, v in cfg.items():
    if isinstance(v, ml_collections.ConfigDict):
      keys += _flat_keys(v, f"{prefix}{k}.")
    else:
      keys.append(f"{prefix}{k}")
  return keys


def _unknown_key(key: str, cfg: ml_collections.ConfigDict) -> UserError:
  close = difflib.get_close_matches(key, _flat_keys(cfg), n=3, cutoff=0.5)
  hint = f" Did you mean {' or '.join('config.' + c for c in close)}?" if close else ""
  return UserError(f"unknown config key config.{key}.{hint} See the config keys in README.md.")


def _parse_value(key: str, text: str, current: Any) -> Any:
  try:
    if isinstance(current, bool):
      low = text.lower()
      if low in ("true", "1", "yes"):
        return True
      if low in ("false", "0", "no"):
        return False
      raise ValueError
    if isinstance(current, int):
      return int(text)
    if isinstance(current, float):
      return float(text)
  except ValueError:
    raise UserError(
        f"config.{key}={text!r}: expected a {type(current).__name__} (current value {current!r})"
    ) from None
  return text


def set_override(cfg: ml_collections.ConfigDict, key: str, text: str) -> None:
  node, *_ = cfg, None
  parts = key.split(".")
  for part in parts[:-1]:
    if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
      raise _unknown_key(key, cfg)
    node = node[part]
  if parts[-1] not in node or isinstance(node[parts[-1]], ml_collections.ConfigDict):
    raise _unknown_key(key, cfg)
  node[parts[-1]] = _parse_value(key, text, node[parts[-1]])


def load_file(path: str | Path) -> tuple[ml_collections.ConfigDict, dict[str, dict[str, Any]]]:
  """The config of a preset file and its model-specific hardware presets (`HARDWARE`, may be absent)."""
  path = Path(path)
  if not path.is_file():
    raise UserError(f"--config={path}: no such file. Configs live in {REPO_ROOT / 'configs'}.")
  spec = importlib.util.spec_from_file_location(f"maxtrain_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise UserError(f"--config={path}: the file must define get_config() returning a ConfigDict")
  return module.get_config(), getattr(module, "HARDWARE", {})


def apply_hardware(cfg: ml_collections.ConfigDict, name: str, model_presets: dict[str, dict[str, Any]]) -> None:
  """Sets the keys of hardware preset `name` (maxtrain/hardware.py, then the config file's HARDWARE)."""
  from maxtrain import hardware

  for key, value in hardware.preset(name, model_presets).items():
    set_override(cfg, key, str(value))
  cfg.hardware = name


def load(argv: Sequence[str]) -> ml_collections.ConfigDict:
  """`--config=PATH` (default configs/default.py), its hardware preset (`hardware`, from the file or the
  command line), then `--config.a.b=value` overrides, in order."""
  path, overrides = DEFAULT_CONFIG, []
  args = list(argv)
  while args:
    arg = args.pop(0)
    if arg.startswith("--config.") or arg.startswith("--config="):
      name, eq, value = arg[2:].partition("=")
      if not eq:
        if not args:
          raise UserError(f"{arg}: missing value (use {arg}=VALUE)")
        value = args.pop(0)
    elif arg == "--config":
      if not args:
        raise UserError("--config: missing path")
      name, value = "config", args.pop(0)
    else:
      raise UserError(f"unexpected argument {arg!r}: use --config=PATH and --config.KEY=VALUE")
    if name == "config":
      path = value
    else:
      overrides.append((name[len("config."):], value))
  cfg, model_presets = load_file(path)
  # The hardware preset goes first so that every explicit --config.* override wins over it.
  hardware_name = next((v for k, v in reversed(overrides) if k == "hardware"), cfg.hardware)
  if hardware_name:
    apply_hardware(cfg, hardware_name, model_presets)
  for key, value in overrides:
    set_override(cfg, key, value)
  cfg.lock()
  return cfg


def _require(ok: bool, message: str) -> None:
  if not ok:
    raise UserError(message)


def validate(cfg: ml_collections.ConfigDict, num_devices: int, num_processes: int = 1, *,
             require_data: bool = True) -> MeshLayout:
  """Checks everything that can be checked before touching data or compiling (`require_data=False`:
  everything but the data source, for ahead-of-time compiles), and sets the derived
  `optimizer.grad_accum_steps` when `optimizer.microbatch_size` is given.

  Returns the resolved mesh layout (its `.shape` is the combined (data, fsdp, tensor)).
  """
  m, d, o = cfg.model, cfg.data, cfg.optimizer
  for key in ("steps", "log_every"):
    _require(cfg[key] > 0, f"config.{key}={cfg[key]}: must be > 0")
  for key in ("num_layers", "d_model", "num_heads", "num_kv_heads", "d_ff", "vocab_size", "max_seq_len"):
    _require(m[key] > 0, f"config.model.{key}={m[key]}: must be > 0")
  _require(m.d_model % m.num_heads == 0,
           f"config.model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}")
  _require((m.d_model // m.num_heads) % 2 == 0,
           f"head_dim = model.d_model / model.num_heads = {m.d_model // m.num_heads} must be even for RoPE")
  _require(m.num_heads % m.num_kv_heads == 0,
           f"config.model.num_heads={m.num_heads} is not divisible by model.num_kv_heads={m.num_kv_heads}")
  _require(m.remat in REMAT_CHOICES, f"config.model.remat={m.remat!r}: choose one of {REMAT_CHOICES}")
  for key in ("param_dtype", "compute_dtype"):
    _require(m[key] in DTYPES, f"config.model.{key}={m[key]!r}: choose one of {DTYPES}")
  _require(bool(d.corpus) or bool(d.path) or not require_data,
           "config.data.corpus and config.data.path are both empty: set data.path to a token store "
           "prefix (tools/index_data.py) or data.corpus to 'python-stdlib'")
  _require(0 < d.seq_len <= m.max_seq_len,
           f"config.data.seq_len={d.seq_len} must be in 1..model.max_seq_len={m.max_seq_len}")
  _require(o.decay_steps >= 0, f"config.optimizer.decay_steps={o.decay_steps}: must be >= 0 (0 = steps)")
  _validate_optimizer(o, o.decay_steps or cfg.steps)
  gd = cfg.guards
  _choice("guards.spike_action", gd.spike_action, SPIKE_ACTIONS)
  for key in ("max_consecutive_bad", "spike_window"):
    _require(gd[key] >= 1, f"config.guards.{key}={gd[key]}: must be >= 1")
  for key in ("spike_warmup", "max_rollbacks"):
    _require(gd[key] >= 0, f"config.guards.{key}={gd[key]}: must be >= 0")
  _require(gd.spike_zscore > 0, f"config.guards.spike_zscore={gd.spike_zscore}: must be > 0")
  ck = cfg.checkpoint
  for key in ("every_steps", "max_to_keep", "keep_every"):
    _require(ck[key] >= 0, f"config.checkpoint.{key}={ck[key]}: must be >= 0")
  _require(ck.resume in ("auto", "never") or ck.resume.isdigit() or "/" in ck.resume,
           f"config.checkpoint.resume={ck.resume!r}: use auto, never, a step number or a checkpoint path")
  _require(cfg.eval.every_steps >= 0, f"config.eval.every_steps={cfg.eval.every_steps}: must be >= 0")
  _require(cfg.eval.batches > 0, f"config.eval.batches={cfg.eval.batches}: must be > 0")

  layout = resolve_layout({a: cfg.mesh[a] for a in AXES + DCN_AXES}, num_devices)
  data, fsdp, tensor = layout.shape
  mesh_txt = f"mesh data={data} x fsdp={fsdp} x tensor={tensor}"
  for key in ("num_heads", "num_kv_heads", "d_ff", "vocab_size"):
    _require(m[key] % tensor == 0,
             f"config.model.{key}={m[key]} is not divisible by mesh.tensor={tensor}: tensor parallelism "
             f"splits this dim across {tensor} devices. Choose mesh.tensor dividing it, or change the model.")
  for key in ("d_model", "vocab_size"):
    _require(m[key] % fsdp == 0,
             f"config.model.{key}={m[key]} is not divisible by mesh.fsdp={fsdp} ({mesh_txt}): FSDP shards "
             "this dim. Choose another mesh.fsdp or model size.")
  batch_shards = data * fsdp
  _require(d.batch_size % batch_shards == 0,
           f"config.data.batch_size={d.batch_size} is not divisible by data x fsdp = {data} x {fsdp} = "
           f"{batch_shards} ({mesh_txt}): each batch shard needs the same number of sequences.")
  _require(d.batch_size % num_processes == 0,
           f"config.data.batch_size={d.batch_size} is not divisible by the {num_processes} processes")
  per_process, per_shard = d.batch_size // num_processes, d.batch_size // batch_shards
  _require(o.microbatch_size >= 0, f"config.optimizer.microbatch_size={o.microbatch_size}: must be >= 0 (0 = off)")
  if o.microbatch_size:
    # The one derived key: activation memory per device stays the same whatever the node count.
    _require(per_shard % o.microbatch_size == 0,
             f"config.optimizer.microbatch_size={o.microbatch_size} does not divide the {per_shard} sequences per "
             f"batch shard (data.batch_size={d.batch_size} / data x fsdp = {batch_shards}, {mesh_txt})")
    o.grad_accum_steps = per_shard // o.microbatch_size
  k = o.grad_accum_steps
  _require(per_process % k == 0 and per_shard % k == 0,
           f"config.optimizer.grad_accum_steps={k} does not divide the batch: data.batch_size={d.batch_size} "
           f"is {per_process} sequences per process ({num_processes} processes) and {per_shard} per batch shard "
           f"(data x fsdp = {batch_shards}, {mesh_txt}); every shard must split into {k} equal microbatches. "
           f"Choose grad_accum_steps dividing {math.gcd(per_process, per_shard)}, or a batch_size that is a "
           f"multiple of {k} x {batch_shards} = {k * batch_shards}.")
  return layout


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
  if value not in choices:
    close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise UserError(f"config.{key}={value!r}: choose one of {', '.join(choices)}.{hint}")


def _validate_optimizer(o: ml_collections.ConfigDict, steps: int) -> None:
  _choice("optimizer.name", o.name, OPTIMIZERS)
  _choice("optimizer.schedule", o.schedule, SCHEDULES)
  _choice("optimizer.wsd_decay", o.wsd_decay, WSD_DECAYS)
  _choice("optimizer.state_dtype", o.state_dtype, STATE_DTYPES)
  for key in ("lr", "adam_lr"):
    _require(o[key] > 0, f"config.optimizer.{key}={o[key]}: a learning rate must be > 0 (the peak of the schedule)")
  _require(o.warmup_steps >= 0, f"config.optimizer.warmup_steps={o.warmup_steps}: must be >= 0")
  _require(0 <= o.min_lr_ratio <= 1, f"config.optimizer.min_lr_ratio={o.min_lr_ratio}: must be in [0, 1]")
  _require(0 < o.decay_fraction <= 1, f"config.optimizer.decay_fraction={o.decay_fraction}: must be in (0, 1]")
  if o.schedule == "wsd":
    decay_start = steps - max(round(o.decay_fraction * steps), 1)
    _require(o.warmup_steps <= decay_start,
             f"config.optimizer.warmup_steps={o.warmup_steps} runs into the wsd decay, which starts at step "
             f"steps - round(decay_fraction x steps) = {steps} - round({o.decay_fraction} x {steps}) = {decay_start}. "
             "Shorten the warmup or the decay_fraction.")
  for key in ("weight_decay", "clip_norm", "z_loss"):
    _require(o[key] >= 0, f"config.optimizer.{key}={o[key]}: must be >= 0 (0 disables)")
  unknown = [k for k in (k.strip() for k in o.no_decay.split(",")) if k and k not in PARAM_KINDS]
  _require(not unknown, f"config.optimizer.no_decay={o.no_decay!r}: {', '.join(map(repr, unknown))} is not a "
           f"parameter kind; list some of {', '.join(PARAM_KINDS)}, comma-separated (empty: decay everything)")
  _require(o.grad_accum_steps >= 1, f"config.optimizer.grad_accum_steps={o.grad_accum_steps}: must be >= 1")
  _require(0 <= o.muon_momentum < 1, f"config.optimizer.muon_momentum={o.muon_momentum}: must be in [0, 1)")
  _require(o.muon_ns_steps >= 1, f"config.optimizer.muon_ns_steps={o.muon_ns_steps}: must be >= 1")
  try:
    three_numbers = len([float(c) for c in o.muon_ns_coeffs.split(",")]) == 3
  except ValueError:
    three_numbers = False
  _require(three_numbers, f"config.optimizer.muon_ns_coeffs={o.muon_ns_coeffs!r}: expected three numbers 'a,b,c', "
           "e.g. '3.4445,-4.7750,2.0315'")
  _require(o.muon_consistent_rms >= 0,
           f"config.optimizer.muon_consistent_rms={o.muon_consistent_rms}: must be >= 0 (0: width scaling)")


def validate_runtime(r: ml_collections.ConfigDict) -> None:
  """The runtime keys, checked before the platform environment is composed (maxtrain/platform.py)."""
  from maxtrain import cluster, platform

  _choice("runtime.platform", r.platform, platform.PLATFORMS)
  _choice("runtime.cluster", r.cluster, cluster.KINDS)
  _choice("runtime.neuron_target", r.neuron_target, ("",) + platform.NEURON_TARGETS)
  _require(r.neuron_lnc in (0, 1, 2), f"config.runtime.neuron_lnc={r.neuron_lnc}: use 1 or 2 (0 = the target's "
           "default: 2 on trn2, 1 on trn1)")
  _require(r.num_processes >= 0, f"config.runtime.num_processes={r.num_processes}: must be >= 0 (0 = detect)")
  _require(r.process_id >= -1, f"config.runtime.process_id={r.process_id}: must be >= 0, or -1 to detect it")
  _require(0 <= r.coordinator_port <= 65535,
           f"config.runtime.coordinator_port={r.coordinator_port}: must be a port, 1..65535 (0 = derived)")


def save(cfg: ml_collections.ConfigDict, path: str | Path) -> None:
  Path(path).write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n")
