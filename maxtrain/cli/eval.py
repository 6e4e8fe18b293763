"""Entry point: `python -m maxtrain.eval --checkpoint DIR --tasks NAMES [--include-path DIR] [--output FILE]
[--watch RUN_DIR] [--config.KEY=VALUE ...]`.

DIR: a run's output dir, a checkpoint step dir, a converted checkpoint or a Hugging Face dir. NAMES:
comma-separated lm-eval task names (the shipped ones: maxtrain/evaluation/tasks; more with
--include-path). Writes lm-eval's results JSON (`results.<task>.<metric>`) to --output (default: the
checkpoint's `eval/<step>/results.json` in its run, else DIR/eval_results.json) and TensorBoard scalars
next to it. `--watch RUN_DIR` instead evaluates every new verified checkpoint of the run exactly once
and exits when the run has finished (docs/evaluation.md). Exit 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from maxtrain.cli import shell
from maxtrain.errors import UserError
from maxtrain.evaluation import run, watch

MAX_POLL_SECONDS = 3600.0  # --watch polls at least hourly: a run's checkpoints are minutes apart


def parser() -> argparse.ArgumentParser:
  p = shell.ArgumentParser(prog="python -m maxtrain.eval", description=__doc__.split("\n\n")[0])
  where = p.add_mutually_exclusive_group(required=True)
  where.add_argument("--checkpoint", help="a checkpoint (any kind generate reads)")
  where.add_argument("--watch", metavar="RUN_DIR", help="evaluate each new checkpoint of a run, once")
  p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
  p.add_argument("--include-path", default=None, help="a folder of extra lm-eval task YAML files")
  p.add_argument("--output", default=None, help="results JSON path (--checkpoint only)")
  p.add_argument("--batch-size", type=int, default=8)
  p.add_argument("--poll-seconds", type=float, default=10.0, help="--watch: how often to look for checkpoints")
  return p


def default_output(checkpoint: str) -> Path:
  """A training step dir RUN/checkpoints/STEP -> RUN/eval/STEP/results.json (the step dir stays exactly
  what its manifest lists); any other checkpoint: DIR/eval_results.json."""
  path = Path(checkpoint).absolute()
  if path.name.isdigit() and path.parent.name == "checkpoints":
    return path.parent.parent / "eval" / path.name / "results.json"
  return path / "eval_results.json"


def check_flags(args: argparse.Namespace) -> None:
  """UserError naming the first flag out of range, before any checkpoint or task is opened."""
  if args.batch_size < 1:
    raise UserError(f"--batch-size={args.batch_size}: must be >= 1")
  if not 0 < args.poll_seconds <= MAX_POLL_SECONDS:  # NaN fails this too
    raise UserError(f"--poll-seconds={args.poll_seconds}: must be a number in (0, {MAX_POLL_SECONDS:g}] "
                    "(how often --watch looks for new checkpoints)")
  if args.output is not None and args.watch:
    raise UserError(f"--output={args.output}: --watch writes each step's results to RUN_DIR/eval/STEP/results.json; "
                    "--output is for --checkpoint only")


def evaluate(invocation: shell.Invocation) -> int | None:
  args, overrides = invocation.args, invocation.config_argv
  check_flags(args)
  if args.checkpoint:
    output = run.check_output(args.output or str(default_output(args.checkpoint)),
                              "--output" if args.output else "the default --output")
  manager = run.task_manager(args.include_path)
  names = run.check_tasks(args.tasks.split(","), manager)
  if args.watch:
    return watch.watch(Path(args.watch), names, manager, overrides, args.batch_size, args.poll_seconds)
  lm, _ = run.load_lm(args.checkpoint, overrides, args.batch_size)
  results = run.evaluate(lm, names, manager)
  try:
    run.write_json(output, results)
  except OSError as e:  # checked before the evaluation; the disk can still fill up or the folder vanish
    # not bad input (a crash, exit 1): a full disk may have room on the next try
    raise OSError(f"--output={output}: cannot write the results ({e.strerror or e})") from e
  from maxtrain.monitor.tensorboard import MetricWriter  # jax only after the flags: --help without it

  writer = MetricWriter(output.parent / "tensorboard")
  step = Path(args.checkpoint).name
  writer.scalars(int(step) if step.isdigit() else 0, run.scalars(results))
  writer.close()
  for tag, value in sorted(run.scalars(results).items()):
    print(f"{tag} = {value:.6g}")
  print(f"results: {output}", file=sys.stderr)
  return None


COMMAND = shell.Command(name="maxtrain.eval", prog="python -m maxtrain.eval", parser=parser, list_keys=False)


def main(argv: Sequence[str] | None = None) -> int:
  return shell.run(COMMAND, evaluate, argv)

if __name__ == "__main__":
  sys.exit(main())
