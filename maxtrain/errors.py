"""User-facing errors and the process exit codes (the contract in DESIGN.md), defined here only.

No jax import: the supervisor (`maxtrain.launch`) reads the codes without starting JAX.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Sequence

EXIT_OK = 0  # finished
EXIT_CRASH = 1  # anything unexpected: restarted with backoff
EXIT_BAD_INPUT = 2  # UserError: a restart would fail the same way
EXIT_ABORTED = 3  # Aborted: a training policy stopped the run; not restarted, a person must look
EXIT_PREEMPTED = 75  # Preempted: checkpoint saved, restartable at once
EXIT_HANG = 76  # the watchdog saw no progress: restartable
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT) before the run could save (128 + SIGINT, as shells report it): not restarted

MEANINGS = {EXIT_OK: "finished", EXIT_BAD_INPUT: "bad config or input", EXIT_ABORTED: "stopped by a training policy",
            EXIT_PREEMPTED: "preempted", EXIT_HANG: "hang (watchdog)",
            EXIT_INTERRUPTED: "interrupted (Ctrl-C)"}
# a restart would fail the same way, needs a person, or would undo a user's Ctrl-C
NOT_RESTARTED = (EXIT_OK, EXIT_BAD_INPUT, EXIT_ABORTED, EXIT_INTERRUPTED)


class UserError(Exception):
  """A mistake in the config or input that a restart would not fix.

  The message names the key, file or value, what was found, and what to do.
  """


class Preempted(Exception):
  """The run was asked to stop (SIGTERM/SIGINT) and saved a checkpoint: exit 75, restartable."""


class Aborted(Exception):
  """A training policy stopped the run (a loss spike with spike_action=abort, or the rollback budget
  used up): exit 3, which a supervisor does not restart (a bitwise resume would replay the same batches)."""


class Stalled(Exception):
  """An asynchronous side of the run (a weight publish, the RL rollout producer) made no progress within
  its timeout (post.sync_timeout_s): exit 76 like a watchdog hang, restartable from the last checkpoint."""


class UserCodeExit(RuntimeError):
  """User code (a reward function, a task) called sys.exit or raised KeyboardInterrupt inside the run:
  a crash with its own code (exit 1, restarted like any crash), never a finish. The message names it."""


def exit_code(error: BaseException) -> int:
  """The process exit code for an exception that ends a run (1 = crash for anything unexpected)."""
  for kind, code in ((UserError, EXIT_BAD_INPUT), (Preempted, EXIT_PREEMPTED), (Aborted, EXIT_ABORTED), (Stalled, EXIT_HANG),
                     (KeyboardInterrupt, EXIT_INTERRUPTED)):
    if isinstance(error, kind):
      return code
  return EXIT_CRASH


def require(ok: bool, message: str) -> None:
  """Raises UserError(message) unless `ok`: for checks of user input, where `assert` is wrong."""
  if not ok:
    raise UserError(message)


def choice(key: str, value: str, choices: Sequence[str]) -> None:
  """`config.<key>` must be one of `choices`; the error suggests the nearest one."""
  if value not in choices:
    close = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise UserError(f"config.{key}={value!r}: choose one of {', '.join(choices)}.{hint}")


def require_writable_dir(path: "os.PathLike[str] | str", what: str,
                         hint: str = "choose a directory this process can create and write") -> None:
  """Creates the directory `path` and proves it writable with a probe file, before any compute;
  else UserError: `what` (the key and value), why, and `hint`."""
  path = Path(path)
  try:
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".write-probe-{os.getpid()}"
    probe.write_bytes(b"ok")
    probe.unlink()
  except OSError as e:
    why = "is a file, not a directory" if path.is_file() else f"is not writable ({e.strerror})"
    raise UserError(f"{what} {why}: {hint}") from None
