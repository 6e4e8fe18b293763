"""The processes' shared key-value store: jax.distributed's coordination service (hosted by process 0).

Agreement between processes that must not cost a device collective: the preemption stop step, a hang
seen by one process, step-time statistics every log interval. Calls are host RPCs to the coordinator
and never touch a device, so the devices keep running while a process waits here.

Notices: each process has a queue of short messages (`notice/<process>/<n>`, numbered with an atomic
counter) that one background thread per process waits on, so a process learns of another's stop
request or hang without asking every step. Posting `exit` to its own queue ends that thread.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger("maxtrain")

PREFIX = "maxtrain/"
EXIT = "exit"  # the notice that ends a process's own notice thread


class KeyValue:
  """A thin wrapper over jax's DistributedRuntimeClient; keys are prefixed with `maxtrain/`."""

  # > 0: this process agrees with the job's first `group` processes only (an RL trainer's: its rollout side
  # is processes of their own that run no Loop, posttrain/remote_rollout.py). Process-wide, like the job.
  group = 0

  def __init__(self, client, process_index: int, process_count: int):
    self.client, self.process_index, self.process_count = client, process_index, process_count

  @classmethod
  def current(cls) -> "KeyValue | None":
    """The store of this job (of this process's group), or None with one process (nothing to agree with)."""
    import jax
    from jax._src import distributed

    client, count = distributed.global_state.client, cls.group or jax.process_count()
    if client is None or count == 1:
      return None
    return cls(client, jax.process_index(), count)

  @classmethod
  def job(cls) -> "KeyValue":
    """The whole job's store (every process, whatever the group): the trainer and its rollout processes."""
    import jax
    from jax._src import distributed

    return cls(distributed.global_state.client, jax.process_index(), jax.process_count())

  def set(self, key: str, value: str) -> None:
    self.client.key_value_set(PREFIX + key, value, allow_overwrite=True)

  def get(self, key: str, timeout_s: float) -> str | None:
    """The value once some process sets it; None if none did within `timeout_s`."""
    try:
      return self.client.blocking_key_value_get(PREFIX + key, max(1, int(timeout_s * 1000)))
    except Exception as e:  # noqa: BLE001 - jaxlib raises XlaRuntimeError (DEADLINE_EXCEEDED) on timeout
      if "DEADLINE_EXCEEDED" in str(e) or "Deadline" in str(e):
        return None
      raise

  def barrier(self, name: str, timeout_s: float) -> None:
    """Returns once every process reached the barrier `name` (each name used once); raises after `timeout_s`."""
    processes = list(range(self.process_count)) if self.group else None  # None: every process of the job
    self.client.wait_at_barrier(PREFIX + name, max(1, int(timeout_s * 1000)), processes)

  def delete(self, key: str) -> None:
    self.client.key_value_delete(PREFIX + key)

  def post(self, process: int, message: str) -> None:
    """Appends `message` to `process`'s notice queue."""
    n = self.client.key_value_increment(f"{PREFIX}notice-count/{process}", 1) - 1
    self.set(f"notice/{process}/{n}", message)

  def post_all(self, message: str, *, include_self: bool = True) -> None:
    for process in range(self.process_count):
      if include_self or process != self.process_index:
        self.post(process, message)

  def listen(self, handlers: dict[str, Callable[[str], None]]) -> threading.Thread:
    """On a daemon thread, for each notice `KIND:PAYLOAD` to this process, in order, calls
    `handlers[KIND](PAYLOAD)`, until the `exit` notice (`post(own index, EXIT)`)."""

    def handle(message: str) -> None:
      kind, _, payload = message.partition(":")
      if kind in handlers:
        handlers[kind](payload)
      else:
        log.warning("ignoring unknown notice %r", message)

    def run():
      n = 0
      while True:
        try:
          message = self.get(f"notice/{self.process_index}/{n}", timeout_s=3600.0)
        except Exception as e:  # noqa: BLE001 - the coordinator is gone: jax itself ends the process
          log.debug("notice thread ends: %s", e)
          return
        if message is None:
          continue
        n += 1
        if message == EXIT:
          return
        try:
          handle(message)
        except Exception:  # noqa: BLE001 - a failing handler must not end the thread silently
          log.exception("handling notice %r", message)

    thread = threading.Thread(target=run, name="maxtrain-notices", daemon=True)
    thread.start()
    return thread

  def stop_listening(self, thread: threading.Thread) -> None:
    """Ends this process's notice thread (`listen`)."""
    try:
      self.post(self.process_index, EXIT)
    except Exception as e:  # noqa: BLE001 - the coordinator is gone: the daemon thread ends with the process
      log.debug("notice thread not stopped: %s", e)
      return
    thread.join(timeout=10.0)
