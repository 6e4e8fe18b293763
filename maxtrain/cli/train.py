"""Entry point: `python -m maxtrain.train [--config=configs/x.py] [--config.key=value ...]`.

`--help` lists every config key with its value and meaning. Exit codes are the contract in
DESIGN.md (maxtrain/errors.py): 0 finished, 2 bad config or input, 3 stopped by a training policy,
75 preempted (checkpoint saved), 76 hang, 130 interrupted by Ctrl-C before it could save.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Sequence

from maxtrain.cli import shell
from maxtrain.runtime import preemption
from maxtrain.runtime import platform

COMMAND = shell.Command(name="maxtrain", prog="python -m maxtrain.train", log_level=logging.INFO,
                        interrupted="before a checkpoint could be saved: nothing new was saved; run again to resume "
                        "from the newest checkpoint")


def main(argv: Sequence[str] | None = None) -> int:
  t_start = time.monotonic()
  preemption.catch_start_up_interrupt()  # a Ctrl-C before the stop handler is installed is never lost

  def train(invocation: shell.Invocation) -> None:
    cfg = invocation.load_config()
    platform.apply(cfg.runtime)  # XLA_FLAGS and plugin variables count only before the backend starts
    from maxtrain.loop import trainer  # imported late: config errors surface before any backend work

    trainer.run(cfg, t_start)

  return shell.run(COMMAND, train, argv)


if __name__ == "__main__":
  sys.exit(main())
