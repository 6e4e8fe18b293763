"""Process-wide JAX start-up: multi-process initialisation (layout from the config or the detected
launcher, runtime/cluster.py), then the device check against the composed platform
(runtime/platform.py).

`jax.distributed.initialize` gets explicit timeouts (`runtime.init_timeout_s`, `heartbeat_timeout_s`,
`shutdown_timeout_s`). A coordinator that never answers would otherwise make jax abort with a bare
`DEADLINE_EXCEEDED ... RegisterTask` (or wait its default 5 minutes): a timer ends the process first
with a message naming the address and the key, exit 1 (a crash: a supervisor restarts it).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import jax

from maxtrain.errors import EXIT_CRASH, require
from maxtrain.runtime import cluster, platform

log = logging.getLogger("maxtrain")
JAX_TIMEOUT_GRACE_S = 30  # jax's own initialization timeout is later than ours, so ours speaks first


def initialize_distributed(runtime_cfg) -> cluster.Cluster:
  """`jax.distributed.initialize` when the job has several processes (before any backend use), then
  the first backend use: a check that the devices are the platform the environment was composed
  for. On CPU the processes talk over gloo on the coordinator's address."""
  layout = cluster.resolve(runtime_cfg, os.environ)
  if layout.kind != "none":
    log.info("cluster %s", layout.describe())
  if layout.num_processes > 1:
    _initialize(layout, runtime_cfg)
  device = jax.devices()[0]
  platform.check_devices(runtime_cfg.platform, device.platform, device.device_kind, os.environ)
  if layout.num_processes > 1:
    log.info("process %d of %d (coordinator %s): %d local / %d global devices", jax.process_index(),
             jax.process_count(), layout.coordinator, jax.local_device_count(), jax.device_count())
  return layout


def validate(runtime_cfg) -> None:
  for key in ("init_timeout_s", "heartbeat_timeout_s", "shutdown_timeout_s"):
    value = runtime_cfg[key]
    require(value >= 1, f"config.runtime.{key}={value}: must be >= 1 (seconds)")


def _initialize(layout: cluster.Cluster, runtime_cfg) -> None:
  validate(runtime_cfg)
  timeout_s = runtime_cfg.init_timeout_s
  joined = threading.Event()

  def expire():
    if joined.wait(timeout_s):
      return
    if layout.process_id == 0:
      what = (f"not all {layout.num_processes} processes joined the coordinator this process hosts at "
              f"{layout.coordinator}")
      fix = "check that every process started and can reach that address"
    else:
      what = f"the coordinator at {layout.coordinator} (process 0) did not answer"
      fix = "check that process 0 is running and that this host reaches that address (firewall, port, DNS)"
    print(f"maxtrain: error: jax.distributed start-up: {what} within config.runtime.init_timeout_s={timeout_s:g}s "
          f"(process {layout.process_id} of {layout.num_processes}): {fix}. Exiting {EXIT_CRASH} (restartable).",
          file=sys.stderr, flush=True)
    os._exit(EXIT_CRASH)  # the main thread is blocked inside jax: nothing else can end it

  threading.Thread(target=expire, name="maxtrain-distributed-timeout", daemon=True).start()
  jax.distributed.initialize(layout.coordinator, layout.num_processes, layout.process_id,
                             initialization_timeout=int(timeout_s) + JAX_TIMEOUT_GRACE_S,
                             heartbeat_timeout_seconds=int(runtime_cfg.heartbeat_timeout_s),
                             shutdown_timeout_seconds=int(runtime_cfg.shutdown_timeout_s))
  joined.set()
