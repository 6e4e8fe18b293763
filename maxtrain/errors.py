"""User-facing errors and the process exit codes (the contract in DESIGN.md), defined here only.

No jax import: the supervisor (`maxtrain.launch`) reads the codes without starting JAX.
"""

from __future__ import annotations

import difflib
import os
import re
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


# The one map from the exception that ends a command to its exit code and the label of its error tail
# (`maxtrain.<command>: <label>: <message>`, cli/shell.py): the first row the exception is an instance of
# wins; anything else is a crash (EXIT_CRASH, "crash").
EXITS: tuple[tuple[type[BaseException], int, str], ...] = (
    (UserError, EXIT_BAD_INPUT, "error"),
    (Preempted, EXIT_PREEMPTED, "preempted"),
    (Aborted, EXIT_ABORTED, "aborted"),
    (Stalled, EXIT_HANG, "hang"),  # an async side (weight publish, rollout producer) hung: restartable like a hang
    (UserCodeExit, EXIT_CRASH, "crash"),  # a reward's sys.exit: a crash (restarted), never a finish
    (KeyboardInterrupt, EXIT_INTERRUPTED, "interrupted (Ctrl-C)"),
)


def exit_row(error: BaseException) -> tuple[int, str]:
  """(exit code, tail label) of the exception that ends a command, from EXITS."""
  return next(((code, label) for kind, code, label in EXITS if isinstance(error, kind)), (EXIT_CRASH, "crash"))


def exit_code(error: BaseException) -> int:
  """The process exit code for an exception that ends a run (1 = crash for anything unexpected)."""
  return exit_row(error)[0]


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


def printable(text: str) -> str:
  """`text` with file names that are not UTF-8 (surrogate escapes) shown as \\xNN: printing them raw
  fails on a UTF-8 terminal."""
  text = re.sub(r"\\udc([89a-f][0-9a-f])", r"\\x\1", text)  # the same byte where a repr() wrote its escape
  return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
