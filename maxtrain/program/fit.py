"""Device and host memory of a compiled step (`Memory`), and `model.remat=auto`: the remat policy chosen ahead
of time for the target.

`choose_remat` compiles the train step once per candidate policy (none, dots, offload, full) for the mesh the
run will use, reads each one's device peak and host bytes, estimates each one's step time with a small cost
model, and picks the fastest whose device peak fits the target's memory with `fit.headroom` to spare. The
figures are cached (a JSON file per config and device set under the maxtrain cache; the persistent XLA cache
keeps the compiles). The table of candidates is logged before training and printed by `maxtrain.compile`.

Cost model, per device and step (an estimate to rank the candidates, not a measurement):
  time = tokens x (train FLOPs per token + recompute FLOPs per token) / peak FLOP/s
         + 2 x host bytes / host link bandwidth       (each offloaded byte goes out and back; no overlap assumed)
Recompute per token, of the layers' forward FLOPs F: none 0; dots the attention's score and value matmuls
(batched dots are not saved); offload F less the output projections of attention and MLP (`wo`, `down`: their
outputs are the layer's named activations, or not needed); full F.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
from typing import Any, Callable, Sequence

import jax

from maxtrain.config import schema
from maxtrain.errors import UserError, require
from maxtrain.runtime import cache
import maxtrain
from maxtrain.models import registry
from maxtrain.monitor import mfu

log = logging.getLogger("maxtrain")
GiB = 2**30

# Memory space 5 is XLA's host memory (`pinned_host`); a compiled layout marks such a buffer `{...S(5)}`.
_HOST_SPACE = "S(5)"
_SHAPE = re.compile(r"(\w+)\[([0-9,]*)\](\{[^{}]*\})?")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
             "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def entry_buffers(hlo_text: str) -> tuple[list[tuple[int, bool]], list[tuple[int, bool]], list[int]]:
  """(parameters, outputs: each (bytes on one device, in host memory), the outputs aliased to a parameter)
  from the compiled module's `entry_computation_layout` and `input_output_alias`."""
  header = hlo_text.split("\n", 1)[0]
  layout = re.search(r"entry_computation_layout=\{(.*)\}", header)
  if not layout:
    return [], [], []
  params, _, outputs = layout.group(1).partition(")->")

  def buffers(text: str) -> list[tuple[int, bool]]:
    return [(math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE.get(dtype, 4), _HOST_SPACE in (where or ""))
            for dtype, dims, where in _SHAPE.findall(text)]

  aliases = re.search(r"input_output_alias=\{(.*?)\}, entry", header)
  aliased = [int(i) for i in re.findall(r"\{(\d+)\}: \(", aliases.group(1))] if aliases else []
  return buffers(params), buffers(outputs), aliased


@dataclasses.dataclass(frozen=True)
class Memory:
  """Per-device bytes from `Compiled.memory_analysis()`: device memory, and host memory (`pinned_host`:
  an offloaded optimizer state, `optim/offload.py`; activations of `model.remat=offload`)."""
  arguments: int
  outputs: int
  aliased: int  # outputs written into donated argument buffers (the new state into the old)
  temporaries: int
  generated_code: int
  host_arguments: int = 0
  host_outputs: int = 0
  host_aliased: int = 0
  host_temporaries: int = 0

  @property
  def peak(self) -> int:
    """Device memory at the step's peak."""
    return self.arguments + self.outputs - self.aliased + self.temporaries

  @property
  def host(self) -> int:
    """Host memory the step holds (pinned_host buffers)."""
    return self.host_arguments + self.host_outputs - self.host_aliased + self.host_temporaries

  @classmethod
  def of(cls, compiled: Any) -> "Memory":
    """XLA's figures. XLA:CPU reports no host bytes: host and device are one RAM there, and it counts the
    pinned_host buffers with the device's. Those it keeps at the step's entry and exit (an offloaded
    optimizer state) are then read from the compiled entry layout (memory space S(5)) and moved from
    the device's columns to the host's, as a GPU's memory_analysis reports them."""
    m = compiled.memory_analysis()
    mem = cls(arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes, aliased=m.alias_size_in_bytes,
              temporaries=m.temp_size_in_bytes, generated_code=m.generated_code_size_in_bytes,
              host_arguments=getattr(m, "host_argument_size_in_bytes", 0),
              host_outputs=getattr(m, "host_output_size_in_bytes", 0),
              host_aliased=getattr(m, "host_alias_size_in_bytes", 0),
              host_temporaries=getattr(m, "host_temp_size_in_bytes", 0))
    if mem.host:
      return mem
    params, outputs, aliased = entry_buffers(compiled.as_text())
    host_in = sum(n for n, host in params if host)
    host_out = sum(n for n, host in outputs if host)
    host_aliased = sum(outputs[i][0] for i in aliased if i < len(outputs) and outputs[i][1])
    if not host_in and not host_out:
      return mem
    return dataclasses.replace(mem, arguments=mem.arguments - host_in, outputs=mem.outputs - host_out,
                               aliased=mem.aliased - host_aliased, host_arguments=host_in, host_outputs=host_out,
                               host_aliased=host_aliased)


# ---- memory stand-ins for ahead-of-time compiles on XLA:CPU --------------------------------------------

DROPLESS, UNSCANNED_REMAT = "dropless", "unscanned_remat"


def cpu_far_parts(model_cfg: Any) -> list[str]:
  """The parts of this model whose memory XLA:CPU gets far from a GPU's or Trainium's, the one test both
  `standin_changes` (what the stand-in replaces) and aot/compile.py `cpu_caveats` (what a report warns about) ask:
  DROPLESS, a dropless MoE (lax.ragged_dot, lowered densely over every expert), and UNSCANNED_REMAT, remat in an
  unscanned stack of more than one layer (XLA:CPU merges each layer's recompute back into its forward:
  tools/remat_unscanned.py). remat=auto counts: each of its candidates compiles as remat=none there."""
  out = []
  if model_cfg.moe.enabled and model_cfg.moe.dispatch == "dropless":
    out.append(DROPLESS)
  if not model_cfg.scan_layers and model_cfg.remat != "none" and model_cfg.num_layers > 1:
    out.append(UNSCANNED_REMAT)
  return out


def standin_changes(model_cfg: Any) -> list[str]:
  """What `memory_standin` changes in this model, one line per part of `cpu_far_parts` (empty: it compiles as it is)."""
  lines = {
      DROPLESS: "model.moe.dispatch=dropless: the experts' grouped matmuls are compiled as one batched matmul over "
                "equal groups (models/moe_dispatch.py balanced_ragged_dot: the buffers and FLOPs of a grouped-matmul "
                "kernel with every expert equally loaded), not lax.ragged_dot, which XLA:CPU lowers densely over "
                "every expert",
      UNSCANNED_REMAT: f"unscanned layers with model.remat={model_cfg.remat}: compiled as one scanned stack of the "
                       "same parameters, every layer with the window of the local layers (flash's memory is linear in "
                       "T whatever the window), as XLA:CPU keeps no remat in an unscanned stack"}
  return [lines[part] for part in cpu_far_parts(model_cfg)]


def memory_standin(model_cfg: Any) -> Any:
  """The model a compile on XLA:CPU measures for a GPU or Trainium target (`standin_changes`): the same
  parameters, the same activations per layer, the memory of the target's kernels. Compiled, never run: with
  unequal expert loads its values are not the model's."""
  changes: dict[str, Any] = {"memory_standin": True}
  if UNSCANNED_REMAT in cpu_far_parts(model_cfg):
    changes.update(scan_layers=True, window_layers="all", window_pattern=0, rope_local_theta=0.0)
  return dataclasses.replace(model_cfg, **changes)


# ---- model.remat=auto ---------------------------------------------------------------------------------

CANDIDATES = ("none", "dots", "offload", "full")


@dataclasses.dataclass(frozen=True)
class Target:
  """What the cost model and the fit check know of one device of the target."""
  name: str
  memory_bytes: int
  flops: float  # dense peak FLOP/s at the compute dtype
  host_bandwidth: float  # bytes/s each way between host and device memory; 0: no host offload there
  source: str
  # The interconnects (program/schedule_fit.py: pipeline or fsdp across the network). 0: not known.
  network_bandwidth: float = 0.0  # bytes/s each way per node across the data-centre network (all its NICs)
  link_bandwidth: float = 0.0  # bytes/s each way per device over the node's fast interconnect (NVLink, NeuronLink)


# One device of each hardware preset. Memory: the usable HBM per device (H100 SXM 80 GB; H200 141 GB; a trn2
# LNC=2 core: 96 GiB per chip / 4). Host link: PCIe Gen5 x16 (64 GB/s per direction, ~55 achieved).
# Network, per node each way: DGX H100/H200 have 8 ConnectX-7 400 Gb/s InfiniBand NICs (one per GPU: 8 x 50 GB/s);
# trn2.48xlarge 3.2 Tb/s of EFAv3 (400 GB/s). Inside a node, per device each way: NVLink 4 900 GB/s per GPU (both
# directions: 450 GB/s each way); NeuronLink-v3 1.28 TB/s per Trainium2 chip (taken as both directions: 640 GB/s
# each way, shared by its 4 LNC=2 cores: 160 GB/s). Published peaks: achieved bandwidth is lower (~80-90%).
TARGETS = {
    "h100x8": Target("H100 SXM", 80 * GiB, 989e12, 55e9, "H100 datasheet (989 TFLOP/s bf16 dense); PCIe Gen5 x16",
                     network_bandwidth=8 * 50e9, link_bandwidth=450e9),
    "h200x8": Target("H200 SXM", 141 * 10**9, 989e12, 55e9, "H200 datasheet (141 GB, 989 TFLOP/s bf16 dense); PCIe Gen5 x16",
                     network_bandwidth=8 * 50e9, link_bandwidth=450e9),
    "trn2.48xlarge": Target("trn2 core (LNC=2)", 24 * GiB, 2 * 667e12 / 8, 0.0,
                            "Trainium2 architecture: 96 GiB, 667 TFLOP/s per chip of 4 LNC=2 cores; no host memory kind",
                            network_bandwidth=400e9, link_bandwidth=640e9 / 4),
}
# XLA:CPU: host and device memory are the same RAM; an offload (and a collective between fake devices) is a memcpy.
CPU_MEMCPY_BANDWIDTH = 10e9


def cpu_target(devices: Sequence[Any]) -> Target:
  """This machine's CPU devices: the available RAM and the measured matmul peak, shared by the devices."""
  n = max(len(devices), 1)
  try:
    with open("/proc/meminfo") as f:
      available = int(dict(line.split(":", 1) for line in f)["MemAvailable"].split()[0]) * 1024
  except (OSError, KeyError, ValueError):
    available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  flops, how = mfu.cached_cpu_peak()
  return Target(f"CPU device (1/{n} of this host)", available // n, flops / n, CPU_MEMCPY_BANDWIDTH,
                f"available RAM / {n}; {how}", network_bandwidth=CPU_MEMCPY_BANDWIDTH, link_bandwidth=CPU_MEMCPY_BANDWIDTH)


def target_for(cfg: schema.Config, devices: Sequence[Any]) -> Target:
  """The hardware preset's device when the config names one (an ahead-of-time compile for it), else the
  devices at hand."""
  if cfg.hardware in TARGETS:
    return TARGETS[cfg.hardware]
  if devices and devices[0].platform == "cpu":
    return cpu_target(devices)
  raise UserError(f"model.remat=auto needs the target's memory and speed: config.hardware={cfg.hardware!r} is none "
                  f"of {', '.join(TARGETS)} and the devices are {devices[0].platform if devices else 'none'}; set "
                  "config.hardware to the target's preset, or choose model.remat (none, dots, offload, full)")


def recompute_flops_per_token(m: Any, remat: str, seq_len: int) -> float:
  """Forward FLOPs per token the backward pass recomputes under `remat` (see the module docstring)."""
  if remat == "none":
    return 0.0
  n, h, d = m.num_heads, m.head_dim, m.d_model
  window = m.sliding_window if 0 < m.sliding_window < seq_len else seq_len
  attention_forward = m.num_layers * 2.0 * n * h * (window + 1)  # scores and values, ~ (keys seen) x 2 x 2 / 2
  if remat == "dots":
    return attention_forward
  layers_forward = (m.train_flops_per_token(seq_len) - 6.0 * d * m.vocab_size) / 3
  if remat == "full":
    return layers_forward
  # offload: every matmul but the attention's output projection and the MLP's down projection
  dense = m.num_layers - m.moe.num_moe_layers(m.num_layers)
  return layers_forward - 2.0 * (m.num_layers * n * h * d + dense * m.d_ff * d)


def offloaded_activation_bytes(cfg: schema.Config, plan: Any) -> tuple[int, int]:
  """(host bytes held per device, bytes moved each way per step) of `model.remat=offload`: per layer the
  activations the decoder names that the backward pass needs (`residual` and `mlp_in`, each [b, T, D] in the
  compute dtype; `attn_out` is not needed: recomputed from nothing), for one microbatch at a time."""
  import jax.numpy as jnp

  m = cfg.model
  seq_local = cfg.data.seq_len // plan.layout.shards("act_length")
  per_microbatch = 2 * m.num_layers * plan.batch.per_microbatch * seq_local * m.d_model * jnp.dtype(m.compute_dtype).itemsize
  return per_microbatch, per_microbatch * plan.batch.num_microbatches


@dataclasses.dataclass(frozen=True)
class Candidate:
  remat: str
  device_peak: int  # bytes per device
  host: int  # bytes per device in host memory
  moved: int  # bytes crossing the host link per step, both directions together
  flops: float  # per device per step, recompute included
  step_seconds: float = 0.0  # the cost model's, for the target
  fits: bool = False

  def to_json(self) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("step_seconds", "fits")}


def _cache_key(cfg: schema.Config, devices: Sequence[Any], names: list[str],
               standin: bool = False) -> dict[str, Any]:
  """What the compiled figures depend on (not the target's memory or speed: the choice is made after)."""
  parts = {"model": cfg.model.to_dict(), "mesh": cfg.mesh.to_dict(), "optimizer": cfg.optimizer.to_dict(),
           "stages": cfg.pipeline.to_dict()}
  parts["model"].pop("remat", None)
  return {"config": parts, "seq_len": cfg.data.seq_len, "batch_size": cfg.data.batch_size, "devices": len(devices),
          "device_kind": devices[0].device_kind if devices else "", "candidates": names,
          "jax": jax.__version__, "maxtrain": maxtrain.__version__, **({"memory_standin": True} if standin else {})}


def _cached(key: dict[str, Any], measure: Callable[[], list[Candidate]]) -> list[Candidate]:
  """The candidates' figures for `key`: from the cache file when it holds exactly this key, else measured and
  written (a failed write is a warning: the cache only saves compiles)."""
  blob = json.dumps(key, sort_keys=True, default=str)
  path = cache.cache_dir() / "remat_auto" / f"{hashlib.sha256(blob.encode()).hexdigest()[:24]}.json"
  try:
    saved = json.loads(path.read_text())
    if saved.get("key") == json.loads(blob) and {c["remat"] for c in saved["candidates"]} <= set(CANDIDATES):
      return [Candidate(**c) for c in saved["candidates"]]
  except (OSError, ValueError, KeyError, TypeError):
    pass
  candidates = measure()
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": json.loads(blob), "candidates": [c.to_json() for c in candidates]}))
    tmp.replace(path)
  except OSError as e:
    log.warning("model.remat=auto: could not cache the candidates' figures in %s (%s)", path, e)
  return candidates


def choose_remat(cfg: schema.Config, devices: Sequence[Any],
                 compile_fn: Callable[[schema.Config], tuple[Any, Any]],
                 standin: bool = False) -> tuple[str, str, list[Candidate]]:
  """(the remat policy, the table of candidates, the candidates) for `cfg` on `devices`. `compile_fn(cfg)` returns (the
  compiled train step of cfg, its plan); `standin`: it compiles `memory_standin` models (cached apart). UserError
  when no candidate fits."""
  headroom = cfg.fit.headroom
  require(0 <= headroom < 1, f"config.fit.headroom={headroom}: must be in [0, 1) (the share of device memory "
          "model.remat=auto leaves free)")
  target = target_for(cfg, devices)
  names = [c for c in CANDIDATES if c != "offload" or target.host_bandwidth > 0]

  def measure() -> list[Candidate]:
    out, pipelined = [], False
    for remat in names:
      # Under the pipeline the offloaded activations' bytes are not modelled (offloaded_activation_bytes counts
      # every layer on every device: llama3_405b read -445 GiB on the device), so offload is no candidate there.
      if remat == "offload" and pipelined:
        continue
      trial = schema.with_values(schema.Config.of(cfg), {"model.remat": remat})
      compiled, plan = compile_fn(trial)
      pipelined = plan.pipeline is not None
      mem = Memory.of(compiled)
      host, moved = mem.host, 2 * mem.host_arguments  # an offloaded optimizer state: in and out each step
      device_peak = mem.peak
      if remat == "offload":
        held, each_way = offloaded_activation_bytes(trial, plan)
        moved += 2 * each_way
        if not mem.host_temporaries:  # XLA:CPU keeps them in its one RAM, counted as temporaries
          device_peak -= held
          host += held
      m = registry.model_config(trial.model)
      tokens = plan.batch.tokens / len(devices)
      flops = tokens * (registry.flops_per_token(m, cfg.data.seq_len) + recompute_flops_per_token(m, remat, cfg.data.seq_len))
      out.append(Candidate(remat, int(device_peak), int(host), int(moved), flops))
    return out

  limit = target.memory_bytes * (1 - headroom)
  candidates = [dataclasses.replace(c, fits=c.device_peak <= limit, step_seconds=c.flops / target.flops
                                    + (c.moved / target.host_bandwidth if c.moved else 0.0))
                for c in _cached(_cache_key(cfg, devices, names, standin), measure)]
  fitting = [c for c in candidates if c.fits]
  chosen = min(fitting, key=lambda c: c.step_seconds) if fitting else None
  lines = [f"model.remat=auto for {len(devices)} x {target.name} ({target.memory_bytes / GiB:.1f} GiB, "
           f"fit.headroom {headroom:g}: peak <= {limit / GiB:.2f} GiB; {target.source}):",
           f"  {'remat':<8} {'device peak':>12} {'host':>10} {'moved/step':>11} {'est. step':>10}"]
  unit, size = ("GiB", GiB) if max(c.device_peak for c in candidates) >= GiB else ("MiB", 2**20)
  for c in candidates:
    mark = "  <- chosen" if c is chosen else ("" if c.fits else "  (does not fit)")
    lines.append(f"  {c.remat:<8} {c.device_peak / size:8.3f} {unit} {c.host / size:6.3f} {unit} "
                 f"{c.moved / size:7.3f} {unit} {c.step_seconds * 1e3:9.3f} ms{mark}")
  table = "\n".join(lines)
  if chosen is None:
    raise UserError(f"model.remat=auto: no remat policy fits the device.\n{table}\nUse more devices (mesh.fsdp), "
                    "optimizer.offload=host, more optimizer.grad_accum_steps or a shorter data.seq_len.")
  return chosen.remat, table, candidates
