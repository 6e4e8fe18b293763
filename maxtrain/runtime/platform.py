"""The platform's environment: XLA flags, Neuron compiler and runtime variables, JAX_PLATFORMS and
jax config, composed from a preset, the process's environment and the config, and applied before
JAX creates its backend (XLA reads XLA_FLAGS then; importing jax is fine, jax.devices() is not).

Precedence, lowest first: preset < the environment the process started with < config keys. Flag
strings (XLA_FLAGS, NEURON_CC_FLAGS, LIBTPU_INIT_ARGS) merge by flag name. `compose` is a pure
function of (runtime config, environment); `apply` writes the result and logs where each value
came from.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import logging
import os
import pkgutil
from typing import Any, Mapping, MutableMapping

from maxtrain.config import REDACTED, redact_text
from maxtrain.errors import UserError, choice, require
from maxtrain.runtime import cluster as cluster_lib
from maxtrain.runtime import flags
from maxtrain.runtime.cache import compile_cache_path

log = logging.getLogger("maxtrain")
PLATFORMS = ("auto", "cpu", "gpu", "neuron", "tpu")
NEURON_TARGETS = ("trn1", "trn2")

# H100/H200-class nodes. Sources: JAX "GPU performance tips", NVIDIA JAX-Toolbox "Tips for
# High-Performance LLMs with JAX and XLA", MaxText's a3 (H100) configs. Every flag must exist in
# this jaxlib: an unknown XLA flag aborts the process at backend start (tests/test_platform.py
# starts a backend with exactly these flags).
GPU_XLA_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",  # overlap collectives with compute
    "--xla_gpu_enable_highest_priority_async_stream=true",
    "--xla_gpu_all_reduce_combine_threshold_bytes=1073741824",  # few large collectives, not many small
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",  # >= one layer's FSDP all-gather
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    "--xla_gpu_enable_all_gather_combine_by_dim=false",
    "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
    "--xla_gpu_enable_pipelined_all_gather=true",  # prefetch the next scanned layer's weights
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
    "--xla_gpu_enable_triton_gemm=false",  # cuBLAS GEMMs
)
GPU_ENV = {
    "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9",  # JAX's default 0.75 leaves HBM unused; NVIDIA uses 0.8-0.9
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # one CUDA queue keeps the scheduler's collective order (Hopper)
}
# XLA:CPU runs every device's thunks on one intra-op pool of max(cores, devices) threads, and a collective holds its
# thread until all its participants arrive. The thunk executor runs a while loop holding a collective (the pipeline
# schedules' 0/1-trip op loops) beside an independent collective, so one device can hold two blocked threads: with
# 8 fake devices on a 2-core host all 8 were blocked and the devices that had not arrived never ran (gdb of a hung
# test, 2026-12-05). XLA sizes both pools from PJRT_NPROC: 4 threads per device keeps one free.
CPU_POOL_ENV = "PJRT_NPROC"
CPU_POOL_THREADS_PER_DEVICE = 4
CPU_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
NEURON_CC_BASE = "--model-type=transformer --distribution-strategy=llm-training -O1 --auto-cast=none"
NEURON_LNC_FLAG = "--logical-nc-config"
NEURON_DEFAULT_LNC = {"trn1": 1, "trn2": 2}
# JAX devices of a whole trn1.32xlarge (16 chips x 2 NeuronCore-v2) / trn2.48xlarge (16 x 8
# NeuronCore-v3, grouped in pairs under LNC=2). Other sizes: runtime.env=NEURON_PJRT_PROCESSES_NUM_DEVICES=...
NEURON_DEVICES_PER_NODE = {("trn1", 1): 32, ("trn2", 1): 128, ("trn2", 2): 64}
NEURON_EFA_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}
# Neuron device kinds -> (target, logical NeuronCore config).
DEVICE_KINDS = {"NC_v2": ("trn1", 1), "NC_v3": ("trn2", 1), "NC_v3d": ("trn2", 2)}
JAX_PLATFORM_NAMES = {"cpu": ("cpu",), "gpu": ("cuda", "gpu"), "neuron": ("neuron",), "tpu": ("tpu",)}
# Owned by runtime.platform / neuron_lnc / xla_flags / neuron_cc_flags: one way to set each.
RESERVED_ENV = {"JAX_PLATFORMS": "runtime.platform", "XLA_FLAGS": "runtime.xla_flags",
                "LIBTPU_INIT_ARGS": "runtime.xla_flags", "NEURON_CC_FLAGS": "runtime.neuron_cc_flags",
                "NEURON_LOGICAL_NC_CONFIG": "runtime.neuron_lnc"}
INSTALL = {
    "gpu": "a CUDA build of JAX: pip install -U 'jax[cuda12]' (or jax[cuda13]) on a machine with an NVIDIA "
           "driver",
    "neuron": "the Neuron PJRT plugin (packages jax-neuronx and libneuronxla), which comes from AWS's own package "
              "index, not PyPI: pip install 'jax-neuronx[stable]' --extra-index-url=https://pip.repos.neuron.amazonaws.com "
              "on a Trn1/Trn2 instance with the Neuron driver and runtime "
              "(https://awsdocs-neuron.readthedocs-hosted.com/en/latest/setup/jax/manual.html)",
    "tpu": "JAX's TPU runtime: pip install -U 'jax[tpu]' on a Cloud TPU VM",
}


@dataclasses.dataclass(frozen=True)
class PlatformEnv:
  platform: str
  env: dict[str, str]  # variables to set
  jax_config: dict[str, Any]  # jax.config updates
  sources: list[str]  # "NAME value: origin" for every value set or kept, for the log
  neuron_target: str = ""
  neuron_lnc: int = 0


def _neuron_normalize(name: str, value: str | None) -> tuple[str, str | None]:
  """neuronx-cc spells some flags several ways; merge them under one name."""
  if name in ("-lnc", "--lnc"):
    return NEURON_LNC_FLAG, value
  if name == "-O":
    return "--optlevel", value
  if name.startswith("-O") and name[2:].isdigit():
    return "--optlevel", name[2:]
  return name, value


def _decide(what: str, levels: list[tuple[str, list[tuple[str, str | None]]]],
            default: tuple[str, str]) -> tuple[str, str]:
  """The value of the highest-precedence level that states one; statements at that level must agree."""
  for _, statements in levels:
    stated = [(src, v) for src, v in statements if v not in (None, "")]
    if stated:
      if len({v for _, v in stated}) > 1:
        raise UserError(f"conflicting Neuron {what}: " + " vs ".join(f"{src}={v}" for src, v in stated)
                        + ". The compiler and the runtime must agree; set it in one place "
                        "(config.runtime.neuron_target / neuron_lnc).")
      return stated[0][1], " and ".join(src for src, _ in stated)
  return default


def _neuron(runtime_cfg, environ: Mapping[str, str], layout: cluster_lib.Cluster) -> tuple[
    str, int, list[tuple[str, str]], dict[str, tuple[str, str]], dict[str, tuple[str, str]]]:
  """Target, LNC, NEURON_CC_FLAGS layers, variables decided here, preset variables (env may win)."""
  env_cc = flags.parse(environ.get("NEURON_CC_FLAGS", ""), "environment", _neuron_normalize)
  cfg_cc = flags.parse(runtime_cfg.neuron_cc_flags, "config", _neuron_normalize)
  def stated(parsed: list[flags.Flag], name: str) -> str | None:
    flag = flags.find(parsed, name)
    return flag.value if flag else None

  target, target_src = _decide("target", [
      ("config", [("config.runtime.neuron_target", runtime_cfg.neuron_target),
                  ("config.runtime.neuron_cc_flags --target", stated(cfg_cc, "--target"))]),
      ("environment", [("$NEURON_CC_FLAGS --target", stated(env_cc, "--target"))]),
  ], ("trn2", "default for runtime.neuron_target='' (checked against the device kind at start)"))
  if target not in NEURON_TARGETS:
    raise UserError(f"Neuron target {target!r} ({target_src}): maxtrain supports {', '.join(NEURON_TARGETS)}")
  lnc_text, lnc_src = _decide("logical NeuronCore config (LNC)", [
      ("config", [("config.runtime.neuron_lnc", str(runtime_cfg.neuron_lnc or "")),
                  (f"config.runtime.neuron_cc_flags {NEURON_LNC_FLAG}", stated(cfg_cc, NEURON_LNC_FLAG))]),
      ("environment", [("$NEURON_LOGICAL_NC_CONFIG", environ.get("NEURON_LOGICAL_NC_CONFIG")),
                       (f"$NEURON_CC_FLAGS {NEURON_LNC_FLAG}", stated(env_cc, NEURON_LNC_FLAG))]),
  ], (str(NEURON_DEFAULT_LNC[target]), f"default of {target}"))
  if lnc_text not in ("1", "2") or (target == "trn1" and lnc_text != "1"):
    raise UserError(f"logical NeuronCore config {lnc_text} ({lnc_src}) is not valid on {target}: trn2 takes 1 or 2 "
                    "(default 2), trn1 only 1. Set config.runtime.neuron_lnc accordingly.")
  lnc = int(lnc_text)
  # trn1 has one LNC: its flag and variable are set only where the user stated them (checked above).
  lnc_layer = f" {NEURON_LNC_FLAG}={lnc}" if target == "trn2" else ""
  cc_layers = [(f"preset {target}", f"--target={target} {NEURON_CC_BASE}{lnc_layer}"),
               ("environment", environ.get("NEURON_CC_FLAGS", "")),
               ("config.runtime.neuron_cc_flags", runtime_cfg.neuron_cc_flags)]
  # A decision made by a key that is not a compiler flag (runtime.neuron_target / neuron_lnc,
  # $NEURON_LOGICAL_NC_CONFIG) must still reach the compiler.
  merged = flags.merge(cc_layers, _neuron_normalize)
  for name, want, src in (("--target", target, target_src), (NEURON_LNC_FLAG, str(lnc), lnc_src)):
    flag = flags.find(merged, name)
    if (flag.value if flag else None) != want and (name == "--target" or target == "trn2"):
      cc_layers.append((src, f"{name}={want}"))
  decided = {"NEURON_LOGICAL_NC_CONFIG": (str(lnc), lnc_src)} if target == "trn2" else {}
  preset: dict[str, tuple[str, str]] = {}
  cache = _compile_cache(runtime_cfg.compile_cache_dir)
  if cache:
    preset["NEURON_COMPILE_CACHE_URL"] = (cache, "preset neuron (under runtime.compile_cache_dir)")
  if layout.num_processes > 1:
    # One entry per process; the runtime's root communicator listens next to JAX's coordinator.
    per_process = NEURON_DEVICES_PER_NODE[(target, lnc)] * layout.num_nodes // layout.num_processes
    host, _, port = layout.coordinator.rpartition(":")
    derived = f"preset neuron, from the {layout.kind} layout"
    preset["NEURON_RT_ROOT_COMM_ID"] = (f"{host}:{int(port) + 1}", derived)
    preset["NEURON_PJRT_PROCESSES_NUM_DEVICES"] = (",".join([str(per_process)] * layout.num_processes), derived)
    preset["NEURON_PJRT_PROCESS_INDEX"] = (str(layout.process_id), derived)
    preset.update({k: (v, "preset neuron (EFA, multi-node)") for k, v in NEURON_EFA_ENV.items()})
  return target, lnc, cc_layers, decided, preset


def _compile_cache(setting: str) -> str:
  path = compile_cache_path(setting)
  return str(path / "neuron") if path else ""


def validate_runtime(r: Any) -> None:
  """The runtime keys, checked before the platform environment is composed."""
  choice("runtime.platform", r.platform, PLATFORMS)
  choice("runtime.cluster", r.cluster, cluster_lib.KINDS)
  choice("runtime.neuron_target", r.neuron_target, ("",) + NEURON_TARGETS)
  require(r.neuron_lnc in (0, 1, 2), f"config.runtime.neuron_lnc={r.neuron_lnc}: use 1 or 2 (0 = the target's "
           "default: 2 on trn2, 1 on trn1)")
  require(r.num_processes >= 0, f"config.runtime.num_processes={r.num_processes}: must be >= 0 (0 = detect)")
  require(r.process_id >= -1, f"config.runtime.process_id={r.process_id}: must be >= 0, or -1 to detect it")
  require(0 <= r.coordinator_port <= 65535,
           f"config.runtime.coordinator_port={r.coordinator_port}: must be a port, 1..65535 (0 = derived)")


def compose(runtime_cfg, environ: Mapping[str, str]) -> PlatformEnv:
  """What `apply` would set for `runtime_cfg` given the process environment `environ` (not modified)."""
  validate_runtime(runtime_cfg)
  platform = runtime_cfg.platform
  extra = flags.parse_env_list(runtime_cfg.env, "runtime.env")
  for name in extra:
    if name in RESERVED_ENV:
      raise UserError(f"config.runtime.env sets {name}: use config.{RESERVED_ENV[name]} instead, so that it is "
                      "merged with the preset and checked")
  env: dict[str, str] = {}
  sources: list[str] = []
  jax_config: dict[str, Any] = {}
  preset: dict[str, tuple[str, str]] = {}
  decided: dict[str, tuple[str, str]] = {}
  target, lnc = "", 0

  if platform != "auto":
    current = environ.get("JAX_PLATFORMS", "")
    if current.split(",")[0].strip() in JAX_PLATFORM_NAMES[platform]:
      decided["JAX_PLATFORMS"] = (current, "environment (agrees with runtime.platform)")
    else:
      replaced = f", replacing {current!r} from the environment" if current else ""
      decided["JAX_PLATFORMS"] = (JAX_PLATFORM_NAMES[platform][0], f"config.runtime.platform={platform}{replaced}")
    jax_config["jax_platforms"] = decided["JAX_PLATFORMS"][0]

  xla_var, xla_preset = ("LIBTPU_INIT_ARGS" if platform == "tpu" else "XLA_FLAGS"), ""
  if platform == "gpu":
    xla_preset = " ".join(GPU_XLA_FLAGS)
    preset.update({k: (v, "preset gpu") for k, v in GPU_ENV.items()})
  elif platform == "neuron":
    layout = cluster_lib.resolve(runtime_cfg, environ)
    target, lnc, cc_layers, neuron_decided, neuron_preset = _neuron(runtime_cfg, environ, layout)
    decided.update(neuron_decided)
    preset.update(neuron_preset)
    merged = flags.merge(cc_layers, _neuron_normalize)
    env["NEURON_CC_FLAGS"] = flags.render(merged)
    sources += [_flag_source("NEURON_CC_FLAGS", f) for f in merged]
    jax_config["jax_default_prng_impl"] = "rbg"  # Neuron has no threefry lowering worth using
  if xla_preset or runtime_cfg.xla_flags:
    merged = flags.merge([(f"preset {platform}", xla_preset), ("environment", environ.get(xla_var, "")),
                          ("config.runtime.xla_flags", runtime_cfg.xla_flags)])
    env[xla_var] = flags.render(merged)
    sources += [_flag_source(xla_var, f) for f in merged]

  if platform in ("cpu", "auto"):
    devices = cpu_device_count(environ.get("XLA_FLAGS", ""), runtime_cfg.xla_flags)
    if devices > 1:
      preset[CPU_POOL_ENV] = (cpu_pool_env(devices)[CPU_POOL_ENV],
                              f"preset cpu: {CPU_POOL_THREADS_PER_DEVICE} XLA:CPU pool threads per device of {devices}")

  for name, (value, origin) in preset.items():
    if name in environ:
      sources.append(f"{name}={environ[name]}: environment (preset would set {value})")
    else:
      env[name] = value
      sources.append(f"{name}={value}: {origin}")
  for name, (value, origin) in {**decided, **{k: (v, "config.runtime.env") for k, v in extra.items()}}.items():
    env[name] = value
    # runtime.env carries credentials (HF_TOKEN=...): its values are never logged.
    sources.append(f"{name}={REDACTED if origin == 'config.runtime.env' else value}: {origin}")
  sources += [f"jax.config {k}={v}: preset {platform}" for k, v in jax_config.items() if k != "jax_platforms"]
  return PlatformEnv(platform, env, jax_config, sources, target, lnc)


def cpu_device_count(*flag_texts: str) -> int:
  """XLA:CPU's device count from XLA_FLAGS texts (lowest precedence first): 1 when none sets it."""
  flag = flags.find(flags.merge([("", text) for text in flag_texts]), CPU_DEVICE_COUNT_FLAG)
  try:
    return int(flag.value) if flag and flag.value else 1
  except ValueError:
    raise UserError(f"XLA_FLAGS {flag.text}: the device count must be an integer") from None


def cpu_pool_env(devices: int) -> dict[str, str]:
  """The variable that sizes XLA:CPU's pools for `devices` fake devices (CPU_POOL_THREADS_PER_DEVICE says why)."""
  return {CPU_POOL_ENV: str(CPU_POOL_THREADS_PER_DEVICE * devices)}


def fake_cpu_devices(n: int, environ: MutableMapping[str, str] | None = None) -> int:
  """For tools, before jax starts its backend: XLA:CPU as `n` devices unless XLA_FLAGS already sets a count, with the
  pool threads the cpu preset gives them (an environment's PJRT_NPROC wins). Returns the device count."""
  environ = os.environ if environ is None else environ
  if cpu_device_count(environ.get("XLA_FLAGS", "")) == 1:
    environ["XLA_FLAGS"] = f"{environ.get('XLA_FLAGS', '')} {CPU_DEVICE_COUNT_FLAG}={n}".strip()
  devices = cpu_device_count(environ["XLA_FLAGS"])
  for name, value in cpu_pool_env(devices).items():
    environ.setdefault(name, value)
  return devices


def _flag_source(var: str, flag: flags.Flag) -> str:
  replaced = f", replacing {flag.replaced}" if flag.replaced and flag.replaced != flag.origin else ""
  return f"{var} {flag.text}: {flag.origin}{replaced}"


def installed_plugins() -> set[str]:
  """Names of the PJRT plugins JAX would load (without loading them) and of libtpu / libneuronxla."""
  names = {ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")}
  names |= {ep.value for ep in importlib.metadata.entry_points(group="jax_plugins")}
  spec = importlib.util.find_spec("jax_plugins")
  if spec is not None and spec.submodule_search_locations:
    names |= {m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)}
  names |= {m for m in ("libneuronxla", "libtpu") if importlib.util.find_spec(m) is not None}
  return names


def require_plugin(platform: str, installed: set[str]) -> None:
  """UserError (exit 2) naming what to install when the platform's JAX plugin is missing."""
  needle = {"gpu": "cuda", "neuron": "neuron", "tpu": "tpu"}.get(platform)
  if needle and not any(needle in name.lower() for name in installed):
    raise UserError(f"config.runtime.platform={platform} needs {INSTALL[platform]}. It is not installed in this "
                    f"Python ({len(installed)} JAX plugin(s) found: {', '.join(sorted(installed)) or 'none'}). "
                    "Install it, or run with --config.runtime.platform=auto (whatever JAX finds) or cpu.")


def apply(runtime_cfg, environ: MutableMapping[str, str] | None = None) -> PlatformEnv:
  """Composes and applies the platform environment; call before anything creates a JAX backend."""
  import jax
  from jax._src import xla_bridge

  environ = os.environ if environ is None else environ
  penv = compose(runtime_cfg, environ)
  require_plugin(penv.platform, installed_plugins())
  changed_env = {k: v for k, v in penv.env.items() if environ.get(k) != v}
  changed_jax = {k: v for k, v in penv.jax_config.items() if getattr(jax.config, k) != v}
  # Re-applying what is already in effect (a second run in one process) is harmless; changing it is not.
  if (changed_env or changed_jax) and xla_bridge.backends_are_initialized():
    raise RuntimeError("platform.apply after the JAX backend started: XLA_FLAGS and plugin variables would be "
                       f"ignored ({', '.join([*changed_env, *changed_jax])}). Call it before jax.devices() or any "
                       "computation.")
  environ.update(changed_env)
  for key, value in changed_jax.items():
    jax.config.update(key, value)
  log.info("platform %s: %d setting(s)%s", penv.platform, len(penv.sources),
           "".join(f"\n  {redact_text(s)}" for s in penv.sources))
  return penv


def parse_device_kind(kind: str) -> tuple[str, int] | None:
  """Neuron device kind -> (target, logical NeuronCore config); None for other devices."""
  return DEVICE_KINDS.get(kind.strip())


def check_devices(platform: str, device_platform: str, device_kind: str, environ: Mapping[str, str]) -> None:
  """After the backend started, before compiling: the devices are what the environment was composed for."""
  expected = {"cpu": "cpu", "gpu": "gpu", "neuron": "neuron", "tpu": "tpu"}.get(platform)
  if expected and device_platform != expected:
    raise UserError(f"config.runtime.platform={platform} but JAX started on {device_platform} devices "
                    f"({device_kind}); check JAX_PLATFORMS and the installed plugins")
  if device_platform != "neuron":
    return
  actual = parse_device_kind(device_kind)
  if actual is None:
    raise UserError(f"unknown Neuron device kind {device_kind!r}: expected one of {', '.join(DEVICE_KINDS)}")
  cc = flags.parse(environ.get("NEURON_CC_FLAGS", ""), "environment", _neuron_normalize)
  target = flags.find(cc, "--target")
  lnc_flag = flags.find(cc, NEURON_LNC_FLAG)
  lnc = environ.get("NEURON_LOGICAL_NC_CONFIG") or (lnc_flag.value if lnc_flag else None)
  if (target and target.value != actual[0]) or (lnc and int(lnc) != actual[1]):
    raise UserError(
        f"the devices are {device_kind} = {actual[0]} with logical NeuronCore config {actual[1]}, but the "
        f"compiler was set up for --target={target.value if target else '?'} with LNC {lnc or '?'}. Set "
        f"--config.runtime.neuron_target={actual[0]} --config.runtime.neuron_lnc={actual[1]} (or "
        "NEURON_LOGICAL_NC_CONFIG to the LNC you want, matching the compiler).")
