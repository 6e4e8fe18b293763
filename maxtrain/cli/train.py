"""Entry point: `python -m maxtrain.train [--config=configs/x.py] [--config.key=value ...]`.

`--help` lists every config key with its value and meaning. Exit codes are the contract in
DESIGN.md (maxtrain/errors.py): 0 finished, 2 bad config or input, 3 stopped by a training policy,
75 preempted (checkpoint saved), 130 interrupted by Ctrl-C before it could save.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from typing import Sequence

from maxtrain import config as config_lib
from maxtrain.errors import (EXIT_ABORTED, EXIT_BAD_INPUT, EXIT_CRASH, EXIT_HANG, EXIT_INTERRUPTED, EXIT_PREEMPTED,
                             Aborted, Preempted, Stalled, UserCodeExit, UserError)
from maxtrain.runtime import preemption


def main(argv: Sequence[str] | None = None) -> int:
  t_start = time.monotonic()
  preemption.catch_start_up_interrupt()  # a Ctrl-C before the stop handler is installed is never lost
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                      datefmt="%H:%M:%S")
  logging.getLogger("maxtrain").setLevel(logging.INFO)
  # Orbax logs every save step at INFO through absl (~20 lines per checkpoint); keep its warnings.
  logging.getLogger("absl").setLevel(logging.WARNING)
  argv = sys.argv[1:] if argv is None else argv
  try:
    if "--help" in argv or "-h" in argv:
      print(config_lib.help_text(argv, "maxtrain.train"))
      return 0
    cfg = config_lib.load(argv)
    from maxtrain.runtime import platform

    platform.apply(cfg.runtime)  # XLA_FLAGS and plugin variables count only before the backend starts
    from maxtrain.loop import trainer  # imported late: config errors surface before any backend work

    trainer.run(cfg, t_start)
  except UserError as e:
    print(f"maxtrain: error: {e}", file=sys.stderr)
    return EXIT_BAD_INPUT
  except Preempted as e:
    print(f"maxtrain: {e}", file=sys.stderr)
    return EXIT_PREEMPTED
  except Aborted as e:
    print(f"maxtrain: aborted: {e}", file=sys.stderr)
    return EXIT_ABORTED
  except Stalled as e:  # the async RL rollout side or its weight publish hung: restartable like a hang
    print(f"maxtrain: hang: {e}", file=sys.stderr)
    return EXIT_HANG
  except UserCodeExit as e:  # a reward's sys.exit: a crash (restarted), never a finish; named, no traceback
    print(f"maxtrain: crash: {e}", file=sys.stderr)
    return EXIT_CRASH
  except KeyboardInterrupt:  # SIGINT before the stop handler is installed (start-up), or a second Ctrl-C
    # Exiting already: a further SIGINT (a terminal's Ctrl-C reaches the supervisor too, which forwards it)
    # must not interrupt the interpreter's shutdown with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print("maxtrain: interrupted (Ctrl-C) before a checkpoint could be saved: nothing new was saved; "
          "run again to resume from the newest checkpoint", file=sys.stderr)
    return EXIT_INTERRUPTED
  return 0


if __name__ == "__main__":
  sys.exit(main())
