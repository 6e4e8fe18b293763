"""User-facing errors and the process exit codes they map to (the contract in DESIGN.md)."""

EXIT_BAD_INPUT = 2  # UserError: a restart would fail the same way
EXIT_PREEMPTED = 75  # Preempted: checkpoint saved, restartable
EXIT_ABORTED = 1  # Aborted: a guard stopped the run; a crash by the contract, restartable


class UserError(Exception):
  """A mistake in the config or input that a restart would not fix.

  The message names the key, file or value, what was found, and what to do.
  """


class Preempted(Exception):
  """The run was asked to stop (SIGTERM/SIGINT) and saved a checkpoint: exit 75, restartable."""


class Aborted(Exception):
  """A guard stopped the run (a loss spike with spike_action=abort, or rollbacks exhausted)."""


def exit_code(error: BaseException) -> int:
  """The process exit code for an exception that ends a run (1 = crash for anything unexpected)."""
  for kind, code in ((UserError, EXIT_BAD_INPUT), (Preempted, EXIT_PREEMPTED), (Aborted, EXIT_ABORTED)):
    if isinstance(error, kind):
      return code
  return 1
