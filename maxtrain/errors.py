"""User-facing errors. Anything raised as `UserError` exits the trainer with code 2."""


class UserError(Exception):
  """A mistake in the config or input that a restart would not fix.

  The message names the key, file or value, what was found, and what to do.
  """


class Preempted(Exception):
  """The run was asked to stop (SIGTERM/SIGINT) and saved a checkpoint: exit 75, restartable."""


class Aborted(Exception):
  """A guard stopped the run (a loss spike with spike_action=abort, or rollbacks exhausted)."""
