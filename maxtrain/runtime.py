"""Process-wide JAX setup applied before anything compiles: multi-process initialisation (layout from
the config or the detected launcher, maxtrain/cluster.py), the device check against the composed
platform (maxtrain/platform.py) and the persistent compilation cache."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax

from maxtrain import cluster, platform

log = logging.getLogger("maxtrain")


def compile_cache_path(setting: str) -> Path | None:
  """`runtime.compile_cache_dir`: "" = `<maxtrain cache>/xla`, "none" = off, else a directory."""
  if setting == "none":
    return None
  if setting:
    return Path(setting)
  from maxtrain.data.corpus import cache_dir

  return cache_dir() / "xla"


def configure_compile_cache(setting: str) -> Path | None:
  """Persistent XLA compilation cache: a restarted or resumed run reuses the compiled step instead of
  compiling it again (on this CPU: first step 22 s -> 5 s after start for the test model). Entries
  are keyed by the program, compile options, backend and jax version, so a hit is the same
  executable."""
  path = compile_cache_path(setting)
  if path is None:
    return None
  path.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  return path


def initialize_distributed(runtime_cfg) -> cluster.Cluster:
  """`jax.distributed.initialize` when the job has several processes (before any backend use), then
  the first backend use: a check that the devices are the platform the environment was composed
  for. On CPU the processes talk over gloo on the coordinator's address."""
  layout = cluster.resolve(runtime_cfg, os.environ)
  if layout.kind != "none":
    log.info("cluster %s", layout.describe())
  if layout.num_processes > 1:
    jax.distributed.initialize(layout.coordinator, layout.num_processes, layout.process_id)
  device = jax.devices()[0]
  platform.check_devices(runtime_cfg.platform, device.platform, device.device_kind, os.environ)
  if layout.num_processes > 1:
    log.info("process %d of %d (coordinator %s): %d local / %d global devices", jax.process_index(),
             jax.process_count(), layout.coordinator, jax.local_device_count(), jax.device_count())
  return layout
