"""Model FLOPs utilisation: achieved model FLOP/s over the hardware's peak.

Model FLOPs per token come from the model shape (`ModelConfig.train_flops_per_token`); the peak
comes from the table below by device kind (dense, no sparsity, at the stated precision), from
`mfu.peak_flops` in the config, or -- on CPU, which has no meaningful datasheet figure -- from a
matmul benchmark measured once per machine and cached.

MFU = tokens/s x FLOPs/token / (devices x peak per device). Peaks are per JAX device: one GPU, one
TPU chip, one (logical) NeuronCore. On CPU the benchmark measures what one *process* reaches (XLA's
CPU matmul uses all the cores it may run on, whatever the number of fake devices), and the per-device
peak is that divided by the process's local device count, so the same formula holds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import re
import socket
import time
from pathlib import Path
from typing import Any, NamedTuple

from maxtrain.runtime.cache import cache_dir

log = logging.getLogger("maxtrain")

CACHE_NAME = "cpu_peak.json"
BENCH_N = 2048  # fp32 matmul side: 17 GFLOP per run, large enough to reach the roofline on a few cores.
BENCH_REPS = 5  # Best of: other processes on a shared machine only ever slow a run down.
CONTENDED = 0.8  # A measurement that got less than this share of the usable cores is re-taken at the next start.
# A figure below this share of the best on record for the same CPU (model and core count, any jax or
# host) was slowed by something the share readings missed. Quiet 2048^3 matmuls on one 2-core machine
# spread 335-374 GFLOP/s (10%); a run beside another job measured 296.8 (79% of 374) with cpu_share 0.99.
RECORD_SHARE = 0.85


@dataclasses.dataclass(frozen=True)
class Peak:
  flops: float  # Per JAX device, FLOP/s.
  precision: str
  source: str


_BF16 = "bf16 dense (no sparsity)"
# (regex on jax's device_kind, peak). First match wins: put the specific variants first.
PEAKS: tuple[tuple[str, Peak], ...] = (
    # NVIDIA: datasheets list bf16 "with sparsity"; the dense figure is half of it.
    (r"H100.*NVL", Peak(835e12, _BF16, "NVIDIA H100 Tensor Core GPU datasheet, H100 NVL: 1,671 TFLOPS sparse")),
    (r"H100.*PCIe", Peak(756e12, _BF16, "NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe: 1,513 TFLOPS sparse")),
    (r"H100", Peak(989e12, _BF16, "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: 1,979 TFLOPS sparse")),
    (r"H200.*NVL", Peak(835e12, _BF16, "NVIDIA H200 Tensor Core GPU datasheet, H200 NVL: 1,671 TFLOPS sparse")),
    (r"H200", Peak(989e12, _BF16, "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: 1,979 TFLOPS sparse")),
    (r"B200", Peak(2250e12, _BF16, "NVIDIA HGX B200 datasheet: 4.5 PFLOPS per GPU sparse")),
    (r"A100", Peak(312e12, _BF16, "NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOPS (624 sparse)")),
    # Google Cloud TPU system architecture pages (per chip; one JAX device per chip). jax reports v5p
    # as "TPU v5", v5e as "TPU v5 lite" and v6e as "TPU v6 lite".
    (r"TPU v5(p)?$", Peak(459e12, "bf16 dense", "Google Cloud TPU v5p documentation: 459 TFLOPS per chip")),
    (r"TPU v5( lite|e)$", Peak(197e12, "bf16 dense", "Google Cloud TPU v5e documentation: 197 TFLOPS per chip")),
    (r"TPU v6( lite|e)$", Peak(918e12, "bf16 dense", "Google Cloud TPU v6e (Trillium) documentation: 918 TFLOPS per chip")),
    (r"TPU v4$", Peak(275e12, "bf16 dense", "Google Cloud TPU v4 documentation: 275 TFLOPS per chip")),
    # AWS Neuron architecture docs. trn1: "Trainium Architecture", 190 TFLOPS per chip of 2 NeuronCore-v2.
    # trn2: "Trainium2 Architecture", 667 TFLOPS per chip of 8 NeuronCore-v3 (the NeuronCore-v3 page
    # quotes 79 for its tensor engine alone). NC_v3d = logical NeuronCore config 2: two cores per device.
    (r"^NC_v2", Peak(95e12, "bf16/fp16 dense", "AWS Neuron 'Trainium Architecture': 190 TFLOPS / 2 NeuronCore-v2")),
    (r"^NC_v3d", Peak(2 * 667e12 / 8, "bf16/fp16 dense",
                      "AWS Neuron 'Trainium2 Architecture': 667 TFLOPS / 8 NeuronCore-v3, x2 for LNC=2")),
    (r"^NC_v3", Peak(667e12 / 8, "bf16/fp16 dense", "AWS Neuron 'Trainium2 Architecture': 667 TFLOPS / 8 NeuronCore-v3")),
)


def table_peak(device_kind: str) -> Peak | None:
  """The table's peak for a jax `device_kind` string, or None when the kind is not listed."""
  for pattern, peak in PEAKS:
    if re.search(pattern, device_kind.strip(), flags=re.IGNORECASE):
      return peak
  return None


def machine_identity() -> dict[str, Any]:
  """What a measured CPU peak depends on; the cache key."""
  import jax

  model = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
  except OSError:
    pass
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return {"host": socket.gethostname(), "cpu": model, "cores": cores, "jax": jax.__version__}


def _busy_seconds(cpus: set[int]) -> float | None:
  """CPU seconds the whole machine spent busy on `cpus` since boot (/proc/stat; None elsewhere)."""
  try:
    with open("/proc/stat") as f:
      lines = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
  except OSError:
    return None
  ticks = os.sysconf("SC_CLK_TCK")
  busy = 0
  for fields in lines:
    if int(fields[0][3:]) in cpus:
      values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
      busy += sum(values) - values[3] - values[4]
  return busy / ticks


def _usable_cpus() -> set[int]:
  return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def others_share(busy_s: float | None, own_s: float, wall_s: float, cores: int) -> float:
  """The share of the usable cores other processes held over a window: the machine's busy CPU seconds
  on them minus this process's own. Without /proc/stat: the 1-minute load average beyond this process."""
  if busy_s is None:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return min(1.0, max(0.0, load - 1.0) / cores)
  return min(1.0, max(0.0, busy_s - own_s) / (wall_s * cores))


def measure_cpu_peak(n: int = BENCH_N, reps: int = BENCH_REPS, cpu_share: float | None = None) -> tuple[float, float]:
  """(FLOP/s, cpu_share) of a jitted fp32 n x n matmul on the first CPU device, best of `reps`: this
  process's practical matmul roofline. `cpu_share` = the share of the usable cores the measurement had:
  the lower of the CPU seconds the process got during the best run / (wall seconds x cores), and 1 -
  the share other processes used over all the runs (the machine's busy time on those cores beyond this
  process's, /proc/stat). The first alone misses a loaded machine: XLA's threads spin while they wait,
  so the process reads 0.99 of the cores beside another job. A given `cpu_share` replaces the reading
  (tests: a contended machine on demand; the matmul still runs)."""
  import jax
  import jax.numpy as jnp

  device = jax.local_devices(backend="cpu")[0]
  keys = jax.random.split(jax.random.key(0))
  a, b = (jax.device_put(jax.random.normal(k, (n, n), jnp.float32), device) for k in keys)
  matmul = jax.jit(lambda x, y: jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST))
  matmul(a, b).block_until_ready()  # Compile and warm up.
  best, share, cores, cpus = float("inf"), 0.0, machine_identity()["cores"], _usable_cpus()
  busy0, start, own0 = _busy_seconds(cpus), time.perf_counter(), time.process_time()
  for _ in range(reps):
    t0, c0 = time.perf_counter(), time.process_time()
    matmul(a, b).block_until_ready()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if wall < best:
      best, share = wall, cpu / (wall * cores)
  busy1 = _busy_seconds(cpus)
  others = others_share(None if busy0 is None or busy1 is None else busy1 - busy0, time.process_time() - own0,
                        time.perf_counter() - start, cores)
  share = min(share, 1.0 - others)
  return 2.0 * n**3 / best, share if cpu_share is None else cpu_share


class CpuPeak(NamedTuple):
  flops: float  # per process
  description: str
  contended: bool  # no measurement behind `flops` got the cores: MFU against it reads high


def cached_cpu_peak(cache_file: Path | None = None, cpu_share: float | None = None) -> tuple[float, str]:
  """(FLOP/s per process, description) of `cpu_peak`."""
  return cpu_peak(cache_file, cpu_share)[:2]


def cpu_peak(cache_file: Path | None = None, cpu_share: float | None = None) -> CpuPeak:
  """The CPU peak from the per-machine cache once a quiet measurement is in it, else measured (~1 s)
  and cached.

  A measurement that got less than CONTENDED of the cores was slowed by other processes, and a figure
  below RECORD_SHARE of the best on record for the same CPU (another jax version or entry in the cache)
  was slowed by something: neither is final. Each start measures again until one gets the cores and
  reaches the record's range, keeping the best figure of all (other processes only ever slow a matmul
  down); until then it is `contended`, and MFU lines say the figure reads high. `cpu_share` is passed
  to measure_cpu_peak.
  Delete the cache file (`<maxtrain cache dir>/cpu_peak.json`) to start over."""
  if cache_file is None:
    cache_file = cache_dir() / CACHE_NAME
  identity = machine_identity()
  key = "|".join(f"{k}={v}" for k, v in identity.items())
  cache = _read_cache(cache_file)
  entry, record = cache.get(key), best_on_record(cache, identity)
  if entry and _quiet(entry, record):
    return CpuPeak(float(entry["flops"]), _describe(entry, f"cached in {cache_file}", record), False)
  flops, share = measure_cpu_peak(cpu_share=cpu_share)
  measurements = entry.get("measurements", 1) + 1 if entry else 1
  quiet = share >= CONTENDED
  if entry and entry["flops"] >= flops:  # The earlier figure stays the best; this one may make it quiet.
    entry = {**entry, "measurements": measurements, "quiet": quiet}
  else:
    entry = {"flops": flops, "cpu_share": share, "n": BENCH_N, "dtype": "float32", "when": time.strftime("%Y-%m-%d"),
             "measurements": measurements, "quiet": quiet, **identity}
  if not quiet:
    log.warning("CPU peak measured while other processes held the cores (this process had %.0f%% of %d): "
                "%.1f GFLOP/s may be low and MFU read high; it is measured again at the next start",
                100 * share, identity["cores"], entry["flops"] / 1e9)
  elif not _quiet(entry, record):
    log.warning("CPU peak %.1f GFLOP/s is below %.0f%% of the best on record for this CPU (%.1f GFLOP/s): "
                "something slowed it; MFU may read high, and it is measured again at the next start",
                entry["flops"] / 1e9, 100 * RECORD_SHARE, record / 1e9)
  _write_cache(cache_file, key, entry)
  return CpuPeak(float(entry["flops"]), _describe(entry, "measured now", record), not _quiet(entry, record))


def best_on_record(cache: dict, identity: dict[str, Any]) -> float:
  """The best figure the cache holds for the same CPU (model and usable cores), any host or jax."""
  return max((float(e["flops"]) for e in cache.values() if isinstance(e, dict) and "flops" in e
              and e.get("cpu") == identity["cpu"] and e.get("cores") == identity["cores"]), default=0.0)


def _quiet(entry: dict, record: float = 0.0) -> bool:
  """Whether a measurement behind the entry got the cores (entries written before "quiet": its share),
  and its figure is within RECORD_SHARE of the best on record for the CPU."""
  got_cores = bool(entry.get("quiet", entry["cpu_share"] >= CONTENDED))
  return got_cores and float(entry["flops"]) >= RECORD_SHARE * record


def _write_cache(cache_file: Path, key: str, entry: dict) -> None:
  try:
    cache = _read_cache(cache_file)  # Again: keep entries other processes added meanwhile.
    cache[key] = entry
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}")
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, cache_file)
  except OSError as e:  # A read-only cache costs a re-measurement next time, not the run.
    log.warning("could not cache the CPU peak in %s: %s", cache_file, e)


def _read_cache(cache_file: Path) -> dict:
  try:
    return json.loads(cache_file.read_text())
  except (OSError, ValueError):
    return {}


def _describe(entry: dict, where: str, record: float = 0.0) -> str:
  contended = "" if _quiet(entry) else f", contended: got {entry['cpu_share']:.0%} of the cores"
  if _quiet(entry) and not _quiet(entry, record):
    contended = f", contended: below {RECORD_SHARE:.0%} of the best on record for this CPU ({record / 1e9:.1f} GFLOP/s)"
  return f"fp32 {entry['n']}x{entry['n']} matmul, {where}, {entry['when']}{contended}"


_warned: set[str] = set()


def peak_flops(device: Any = None, override: float = 0.0) -> tuple[float, str]:
  """(peak FLOP/s per device, where the number comes from) of `peak_info`."""
  return peak_info(device, override)[:2]


def peak_info(device: Any = None, override: float = 0.0) -> tuple[float, str, bool]:
  """(peak FLOP/s per device, where the number comes from, whether it rests on contended CPU
  measurements only: MFU against it reads high). 0.0 means unknown: MFU is unavailable.

  `override` (config `mfu.peak_flops`) wins when > 0. CPU: the cached measured peak of this process,
  divided by its local device count. Unknown accelerator: 0.0 and a one-line warning (once per kind).
  """
  if override > 0:
    return float(override), "config mfu.peak_flops", False
  import jax

  device = device if device is not None else jax.local_devices()[0]
  if device.platform == "cpu":
    flops, how, contended = cpu_peak()
    n = jax.local_device_count(backend="cpu")
    return flops / n, f"CPU peak {flops / 1e9:.1f} GFLOP/s per process / {n} local device(s) ({how})", contended
  peak = table_peak(device.device_kind)
  if peak is None:
    if device.device_kind not in _warned:
      _warned.add(device.device_kind)
      log.warning("MFU unavailable: no peak FLOP/s known for device kind %r (%s); set --config.mfu.peak_flops "
                  "to its dense peak per device", device.device_kind, device.platform)
    return 0.0, f"unknown device kind {device.device_kind!r}", False
  return peak.flops, f"{device.device_kind}: {peak.flops / 1e12:.1f} TFLOP/s {peak.precision} ({peak.source})", False


def mfu(tokens_per_s: float, flops_per_token: float, num_devices: int, peak_per_device: float) -> float | None:
  """Model FLOPs utilisation in [0, 1]-ish, or None when the peak is unknown (0)."""
  if peak_per_device <= 0 or num_devices <= 0:
    return None
  return tokens_per_s * flops_per_token / (num_devices * peak_per_device)
