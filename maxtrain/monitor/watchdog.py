"""Hang watchdog: if no step completes for `timeout_s` (a longer allowance before the first step,
which includes compilation and restore), dump every thread's Python stack and the recent events to
`<output_dir>`, record a `hang` event and exit 76 (DESIGN.md: restartable).

A hung collective blocks the main thread inside XLA, where no Python code runs; only a separate
thread can notice, and only a hard `os._exit` can leave (a normal exit would wait on the hung
thread). The dump is written first so the cause survives the exit.

With several processes one hung process stalls all the others, and their idle clocks start at
slightly different steps. The first watchdog to fire posts a `hang` notice to every other process
(runtime/kv.py), whose watchdogs then fire at once: every process writes its dump (the hung one's
shows where it hangs, the others' where they wait) and exits 76, and a supervisor restarts them all.
A peer that leaves first can fail this process's collective before the notice arrives: the trainer
asks `exit_code_for`, which reads the first watchdog's record (`FIRED_KEY`) and ends this process as
part of the hang, not as a crash.
Process 0 hosts the coordination service, whose end kills every process still attached to it
(jax aborts them), so it exits last: after the others have recorded that they are leaving, or after
`PEER_EXIT_WAIT_S`.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from pathlib import Path

from maxtrain.errors import EXIT_HANG, exit_code
from maxtrain.monitor import events as ev
from maxtrain.runtime.kv import KeyValue

log = logging.getLogger("maxtrain")
NOTICE = "hang"
FIRED_KEY = "hang/fired"  # `PROCESS:STEP` of the first watchdog to fire, set before it tells the others
PEER_EXIT_WAIT_S = 20.0  # process 0 waits at most this long for the others to leave before it exits


class Watchdog:
  def __init__(self, out_dir: Path, events: ev.EventLog, timeout_s: float, startup_timeout_s: float,
               kv: KeyValue | None = None):
    self.out_dir, self.events, self.kv = out_dir, events, kv
    self.timeout_s, self.startup_timeout_s = timeout_s, startup_timeout_s
    self._last = time.monotonic()
    self._step: int | None = None  # None until the first step completes
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="maxtrain-watchdog", daemon=True)
    self._firing = threading.Lock()

  def start(self) -> "Watchdog":
    if self.timeout_s > 0:
      self._thread.start()
    return self

  def beat(self, step: int) -> None:
    """A step completed (or a long, legitimate operation made progress)."""
    self._step, self._last = step, time.monotonic()

  def progress(self) -> None:
    """A long operation (a save or upload at exit) made progress: the allowance starts again."""
    self._last = time.monotonic()

  def stop(self) -> None:
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join()

  def _allowance(self) -> float:
    return self.startup_timeout_s if self._step is None else self.timeout_s

  def _watch(self) -> None:
    while not self._stop.wait(min(1.0, self.timeout_s / 4)):
      idle = time.monotonic() - self._last
      if idle > self._allowance():
        self._fire(idle)

  @property
  def fired(self) -> bool:
    """True once this watchdog is ending the process (the main thread may see a collective fail)."""
    return self._firing.locked()

  def exit_code_for(self, error: BaseException) -> int:
    """The exit code of a process that `error` ends: a hang (76) when this watchdog, or a peer's, is ending
    the job (a collective fails when the peer leaves, maybe before its notice arrives: this process then
    fires here and does not return); otherwise `errors.exit_code(error)`."""
    if not self.fired and self.kv is not None:
      try:
        payload = self.kv.get(FIRED_KEY, timeout_s=0.001)
      except Exception:  # noqa: BLE001 - the coordinator is gone too: nothing to learn from it
        payload = None
      if payload is not None:
        self.on_notice(payload)  # returns only if the notice thread is already firing
    return EXIT_HANG if self.fired else exit_code(error)

  def on_notice(self, payload: str) -> None:
    """Another process's watchdog fired (`PROCESS:STEP`): this one fires now (notice thread)."""
    process, _, step = payload.partition(":")
    self._fire(time.monotonic() - self._last, peer=f"process {process} saw no progress after step {step}")

  def _fire(self, idle: float, peer: str | None = None) -> None:
    if not self._firing.acquire(blocking=False):
      return  # another thread is already ending the process
    if peer is None and self.kv is not None:
      try:
        self.kv.set(FIRED_KEY, f"{self.kv.process_index}:{self._step}")
        self.kv.post_all(f"{NOTICE}:{self.kv.process_index}:{self._step}", include_self=False)
      except Exception as e:  # noqa: BLE001 - the coordinator may be the thing that hangs: dump and exit anyway
        log.error("watchdog: could not tell the other processes: %s", e)
    phase = "before the first step (compile/restore)" if self._step is None else f"after step {self._step}"
    path = self.out_dir / f"hang-attempt{self.events.attempt}-process{self.events.process_index}-{int(time.time())}.txt"
    cause = f"{peer}; this process" if peer else "this process"
    with open(path, "w") as f:
      f.write(f"maxtrain watchdog: {cause}: no step completed for {idle:.1f}s {phase} "
              f"(allowance {self._allowance():.0f}s)\n\n=== Python stacks of all threads ===\n")
      f.flush()
      faulthandler.dump_traceback(file=f, all_threads=True)
      f.write("\n=== last events ===\n")
      events_file = self.out_dir / ev.FILENAME
      if events_file.exists():
        f.writelines(events_file.read_text().splitlines(keepends=True)[-50:])
    self.events.emit(ev.HANG, self._step, idle_s=idle, dump=str(path), **({"peer": peer} if peer else {}))
    self.events.emit(ev.EXIT, self._step, code=EXIT_HANG)
    log.error("watchdog: %s: no step completed for %.1fs %s; stacks dumped to %s; exiting %d", cause, idle, phase,
              path, EXIT_HANG)
    logging.shutdown()
    self._leave_after_peers()
    os._exit(EXIT_HANG)

  def _leave_after_peers(self) -> None:
    if self.kv is None:
      return
    try:
      if self.kv.process_index != 0:
        self.kv.set(f"hang/leaving/{self.kv.process_index}", "1")
        return
      deadline = time.monotonic() + PEER_EXIT_WAIT_S
      for process in range(1, self.kv.process_count):
        if self.kv.get(f"hang/leaving/{process}", max(deadline - time.monotonic(), 0.001)) is None:
          print(f"maxtrain watchdog: process {process} did not record leaving within {PEER_EXIT_WAIT_S:.0f}s",
                file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 - leave anyway
      print(f"maxtrain watchdog: {e}", file=sys.stderr, flush=True)
