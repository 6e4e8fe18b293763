"""Config sections beside their keys (config/, no jax), so that validating a config imports no component.

Typed sections (schema.py: a frozen dataclass per section, built strictly once at load by `Config.from_dict`;
`typed` builds one section alone) are handed to their components instead of the ConfigDict.

Checks that are pure functions of the keys: the checkpoint section (its component is Orbax storage), the
monitor section (its component starts a Prometheus server), and the LR warmup against its schedule (checked
at load, where it is known whether the warmup was asked for; the trainer only logs the inherited case).

Each raises a UserError (exit 2) naming the key, the value and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from maxtrain.config.schema import Fleet  # noqa: F401 - sections.Fleet: the straggler monitor's section
from maxtrain.errors import UserError, require

Section = TypeVar("Section")


def typed(cls: type[Section], values: Any, name: str) -> Section:
  """Section `name` of a config (a ConfigDict or a dict) as its frozen dataclass `cls`, every field from its key."""
  return cls.from_dict(values, name)


def checkpoint(ck: Any) -> None:
  """UserError naming the key for a bad `config.checkpoint`."""
  for key in ("every_steps", "max_to_keep", "keep_every"):
    require(ck[key] >= 0, f"config.checkpoint.{key}={ck[key]}: must be >= 0")
  for key in ("s3_connect_timeout_s", "s3_read_timeout_s"):
    require(ck[key] > 0, f"config.checkpoint.{key}={ck[key]}: must be > 0 seconds")
  require(ck.s3_max_attempts >= 1, f"config.checkpoint.s3_max_attempts={ck.s3_max_attempts}: must be >= 1")
  checkpoint_tiers(ck)
  require(ck.resume in ("auto", "never") or ck.resume.isdigit() or "/" in ck.resume or ck.resume.startswith("."),
          f"config.checkpoint.resume={ck.resume!r}: use auto, never, a step number or a checkpoint path")


def checkpoint_tiers(ck: Any, default_dir: str | None = None) -> None:
  """The local tier and the cadence keys; `default_dir`: where checkpoint.dir="" resolves (once known)."""
  for key in ("local_every_steps", "local_max_to_keep", "every_minutes", "max_durable_lag", "preemption_grace_s"):
    require(ck[key] >= 0, f"config.checkpoint.{key}={ck[key]}: must be >= 0")
  require(ck.mtbf_prior_minutes > 0, f"config.checkpoint.mtbf_prior_minutes={ck.mtbf_prior_minutes}: must be > 0")
  require(ck.cadence in ("fixed", "auto"), f"config.checkpoint.cadence={ck.cadence!r}: use fixed or auto")
  if not ck.local_dir:
    return
  require(not ck.local_dir.startswith("s3://") and "://" not in ck.local_dir,
          f"config.checkpoint.local_dir={ck.local_dir}: the local tier is a node-local path, not a URL")
  durable = ck.dir or default_dir
  if durable and "://" not in durable:
    a, b = Path(ck.local_dir).absolute().resolve(), Path(durable).absolute().resolve()
    require(a != b and not a.is_relative_to(b) and not b.is_relative_to(a),
            f"config.checkpoint.local_dir={ck.local_dir} and checkpoint.dir={durable} are the same place (or one is "
            "inside the other): the local tier must be a separate, node-local directory, e.g. "
            "--config.checkpoint.local_dir=/tmp/maxtrain-local")
  require(ck.local_every_steps > 0 or ck.cadence == "auto",
          f"config.checkpoint.local_dir={ck.local_dir} but checkpoint.local_every_steps=0 (and cadence=fixed): the "
          "local tier would never be written; set local_every_steps or cadence=auto")


def monitor(monitor_cfg: Any) -> None:
  """UserError naming the key for a bad `config.monitor`."""
  require(0 <= monitor_cfg.prometheus_port <= 65535,
          f"config.monitor.prometheus_port={monitor_cfg.prometheus_port}: a port is 0..65535 (0 = off)")
  require(bool(monitor_cfg.prometheus_host.strip()),
          "config.monitor.prometheus_host is empty: use 127.0.0.1 (this host only) or 0.0.0.0 (every interface)")


def schedule_steps(cfg: Any) -> int:
  """The length of the LR schedule in the run's steps (RL: rounds): optimizer.decay_steps, or steps."""
  return cfg.optimizer.decay_steps or cfg.steps


def warmup(cfg: Any, *, asked: bool) -> str | None:
  """The LR warmup against the schedule it leads into, in one place. UserError when it runs into wsd's decay,
  or when it was asked for (`asked`: set on the command line) and the schedule never completes it; the text of
  a warning when an inherited warmup is longer than the schedule (legal: every smoke run trains so, the default
  20 > steps=4, but never silent); None when it fits. Assumes the keys are in range (config/ranges.py)."""
  o, steps = cfg.optimizer, schedule_steps(cfg)
  if o.schedule == "wsd":
    decay_start = steps - max(round(o.decay_fraction * steps), 1)
    require(o.warmup_steps <= decay_start,
            f"config.optimizer.warmup_steps={o.warmup_steps} runs into the wsd decay, which starts at step "
            f"steps - round(decay_fraction x steps) = {steps} - round({o.decay_fraction} x {steps}) = {decay_start}. "
            "Shorten the warmup or the decay_fraction.")
  if not 0 < steps < o.warmup_steps:
    return None
  if asked:
    raise UserError(f"config.optimizer.warmup_steps={o.warmup_steps} is longer than the run's LR schedule of "
                    f"{steps} steps (optimizer.decay_steps={o.decay_steps}, steps={cfg.steps}; the schedule is "
                    "decay_steps, or steps when it is 0): the learning rate would never reach optimizer.lr. "
                    "Shorten the warmup or lengthen the run.")
  return (f"optimizer.warmup_steps={o.warmup_steps} > the schedule's {steps} steps (optimizer.decay_steps or steps): "
          "the learning rate never reaches optimizer.lr")
