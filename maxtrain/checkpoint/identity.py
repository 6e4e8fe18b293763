"""What a checkpoint says about the run that made it (DESIGN rule 1: resumable state carries the identity of what
made it). `RunIdentity` is what changes while a run goes on (the tokenizer of its stores, known once the data is
open; its rollbacks so far): the loop passes it, a value, to every save, which writes it into the step's meta.
`local_identity` is which run a local step belongs to (fixed at start-up: its directories and the hash of the
config sections that shape its state)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from maxtrain import config as config_lib
from maxtrain.monitor import events as ev

# Config keys a restarted run may change and still be the same run (its length, where it logs, its process layout,
# monitoring, drills, the checkpoint keys themselves); every other section (seed, model, data, optimizer, guards,
# post-training, pipeline) is hashed into a local step's identity.
_NOT_IDENTITY = frozenset({"hardware", "steps", "output_dir", "log_every", "mesh", "checkpoint", "runtime", "mfu",
                           "profile", "monitor", "tracking", "faults", "watchdog", "fleet", "eval"})


@dataclasses.dataclass(frozen=True)
class RunIdentity:
  tokenizer_identity: str | None = None  # of the run's token stores (loop/data.py); checked again at resume
  rollbacks: int = 0  # the run's rollbacks so far (loop/rollback.py keeps the count): the budget survives restarts

  def meta(self) -> dict[str, Any]:
    """The fields every checkpoint's meta carries."""
    return {"rollbacks": self.rollbacks, "tokenizer_identity": self.tokenizer_identity}


def local_identity(cfg: Any, output_dir: Path, location: str) -> dict[str, str]:
  """Which run a local step belongs to: its output and checkpoint dirs, and a hash of the config sections that
  shape its state (a run restarted as it was keeps it; its length, the process layout, monitoring and drills may
  change)."""
  redacted = config_lib.redacted(cfg)
  shaping = {k: v for k, v in redacted.items() if k not in _NOT_IDENTITY}
  return {"output_dir": str(Path(output_dir).absolute().resolve()),
          "checkpoint_dir": location if "://" in location else str(Path(location).absolute().resolve()),
          "config_hash": ev.config_hash(shaping)}


def run_meta(cfg: Any, mesh_shape: dict, identity: RunIdentity | None = None) -> dict[str, Any]:
  """What a save says about the run (a tier adds what it knows of the state): its resolved config (secrets
  redacted), its mesh, and its identity's fields."""
  return {"config": config_lib.redacted(cfg), "mesh": mesh_shape, **(identity.meta() if identity is not None else {})}
