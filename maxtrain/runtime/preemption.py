"""SIGTERM / SIGINT -> finish the current step, save, exit 75 (DESIGN.md exit codes).

The handler only sets a flag: the loop checks it between steps, so a step is never cut in half and
the checkpoint written is consistent. A second SIGINT interrupts at once (an impatient user).
"""

from __future__ import annotations

import logging
import signal

import jax
import numpy as np

log = logging.getLogger("maxtrain")


class StopRequest:
  def __init__(self):
    self.signal_name: str | None = None
    self._previous = {}

  def install(self) -> "StopRequest":
    for sig in (signal.SIGTERM, signal.SIGINT):
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def uninstall(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}

  def _handle(self, signum, frame) -> None:
    if self.signal_name is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.signal_name = signal.Signals(signum).name
    log.warning("%s received: stopping after the current step with a checkpoint", self.signal_name)

  def requested(self) -> bool:
    """True on every process once any process got a signal, so all stop at the same step."""
    local = self.signal_name is not None
    if jax.process_count() == 1:
      return local
    from jax.experimental import multihost_utils

    # note: one tiny collective per step; the price of never stopping processes at different steps.
    return bool(np.any(multihost_utils.process_allgather(np.array(local, np.int32))))
