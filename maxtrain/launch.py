"""Supervisor: `python -m maxtrain.launch [options] -- [train arguments]`.

Runs `python -m maxtrain.train` and restarts it by the exit-code contract (DESIGN.md):
  0 finished -> stop (exit 0);  2 bad config/input -> stop (exit 2), a restart would fail the same way;
  3 stopped by a training policy (spike abort, rollback budget used up) -> stop (exit 3), a person must look;
  75 preempted -> restart at once, not counted;  76 hang, or any other code -> restart after an
  exponential backoff, counted: more than --max-restarts counted restarts within --window seconds
  is a crash loop -> give up with a summary and exit 1.
Every restart resumes from the newest checkpoint (the trainer's checkpoint.resume=auto).
Attempts are numbered in $MAXTRAIN_ATTEMPT and in the run's events.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from maxtrain.errors import EXIT_BAD_INPUT, EXIT_CRASH, EXIT_HANG, EXIT_PREEMPTED, MEANINGS, NOT_RESTARTED
from maxtrain.monitor import events as ev


@dataclasses.dataclass
class Attempt:
  number: int
  code: int
  seconds: float

  def describe(self) -> str:
    meaning = MEANINGS.get(self.code, "killed by signal" if self.code < 0 else "crash")
    return f"attempt {self.number}: exit {self.code} ({meaning}) after {self.seconds:.1f}s"


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
  argv = list(argv)
  train_args = argv[argv.index("--") + 1:] if "--" in argv else []
  own = argv[:argv.index("--")] if "--" in argv else argv
  parser = argparse.ArgumentParser(prog="python -m maxtrain.launch", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--max-restarts", type=int, default=10, help="counted restarts allowed within --window")
  parser.add_argument("--window", type=float, default=3600.0, help="seconds over which restarts are counted")
  parser.add_argument("--backoff", type=float, default=5.0, help="first backoff in seconds; doubles each time")
  parser.add_argument("--max-backoff", type=float, default=300.0)
  return parser.parse_args(own), train_args


def output_dir(train_args: list[str]) -> Path:
  """The run's output_dir, resolved exactly as the trainer will (config file + overrides)."""
  from maxtrain import config as config_lib

  return Path(config_lib.load(train_args).output_dir)


def main(argv: Sequence[str] | None = None) -> int:
  args, train_args = parse_args(sys.argv[1:] if argv is None else argv)
  try:
    out = output_dir(train_args)
  except Exception as e:  # noqa: BLE001 - a bad config: the trainer would exit 2, so do we
    print(f"maxtrain.launch: error: {e}", file=sys.stderr)
    return EXIT_BAD_INPUT
  try:
    out.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    print(f"maxtrain.launch: error: output_dir={out} cannot be created ({e.strerror}): choose a writable "
          "directory with --config.output_dir", file=sys.stderr)
    return EXIT_BAD_INPUT
  attempts: list[Attempt] = []
  counted: list[float] = []  # monotonic times of counted restarts
  child: subprocess.Popen | None = None
  stopping = False

  def forward(signum, frame):
    nonlocal stopping
    stopping = True
    if child is not None and child.poll() is None:
      child.send_signal(signum)  # the trainer saves and exits 75; we then stop instead of restarting

  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, forward)

  reason, backoff = "start", 0.0
  while True:
    number = len(attempts)
    log = ev.EventLog(out / ev.FILENAME, ev.SUPERVISOR, attempt=number)
    log.emit(ev.RESTART, reason=reason, backoff_s=backoff)
    t0 = time.monotonic()
    child = subprocess.Popen([sys.executable, "-m", "maxtrain.train", *train_args],
                             env={**os.environ, ev.ATTEMPT_ENV: str(number)})
    code = child.wait()
    attempts.append(Attempt(number, code, time.monotonic() - t0))
    print(f"maxtrain.launch: {attempts[-1].describe()}", file=sys.stderr, flush=True)
    if code not in (*NOT_RESTARTED, EXIT_PREEMPTED):
      log.emit(ev.CRASH, code=code, reason=attempts[-1].describe())
    log.close()
    if code in NOT_RESTARTED or stopping:
      return code
    if code == EXIT_PREEMPTED:
      reason, backoff = "preempted", 0.0
      continue
    now = time.monotonic()
    counted = [t for t in counted if now - t < args.window] + [now]
    if len(counted) > args.max_restarts:
      print(f"maxtrain.launch: giving up: {len(counted)} failed attempts within {args.window:.0f}s exceed "
            f"--max-restarts={args.max_restarts} (a crash loop). Attempts:\n  "
            + "\n  ".join(a.describe() for a in attempts), file=sys.stderr)
      return EXIT_CRASH
    backoff = min(args.backoff * 2 ** (len(counted) - 1), args.max_backoff)
    reason = "hang" if code == EXIT_HANG else "crash"
    print(f"maxtrain.launch: restarting in {backoff:.1f}s ({len(counted)}/{args.max_restarts} restarts "
          f"within {args.window:.0f}s)", file=sys.stderr, flush=True)
    time.sleep(backoff)  # the backoff itself, not synchronisation
    if stopping:
      return code


if __name__ == "__main__":
  sys.exit(main())
