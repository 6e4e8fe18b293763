"""SIGTERM / SIGINT -> finish the current step, save, exit 75 (DESIGN.md exit codes).

The handler only sets a flag: the loop checks it between steps, so a step is never cut in half and
the checkpoint written is consistent. A second SIGINT interrupts at once (an impatient user).

With several processes every one must stop after the same step (the save is collective), although
the signal may reach only one of them. No per-step collective: agreement goes through the
coordination service's key-value store (runtime/kv.py), and only once a stop is requested.

  1. The loop of the signalled process sees its flag at `requested(c)` and posts a `stop` notice
     to every process.
  2. On each process the notice thread (never blocked by the device) takes the loop's latest checked
     step `c` under a lock and proposes `c + 1` (the signalled process proposes `c` itself): the loop
     can pass `c + 1` only by checking again, and from then on it sees the notice.
  3. A helper thread collects every process's proposal; the stop step S is their maximum.
  4. The loop runs on while `step` < its own proposal (always <= S), waits there for S if it is not
     known yet, and stops at S. No process has passed S when S is known, and every process can
     reach S: its steps need only peers that are themselves on their way to S.

Per-step cost: one lock and two comparisons (BENCHMARKS.md: the former allgather cost a device
round trip every step).
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from maxtrain.runtime.kv import KeyValue

log = logging.getLogger("maxtrain")
NOTICE = "stop"
_start_up_interrupted = False  # a Ctrl-C came before StopRequest.install (catch_start_up_interrupt)


def catch_start_up_interrupt() -> None:
  """The entry point's first act: until the stop handler is installed, a Ctrl-C raises KeyboardInterrupt as
  usual and is also remembered. Python drops an exception raised inside a garbage-collection callback (jax
  registers one) or a `__del__`: a Ctrl-C landing there vanished, and the run trained on to exit 0 (seen for
  signals 0.8-2 s after the platform line). `StopRequest.install` raises a remembered one again."""
  global _start_up_interrupted
  _start_up_interrupted = False

  def handle(signum, frame) -> None:
    global _start_up_interrupted
    if _start_up_interrupted:  # a second Ctrl-C (the terminal's beside the supervisor's forward) while the first
      return  # unwinds: raised again inside the shell's exit path, it became a traceback (seen in CI)
    _start_up_interrupted = True
    raise KeyboardInterrupt

  signal.signal(signal.SIGINT, handle)


class StopRequest:
  def __init__(self, kv: KeyValue | None = None):
    self.signal_name: str | None = None
    self.kv = kv
    self._previous = {}
    self._lock = threading.Lock()
    self._checked = 0  # the loop's latest checked step
    self._requested_by: str | None = None  # the process whose stop notice reached this one
    self._proposal: int | None = None  # this process's proposal, once it knows of a stop
    self._stop_step: int | None = None
    self._agreed = threading.Event()
    self._since: float | None = None  # monotonic time this process learned of the stop (signal or notice)

  def install(self) -> "StopRequest":
    if _start_up_interrupted:  # its KeyboardInterrupt was swallowed during start-up: it ends the run here
      raise KeyboardInterrupt
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
    self._since = self._since or time.monotonic()
    log.warning("%s received: stopping after the current step with a checkpoint", self.signal_name)

  def requested(self, step: int) -> bool:
    """Called by the loop after every step; True when this process must stop now (after `step`).
    With several processes, True at the same step on every process once any got a signal."""
    if self.kv is None:
      return self.signal_name is not None
    with self._lock:
      self._checked = step
      if self.signal_name is not None and self._proposal is None:
        self._propose_locked(step)  # the loop is here now: the earliest safe stop
        self.kv.post_all(f"{NOTICE}:{self.kv.process_index}", include_self=False)
      proposal = self._proposal
    if proposal is None or step < proposal:
      return False
    if not self._agreed.is_set():
      log.info("stop requested: waiting for every process to propose its stop step")
      self._agreed.wait()  # a hung peer never proposes: then the watchdog ends this wait
    return step >= self._stop_step

  def on_notice(self, sender: str) -> None:
    """A `stop` notice from process `sender` (notice thread)."""
    with self._lock:
      if self._proposal is None:
        self._requested_by = sender
        self._since = self._since or time.monotonic()
        self._propose_locked(self._checked + 1)

  def _propose_locked(self, step: int) -> None:
    self._proposal = step
    self.kv.set(f"stop/proposal/{self.kv.process_index}", str(step))
    threading.Thread(target=self._agree, name="maxtrain-stop-agreement", daemon=True).start()

  def _agree(self) -> None:
    proposals = [int(self.kv.get(f"stop/proposal/{p}", timeout_s=86400.0) or 0) for p in range(self.kv.process_count)]
    self._stop_step = max(proposals)
    log.warning("all %d processes stop after step %d (proposals %s)", len(proposals), self._stop_step, proposals)
    self._agreed.set()

  def seconds_since(self) -> float:
    """Seconds since this process learned of the stop (0 before): what the grace period has used up."""
    return 0.0 if self._since is None else time.monotonic() - self._since

  @property
  def reason(self) -> str:
    """What asked this process to stop: its own signal, or another process's."""
    if self.signal_name is not None:
      return self.signal_name
    return f"process {self._requested_by}'s stop request"
