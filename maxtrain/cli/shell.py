"""The one entry-point shell: every `python -m maxtrain.X` (and the tools that take a config) runs through `run`.

It sets up logging once, splits `--config=PATH` / `--config.KEY=VALUE` from the command's own flags with one
parser, serves `--help` one way (the command's flags, then every config key when it takes a config), and ends
the command with the exit code of the one table in `errors.py` (`EXITS`), printing one error tail:
`<name>: <label>: <message>` (a usage mistake included). No jax import: the supervisor's
`--help` starts without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import threading
import traceback
from typing import Callable, Sequence


from maxtrain import config as config_lib
from maxtrain.config.loader import parse_args as parse_config_args
from maxtrain.errors import EXIT_OK, EXITS, UserError, exit_row, printable

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Libraries that log every step of their work at INFO (Orbax's saves through absl, lm-eval's per-task notes):
# shown one level above the command's own.
NOISY_LOGGERS = ("absl", "lm_eval", "lm-eval")


@dataclasses.dataclass(frozen=True)
class Command:
  """What differs between the entry points; everything else is the shell's."""
  name: str  # the error tail's prefix: `maxtrain` for the trainer (the one program), else `maxtrain.<command>`
  prog: str  # as typed: `python -m maxtrain.X` (usage lines and --help)
  parser: Callable[[], argparse.ArgumentParser] | None = None  # the command's own flags (none: config only)
  config: bool = True  # takes --config=PATH / --config.KEY=VALUE
  list_keys: bool = True  # --help lists every config key (off where the model comes from a checkpoint)
  passthrough: bool = False  # arguments after `--` are another program's (the supervisor's trainer), unparsed
  log_level: int = logging.WARNING
  interrupted: str = ""  # what a Ctrl-C before the command could finish means, appended to its tail


@dataclasses.dataclass(frozen=True)
class Invocation:
  """A parsed command line: the command's own flags, its config arguments in order, and any passthrough."""
  args: argparse.Namespace
  config_argv: list[str]  # `--config=PATH` and `--config.KEY=VALUE`, as given (the loader's and sampling's input)
  rest: list[str]  # after `--` (passthrough commands)

  def load_config(self) -> config_lib.Config:
    """The config file, its hardware preset and the overrides (config.load), typed once here: the frozen
    sections every component takes (config/schema.py)."""
    return config_lib.Config.of(config_lib.load(self.config_argv))


def run(command: Command, main: Callable[[Invocation], int | None], argv: Sequence[str] | None = None) -> int:
  """Parses `argv` (default: sys.argv[1:]), serves --help, calls `main` and returns the process exit code."""
  setup_logging(command.log_level)
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    own, config_argv, rest = split(command, argv)
    if "-h" in own or "--help" in own:
      print(help_text(command, own, config_argv))
      return EXIT_OK
    invocation = Invocation(parse_own(command, own), config_argv, rest)
    code = main(invocation)
  # The one place an exception becomes an exit code (errors.EXITS). SystemExit passes through: the loader and
  # the rewards turn user code's exits into errors first; any other is the interpreter's to end with.
  except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001
    return fail(command, e)
  return EXIT_OK if code is None else code


def setup_logging(level: int) -> None:
  """The one logging setup. A host that configured logging first (pytest) keeps its handlers."""
  logging.basicConfig(level=level, format=LOG_FORMAT, datefmt="%H:%M:%S")
  if level < logging.WARNING:  # the trainer's progress lines show under such a host too
    logging.getLogger("maxtrain").setLevel(level)
  for name in NOISY_LOGGERS:
    logging.getLogger(name).setLevel(max(level + 10, logging.WARNING))


def split(command: Command, argv: list[str]) -> tuple[list[str], list[str], list[str]]:
  """(own flags, config arguments, passthrough): the one override parser. A config argument's value may be
  the next word (`--config PATH`, `--config.steps 5`), as the loader reads it."""
  rest: list[str] = []
  if command.passthrough and "--" in argv:
    argv, rest = argv[:argv.index("--")], argv[argv.index("--") + 1:]
  if not command.config:
    return argv, [], rest
  own, config_argv = [], []
  i = 0
  while i < len(argv):
    word = argv[i]
    is_config = word.startswith(("--config=", "--config.")) or word == "--config"
    take = 1 + (is_config and "=" not in word and i + 1 < len(argv))  # the value as the next word
    (config_argv if is_config else own).extend(argv[i:i + take])
    i += take
  parse_config_args(config_argv)  # a missing value is a UserError naming the flag, before anything runs
  return own, config_argv, rest


class ArgumentParser(argparse.ArgumentParser):
  """The entry points' flag parser: a usage mistake is a UserError, so it ends in the one error tail (exit 2)
  like any bad input, not in argparse's own exit. Subcommands' parsers are of this class too."""

  def error(self, message: str):
    raise UserError(f"{message} (see --help)")


def parse_own(command: Command, own: list[str]) -> argparse.Namespace:
  """The command's own flags (none: only config arguments are allowed)."""
  if command.parser is None:
    if own:
      raise UserError(f"unexpected argument {own[0]!r}: use --config=PATH and --config.KEY=VALUE "
                      "(--help lists the keys)")
    return argparse.Namespace()
  return command.parser().parse_args(own)


def help_text(command: Command, own: list[str], config_argv: list[str]) -> str:
  """The one --help: the command's flags (a subcommand's when one is named), then every config key with its
  value (of `--config=PATH` when given) and meaning, for the commands that take a config."""
  parts = []
  if command.parser is not None:
    parts.append(_subcommand(command.parser(), own).format_help())
  if command.config and command.list_keys:
    keys = config_lib.help_text(config_argv, command.prog.removeprefix("python -m "))
    parts.append(keys.split("\n", 2)[2] if parts else keys)  # the flags' usage line already said how
  return "\n".join(parts)


def _subcommand(parser: argparse.ArgumentParser, own: list[str]) -> argparse.ArgumentParser:
  """The subcommand's parser when `own` names one (`convert from-hf --help`), else `parser`."""
  for action in parser._actions:  # argparse keeps subcommands only here
    if isinstance(action, argparse._SubParsersAction):
      for word in own:
        if word in action.choices:
          return action.choices[word]
  return parser


def fail(command: Command, error: BaseException) -> int:
  """Prints the error tail (and a crash's traceback) and returns the exit code from errors.EXITS."""
  code, label = exit_row(error)
  message = str(error)
  if isinstance(error, KeyboardInterrupt):
    # Exiting already: a further SIGINT (a terminal's Ctrl-C reaches the supervisor too, which forwards it)
    # must not interrupt the interpreter's shutdown with a traceback.
    if threading.current_thread() is threading.main_thread():
      signal.signal(signal.SIGINT, signal.SIG_IGN)
    message = command.interrupted
  elif not any(isinstance(error, kind) for kind, _, _ in EXITS):
    traceback.print_exception(error, file=sys.stderr)  # unexpected: where it came from is the report
    message = f"{type(error).__name__}: {error} (traceback above)"
  tail = f"{command.name}: {label}: {message}" if message else f"{command.name}: {label}"
  print(printable(tail), file=sys.stderr, flush=True)
  return code

