"""User-facing errors. Anything raised as `UserError` exits the trainer with code 2."""


class UserError(Exception):
  """A mistake in the config or input that a restart would not fix.

  The message names the key, file or value, what was found, and what to do.
  """
