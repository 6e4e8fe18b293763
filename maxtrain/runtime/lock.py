"""One writer per run: an exclusive lock on the output directory, held for the life of the trainer.

`<output_dir>/.maxtrain.lock` names its holder (host, pid, start time) and is held with `fcntl.flock`,
which the kernel releases when the process ends however it ends (SIGKILL included): a lock left by
a dead process is simply taken, with a warning naming the previous holder when the file still names
a process that is gone. A second trainer on the same directory is refused with exit 2 naming the
holder, before it writes anything there. Process 0 takes it in a multi-process run.

flock is advisory and per host: it keeps two trainers of one machine (or of one NFS client) apart,
which is the common mistake (a rerun while the first is still going). Across hosts on a shared
filesystem the file's contents still name the holder, but the lock may not be enforced.

The same lock is taken in the checkpoint directory (`checkpoint.dir`, when it is not the output
directory's own): two runs with different output directories must not save into one.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from maxtrain.errors import UserError

log = logging.getLogger("maxtrain")
FILENAME = ".maxtrain.lock"


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, another user's
    return True
  return True


def _describe(holder: dict) -> str:
  started = holder.get("started")
  when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
  return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {when}"


class RunLock:
  """`acquire()` takes the lock or raises UserError naming the holder; `release()` lets it go."""

  def __init__(self, directory: Path, key: str = "config.output_dir"):
    self.path = Path(directory) / FILENAME
    self.key = key  # what the user sets to choose another directory, for the messages
    self._fd: int | None = None

  def acquire(self) -> "RunLock":
    try:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
      raise UserError(f"{self.key}={self.path.parent}: cannot create {self.path.name} ({e.strerror}); choose a "
                      f"writable {self.key}") from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = self._read(fd)
      os.close(fd)
      raise UserError(f"{self.key}={self.path.parent} is in use by another trainer ({_describe(holder)}; lock file "
                      f"{self.path}). Two runs in one directory would overwrite each other's checkpoints: wait for "
                      f"it to finish, stop it, or choose another {self.key}.") from None
    previous = self._read(fd)
    if previous.get("pid") and previous.get("host") == socket.gethostname() and not _alive(int(previous["pid"])):
      log.warning("%s %s: taking over the lock of a trainer that is gone (%s); it did not exit cleanly",
                  self.key, self.path.parent, _describe(previous))
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    self._fd = fd
    return self

  @staticmethod
  def _read(fd: int) -> dict:
    try:
      data = os.pread(fd, 4096, 0)
      holder = json.loads(data) if data.strip() else {}
      return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
      return {}

  def release(self) -> None:
    """Empties the file (a clean exit leaves no holder to warn about) and unlocks it."""
    if self._fd is None:
      return
    try:
      os.ftruncate(self._fd, 0)
    finally:
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None
