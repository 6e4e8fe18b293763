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
import math
import os
import socket
import sys
import threading

import jax

from maxtrain.errors import EXIT_CRASH, require
from maxtrain.runtime import cluster, platform

log = logging.getLogger("maxtrain")
JAX_TIMEOUT_GRACE_S = 30  # jax's own initialization timeout is later than ours, so ours speaks first


def initialize_distributed(runtime_cfg, transfer_timeout_s: float = 0.0) -> cluster.Cluster:
  """`jax.distributed.initialize` when the job has several processes (before any backend use), then
  the first backend use: a check that the devices are the platform the environment was composed
  for. On CPU the processes talk over gloo on the coordinator's address. `transfer_timeout_s` > 0: the
  processes move arrays to each other with `jax.device_put` (an RL rollout side on processes of its own,
  posttrain/remote_rollout.py), over a socket each process listens on (transfer_address). Called again
  (loop/trainer.py run, then the Trainer), it resolves the layout and checks the devices only."""
  layout, again = cluster.resolve(runtime_cfg, os.environ), jax.distributed.is_initialized()
  if layout.kind != "none" and not again:
    log.info("cluster %s", layout.describe())
  if layout.num_processes > 1 and not again:
    if transfer_timeout_s > 0:  # read when the backend starts: before jax.devices()
      jax.config.update("jax_cross_host_transfer_socket_address", transfer_address(layout.coordinator,
                                                                                   layout.process_id))
      jax.config.update("jax_cross_host_transfer_timeout_seconds", max(1, math.ceil(transfer_timeout_s)))
    _initialize(layout, runtime_cfg)
  device = jax.devices()[0]
  platform.check_devices(runtime_cfg.platform, device.platform, device.device_kind, os.environ)
  if layout.num_processes > 1 and not again:
    log.info("process %d of %d (coordinator %s): %d local / %d global devices", jax.process_index(),
             jax.process_count(), layout.coordinator, jax.local_device_count(), jax.device_count())
  return layout


def transfer_address(coordinator: str, process_id: int) -> str:
  """The socket a process listens on for cross-process `jax.device_put`: the coordinator's port + 1 +
  the process id, on the coordinator's host when that is this machine (localhost jobs), else on this host's
  address (one process per host, so the ports do not collide)."""
  host, port = coordinator.rsplit(":", 1)
  if host not in ("localhost", "127.0.0.1"):
    host = socket.gethostbyname(socket.gethostname())
  return f"{host}:{int(port) + 1 + process_id}"


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
