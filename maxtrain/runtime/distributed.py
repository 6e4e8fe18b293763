"""Process-wide JAX start-up: multi-process initialisation (layout from the config or the detected
launcher, runtime/cluster.py), then the device check against the composed platform
(runtime/platform.py)."""

from __future__ import annotations

import logging
import os
import jax

from maxtrain.runtime import cluster, platform

log = logging.getLogger("maxtrain")


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
