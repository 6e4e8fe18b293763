"""The one entry-point shell (maxtrain/cli/shell.py): exceptions -> exit codes by errors.EXITS with one error
tail, one override split, one --help path. In-process and without jax: each case is milliseconds."""

import importlib
import signal

import pytest

from maxtrain.cli import shell
from maxtrain.errors import (EXIT_ABORTED, EXIT_BAD_INPUT, EXIT_CRASH, EXIT_HANG, EXIT_INTERRUPTED, EXIT_PREEMPTED,
                             EXITS, Aborted, Preempted, Stalled, UserCodeExit, UserError)

TOOL = shell.Command(name="maxtrain.tool", prog="python -m maxtrain.tool", parser=lambda: _parser(), list_keys=False,
                     interrupted="nothing was written")


def _parser() -> shell.ArgumentParser:
  p = shell.ArgumentParser(prog="python -m maxtrain.tool")
  p.add_argument("--count", type=int, required=True)
  return p


def _raises(error: BaseException):
  def main(invocation: shell.Invocation):
    raise error
  return main


@pytest.mark.parametrize("error,code,tail", [
    (UserError("config.steps=0: must be > 0"), EXIT_BAD_INPUT, "maxtrain.tool: error: config.steps=0: must be > 0"),
    (Preempted("stopped by SIGTERM after step 4"), EXIT_PREEMPTED,
     "maxtrain.tool: preempted: stopped by SIGTERM after step 4"),
    (Aborted("loss spike at step 7"), EXIT_ABORTED, "maxtrain.tool: aborted: loss spike at step 7"),
    (Stalled("publish 3 took over 5s"), EXIT_HANG, "maxtrain.tool: hang: publish 3 took over 5s"),
    (UserCodeExit("config.post.reward='m:f' raised SystemExit(0)"), EXIT_CRASH,
     "maxtrain.tool: crash: config.post.reward='m:f' raised SystemExit(0)"),
    (KeyboardInterrupt(), EXIT_INTERRUPTED, "maxtrain.tool: interrupted (Ctrl-C): nothing was written"),
    (ZeroDivisionError("division by zero"), EXIT_CRASH,
     "maxtrain.tool: crash: ZeroDivisionError: division by zero (traceback above)"),
])
def test_each_ending_maps_to_its_code_and_one_tail(capsys, error, code, tail):
  handler = signal.getsignal(signal.SIGINT)
  try:
    assert shell.run(TOOL, _raises(error), ["--count=1"]) == code
  finally:
    signal.signal(signal.SIGINT, handler)  # the shell ignores a second Ctrl-C while exiting
  err = capsys.readouterr().err
  assert err.strip().splitlines()[-1] == tail
  # Only the unexpected carries a traceback: every row of the table is a message that says what happened.
  assert ("Traceback" in err) == (not any(isinstance(error, kind) for kind, _, _ in EXITS))


def test_a_usage_mistake_is_the_same_tail_and_exit_2(capsys):
  assert shell.run(TOOL, _raises(AssertionError("not reached")), ["--count=x"]) == EXIT_BAD_INPUT
  assert capsys.readouterr().err == "maxtrain.tool: error: argument --count: invalid int value: 'x' (see --help)\n"
  assert shell.run(TOOL, _raises(AssertionError("not reached")), []) == EXIT_BAD_INPUT
  assert "maxtrain.tool: error: the following arguments are required: --count" in capsys.readouterr().err


def test_one_split_of_config_arguments_from_the_commands_own():
  seen = []
  command = shell.Command(name="x", prog="x", parser=_parser, passthrough=True)
  code = shell.run(command, seen.append, ["--config", "configs/default.py", "--count", "3", "--config.steps", "5",
                                          "--config.seed=2", "--", "--config.steps=7", "--other"])
  assert code == 0
  (invocation,) = seen
  assert invocation.args.count == 3
  assert invocation.config_argv == ["--config", "configs/default.py", "--config.steps", "5", "--config.seed=2"]
  assert invocation.rest == ["--config.steps=7", "--other"]  # another program's: not parsed here
  assert (invocation.load_config().steps, invocation.load_config().seed) == (5, 2)


def test_config_only_command_refuses_other_arguments_and_a_missing_value(capsys):
  command = shell.Command(name="maxtrain", prog="python -m maxtrain.train")
  assert shell.run(command, _raises(AssertionError("not reached")), ["--config.steps"]) == EXIT_BAD_INPUT
  assert "maxtrain: error: --config.steps: missing value" in capsys.readouterr().err
  assert shell.run(command, _raises(AssertionError("not reached")), ["steps=3"]) == EXIT_BAD_INPUT
  assert "maxtrain: error: unexpected argument 'steps=3'" in capsys.readouterr().err


@pytest.mark.parametrize("module,argv,expected", [
    ("train", ["--help"], ["usage: python -m maxtrain.train", "  model.d_ff = "]),
    ("compile", ["-h"], ["usage: python -m maxtrain.compile", "--device-memory-gb", "  model.d_ff = "]),
    ("convert", ["to-hf", "--help"], ["usage: python -m maxtrain.convert to-hf", "--max-shard-size"]),
    ("eval", ["--help"], ["usage: python -m maxtrain.eval", "--poll-seconds"]),
    ("generate", ["--help"], ["usage: python -m maxtrain.generate", "--top-p"]),
    ("launch", ["--help", "--", "--help"], ["usage: python -m maxtrain.launch", "--peer-grace"]),
])
def test_every_entry_point_serves_help_one_way(capsys, module, argv, expected):
  """Exit 0 before anything runs (required flags not asked for), the flags (a subcommand's when named), and
  every config key only where the command's model comes from the config."""
  main = importlib.import_module(f"maxtrain.cli.{module}").main
  assert main(argv) == 0
  out = capsys.readouterr().out
  assert all(text in out for text in expected), out[:2000]
  assert ("  model.d_ff = " in out) == (module in ("train", "compile"))
