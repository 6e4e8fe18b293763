"""Memory in use and its peak: device memory where the backend reports it, else host memory.

GPU and TPU backends report allocator statistics (`Device.memory_stats()`); the CPU backend returns
None, and then the process's resident set size is what fills up, so that is reported instead,
labelled `host` so the two are never confused.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

GIB = 2.0**30


def _host_rss() -> int | None:
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return None


def device_memory(devices: Any = None) -> dict[str, Any]:
  """{'source': 'device' | 'host', 'bytes_in_use', 'peak_bytes_in_use', 'bytes_limit'} (ints or None).

  Device: the fullest of this process's local devices (the first to run out of memory). Host: the
  process RSS now and its peak since start (`bytes_limit` None)."""
  import jax

  stats = [s for s in (d.memory_stats() for d in (devices or jax.local_devices())) if s]
  if stats:
    worst = max(stats, key=lambda s: s.get("peak_bytes_in_use", s.get("bytes_in_use", 0)))
    return {"source": "device", "bytes_in_use": worst.get("bytes_in_use"),
            "peak_bytes_in_use": worst.get("peak_bytes_in_use"), "bytes_limit": worst.get("bytes_limit")}
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  peak *= 1 if sys.platform == "darwin" else 1024  # Linux reports KiB, macOS bytes.
  rss = _host_rss()
  # The kernel folds the current RSS into its high-water mark lazily: the peak can lag it briefly.
  return {"source": "host", "bytes_in_use": rss, "peak_bytes_in_use": max(peak, rss or 0), "bytes_limit": None}


def memory_scalars(mem: dict[str, Any] | None = None) -> dict[str, float]:
  """TensorBoard scalars in GiB: memory/{device,host}_{in_use,peak}_gib (missing values left out)."""
  mem = mem if mem is not None else device_memory()
  src = mem["source"]
  out = {}
  for name, key in (("in_use", "bytes_in_use"), ("peak", "peak_bytes_in_use")):
    if mem.get(key) is not None:
      out[f"memory/{src}_{name}_gib"] = mem[key] / GIB
  return out
