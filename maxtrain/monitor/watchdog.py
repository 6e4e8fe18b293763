"""Hang watchdog: if no step completes for `timeout_s` (a longer allowance before the first step,
which includes compilation and restore), dump every thread's Python stack and the recent events to
`<output_dir>`, record a `hang` event and exit 76 (DESIGN.md: restartable).

A hung collective blocks the main thread inside XLA, where no Python code runs; only a separate
thread can notice, and only a hard `os._exit` can leave (a normal exit would wait on the hung
thread). The dump is written first so the cause survives the exit.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import threading
import time
from pathlib import Path

from maxtrain.errors import EXIT_HANG
from maxtrain.monitor import events as ev

log = logging.getLogger("maxtrain")


class Watchdog:
  def __init__(self, out_dir: Path, events: ev.EventLog, timeout_s: float, startup_timeout_s: float):
    self.out_dir, self.events = out_dir, events
    self.timeout_s, self.startup_timeout_s = timeout_s, startup_timeout_s
    self._last = time.monotonic()
    self._step: int | None = None  # None until the first step completes
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="maxtrain-watchdog", daemon=True)

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

  def _fire(self, idle: float) -> None:
    phase = "before the first step (compile/restore)" if self._step is None else f"after step {self._step}"
    path = self.out_dir / f"hang-attempt{self.events.attempt}-process{self.events.process_index}-{int(time.time())}.txt"
    with open(path, "w") as f:
      f.write(f"maxtrain watchdog: no step completed for {idle:.1f}s {phase} "
              f"(allowance {self._allowance():.0f}s)\n\n=== Python stacks of all threads ===\n")
      f.flush()
      faulthandler.dump_traceback(file=f, all_threads=True)
      f.write("\n=== last events ===\n")
      events_file = self.out_dir / ev.FILENAME
      if events_file.exists():
        f.writelines(events_file.read_text().splitlines(keepends=True)[-50:])
    self.events.emit(ev.HANG, self._step, idle_s=idle, dump=str(path))
    self.events.emit(ev.EXIT, self._step, code=EXIT_HANG)
    log.error("watchdog: no step completed for %.1fs %s; stacks dumped to %s; exiting %d", idle, phase, path,
              EXIT_HANG)
    logging.shutdown()
    os._exit(EXIT_HANG)
