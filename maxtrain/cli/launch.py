"""Supervisor: `python -m maxtrain.launch [options] -- [train arguments]`.

Runs `python -m maxtrain.train` and restarts it by the exit-code contract (DESIGN.md):
  0 finished -> stop (exit 0);  2 bad config/input -> stop (exit 2), a restart would fail the same way;
  3 stopped by a training policy (spike abort, rollback budget used up) -> stop (exit 3), a person must look;
  130 interrupted by Ctrl-C (SIGINT) before it could save -> stop (exit 130): a user's Ctrl-C is not a crash;
  75 preempted -> restart at once, not counted;  76 hang, or any other code -> restart after an
  exponential backoff, counted: more than --max-restarts counted restarts within --window seconds
  is a crash loop -> give up with a summary and exit 1.
Every restart resumes from the newest checkpoint (the trainer's checkpoint.resume=auto).
Attempts are numbered in $MAXTRAIN_ATTEMPT and in the run's events.jsonl.

--processes N starts N trainer processes of one SPMD job on this host (jax.distributed on a free
localhost port, a new one per attempt) and treats them as one: they start, stop and restart together.
When one exits with an error the others get --peer-grace seconds to exit on their own (a hang makes
every watchdog fire, a stop request reaches every process), then are killed. The attempt's code is a
not-restarted code (2, 3) if any process has one, else the code of the process that failed first
(a peer's abort or kill that follows is a consequence).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import queue
import signal
import socket
import subprocess
import threading
import sys
import time
from pathlib import Path
from typing import Sequence

from maxtrain.cli import shell
from maxtrain.errors import EXIT_CRASH, EXIT_HANG, EXIT_INTERRUPTED, EXIT_PREEMPTED, MEANINGS, NOT_RESTARTED, UserError
from maxtrain.monitor import events as ev
from maxtrain import config as config_lib


@dataclasses.dataclass
class Attempt:
  number: int
  code: int
  seconds: float
  codes: tuple[int, ...] = ()  # per process, with --processes

  def describe(self) -> str:
    meaning = MEANINGS.get(self.code, "killed by signal" if self.code < 0 else "crash")
    per_process = f" (processes, in exit order: {', '.join(map(str, self.codes))})" if len(self.codes) > 1 else ""
    return f"attempt {self.number}: exit {self.code} ({meaning}) after {self.seconds:.1f}s{per_process}"


def parser() -> argparse.ArgumentParser:
  p = shell.ArgumentParser(prog="python -m maxtrain.launch", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--max-restarts", type=int, default=10, help="counted restarts allowed within --window")
  p.add_argument("--window", type=float, default=3600.0, help="seconds over which restarts are counted")
  p.add_argument("--backoff", type=float, default=5.0, help="first backoff in seconds; doubles each time")
  p.add_argument("--max-backoff", type=float, default=300.0)
  p.add_argument("--processes", type=int, default=1, help="trainer processes of one job on this host")
  p.add_argument("--peer-grace", type=float, default=60.0,
                 help="seconds the other processes get to exit after one failed, then they are killed")
  return p


# The trainer's arguments (after `--`) pass through unparsed: the supervisor reads only its output_dir.
COMMAND = shell.Command(name="maxtrain.launch", prog="python -m maxtrain.launch", parser=parser, config=False,
                        passthrough=True)


def check_args(args: argparse.Namespace) -> None:
  """UserError naming the first supervisor argument out of range. Checked before anything starts: a
  negative backoff would only fail at the first restart (time.sleep), mid-run."""
  limits = (("--processes", args.processes, 1), ("--max-restarts", args.max_restarts, 0),
            ("--window", args.window, None), ("--backoff", args.backoff, 0), ("--max-backoff", args.max_backoff, 0),
            ("--peer-grace", args.peer_grace, 0))
  for flag, value, low in limits:
    if not math.isfinite(value):
      raise UserError(f"{flag}={value}: must be a finite number")
    if low is None and value <= 0:
      raise UserError(f"{flag}={value}: must be > 0 seconds")
    if low is not None and value < low:
      raise UserError(f"{flag}={value}: must be >= {low}")


def output_dir(train_args: list[str]) -> Path:
  """The run's output_dir, resolved exactly as the trainer will (config file + overrides)."""
  return Path(config_lib.load(train_args).output_dir)


def main(argv: Sequence[str] | None = None) -> int:
  return shell.run(COMMAND, supervise, argv)


def supervise(invocation: shell.Invocation) -> int:
  """Runs the trainer (`invocation.rest`) until it finishes, may not be restarted, or crash-loops."""
  args, train_args = invocation.args, invocation.rest
  check_args(args)
  out = output_dir(train_args)  # a bad config: the trainer would exit 2, so do we
  try:
    out.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise UserError(f"output_dir={out} cannot be created ({e.strerror}): choose a writable directory with "
                    "--config.output_dir") from None
  attempts: list[Attempt] = []
  counted: list[float] = []  # monotonic times of counted restarts
  children: list[subprocess.Popen] = []
  stopping = False

  def forward(signum, frame):
    nonlocal stopping
    stopping = True
    for child in children:
      if child.poll() is None:
        child.send_signal(signum)  # the trainer saves and exits 75; we then stop instead of restarting

  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, forward)

  reason, backoff = "start", 0.0
  while True:
    number = len(attempts)
    log = ev.EventLog(out / ev.FILENAME, ev.SUPERVISOR, attempt=number)
    log.emit(ev.RESTART, reason=reason, backoff_s=backoff)
    t0 = time.monotonic()
    children[:] = start_processes(train_args, args.processes, {**os.environ, ev.ATTEMPT_ENV: str(number)})
    codes = wait_all(children, args.peer_grace)
    code = attempt_code(codes)
    attempts.append(Attempt(number, code, time.monotonic() - t0, tuple(codes)))
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


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_processes(train_args: list[str], num_processes: int, env: dict[str, str]) -> list[subprocess.Popen]:
  """One trainer, or `num_processes` joined by jax.distributed on a fresh localhost port."""
  command = [sys.executable, "-m", "maxtrain.train", *train_args]
  if num_processes == 1:
    return [subprocess.Popen(command, env=env)]
  layout = [f"--config.runtime.num_processes={num_processes}", f"--config.runtime.coordinator=127.0.0.1:{free_port()}"]
  return [subprocess.Popen([*command, *layout, f"--config.runtime.process_id={i}"], env=env)
          for i in range(num_processes)]


def wait_all(children: list[subprocess.Popen], grace_s: float) -> list[int]:
  """Every child's exit code, in the order they exited; once one has failed, the rest are killed after
  `grace_s` seconds."""
  done: queue.Queue = queue.Queue()
  for i, child in enumerate(children):
    threading.Thread(target=lambda i=i, child=child: done.put((i, child.wait())), daemon=True).start()
  codes: dict[int, int] = {}
  failed_at = None
  while len(codes) < len(children):
    timeout = None if failed_at is None else max(failed_at + grace_s - time.monotonic(), 0.0)
    try:
      i, code = done.get(timeout=timeout)
    except queue.Empty:
      for child in children:
        if child.poll() is None:
          print(f"maxtrain.launch: killing process {children.index(child)} (pid {child.pid}): still running "
                f"{grace_s:.0f}s after another process failed", file=sys.stderr, flush=True)
          child.kill()
      failed_at = float("inf")  # killed: now wait for their exit
      continue
    codes[i] = code
    if code != 0 and failed_at is None:
      failed_at = time.monotonic()
  return list(codes.values())  # dicts keep insertion order: the order of exit


def attempt_code(codes: list[int]) -> int:
  """One code for the processes of an attempt, from their codes in the order they exited (see the
  module doc)."""
  # A trainer killed by SIGINT itself (Python's default handler) is a user's Ctrl-C too.
  codes = [EXIT_INTERRUPTED if code == -signal.SIGINT else code for code in codes]
  for code in codes:
    if code in NOT_RESTARTED and code != 0:
      return code
  failures = [code for code in codes if code != 0]
  return failures[0] if failures else 0


if __name__ == "__main__":
  sys.exit(main())
