"""Loading a config: the family's published model (`model.family`'s defaults), the file (`--config=PATH`,
default configs/default.py) over them, its hardware preset (`hardware.py`, then the file's own `HARDWARE`),
then the `--config.a.b=value` overrides, in order. Validation lives in `maxtrain/program/plan.py`, next to
what it checks."""

from __future__ import annotations

import ast
import functools
import importlib.util
import logging
from pathlib import Path
from typing import Any, Sequence

import ml_collections

from maxtrain.config import hardware, ranges, sections
from maxtrain.config.keys import FAMILY_BASE, base_config, flat_keys, unknown_key
from maxtrain.errors import UserError

log = logging.getLogger("maxtrain")
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.py"
MODELS_DIR = Path(__file__).resolve().parents[1] / "models"


def _check_keys(path: Path, cfg: ml_collections.ConfigDict) -> None:
  """A config file is as strict as the command line: every key it sets is a declared key (a misspelt
  `c.optimizer.lr_peak = ...` would otherwise be ignored), and it declares them all (a bare
  `ConfigDict()` would fail later as an AttributeError deep in the trainer)."""
  declared = base_config()
  known, have = set(flat_keys(declared)), set(flat_keys(cfg))
  for key in sorted(have - known):
    raise unknown_key(key, f"--config={path}: ")
  missing = [k for k in flat_keys(declared) if k not in have]
  if missing:
    # Named by top-level key or section first (a bare ConfigDict lacks whole sections), then the keys.
    sections = list(dict.fromkeys(k.split(".")[0] for k in missing))
    shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
    raise UserError(f"--config={path}: get_config() returned a config without {len(missing)} of the "
                    f"{len(known)} declared keys (in {', '.join(sections)}: {shown}). Start from the declared keys "
                    "and change a few: "
                    "`from maxtrain.config import base_config; c = base_config(); c.steps = ...` (configs/*.py).")


def _parse_value(key: str, text: str, current: Any) -> Any:
  try:
    if isinstance(current, bool):
      low = text.lower()
      if low in ("true", "1", "yes"):
        return True
      if low in ("false", "0", "no"):
        return False
      raise ValueError
    if isinstance(current, int):
      return int(text)
    if isinstance(current, float):
      return float(text)
  except ValueError:
    raise UserError(
        f"config.{key}={text!r}: expected a {type(current).__name__} (current value {current!r})"
    ) from None
  return text


def set_override(cfg: ml_collections.ConfigDict, key: str, text: str) -> None:
  node, *_ = cfg, None
  parts = key.split(".")
  for part in parts[:-1]:
    if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
      raise unknown_key(key)
    node = node[part]
  if parts[-1] not in node or isinstance(node[parts[-1]], ml_collections.ConfigDict):
    raise unknown_key(key)
  node[parts[-1]] = _parse_value(key, text, node[parts[-1]])


@functools.cache
def family_defaults(family: str) -> dict[str, Any]:
  """The `config.model` keys (dotted below model.) of the family's published model: the `DEFAULTS` literal of
  maxtrain/models/<family>.py, which the registry serves as `Family.defaults`, read here without importing it
  (config/ loads without jax and sits below models/; tests/test_families.py checks the two agree). {} for a
  family without (llama: the declared keys are its defaults) and for an unknown name (validation names it)."""
  source = MODELS_DIR / f"{family}.py"
  if not family.isidentifier() or not source.is_file():
    return {}
  for node in ast.parse(source.read_text()).body:
    if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["DEFAULTS"]:
      return ast.literal_eval(node.value)
  return {}


def load_file(path: str | Path, family: str | None = None) -> tuple[ml_collections.ConfigDict, dict[str, dict[str, Any]]]:
  """The config of a preset file and its model-specific hardware presets (`HARDWARE`, may be absent). The file
  starts from the published model of `family` (the command line's model.family), else of the family it sets
  itself (then it runs twice: once to learn it): `base_config()` returns that model's keys while it runs, so
  every key the file sets overrides the family's defaults and every key it leaves is the published one."""
  defaults = family_defaults(family) if family else {}
  cfg, presets = _run_file(Path(path), defaults)
  if family is None and not FAMILY_BASE.get() and family_defaults(cfg.model.family):
    cfg, presets = _run_file(Path(path), family_defaults(cfg.model.family))
  return cfg, presets


def _run_file(path: Path, defaults: dict[str, Any]) -> tuple[ml_collections.ConfigDict, dict[str, dict[str, Any]]]:
  token = FAMILY_BASE.set(defaults) if defaults else None
  try:
    return _exec_file(path)
  finally:
    if token is not None:
      FAMILY_BASE.reset(token)


def _exec_file(path: Path) -> tuple[ml_collections.ConfigDict, dict[str, dict[str, Any]]]:
  if not path.is_file():
    raise UserError(f"--config={path}: no such file. Configs live in {REPO_ROOT / 'configs'}.")
  spec = importlib.util.spec_from_file_location(f"maxtrain_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
      raise UserError(f"--config={path}: the file must define get_config() returning a ConfigDict")
    cfg = module.get_config()
  except UserError:
    raise
  except SystemExit as e:  # sys.exit() in a config file must not end the run with the file's own code
    raise UserError(f"--config={path}: the file called sys.exit({e.code!r}) (SystemExit) while loading. "
                    "A config file must define get_config(), not exit.") from None
  except Exception as e:  # noqa: BLE001 - any error in user code is a bad config, not a crash
    where = f" (line {e.lineno})" if isinstance(e, SyntaxError) else ""
    raise UserError(f"--config={path}: loading it failed{where}: {type(e).__name__}: {e}. Fix the file.") from None
  if not isinstance(cfg, ml_collections.ConfigDict):
    raise UserError(f"--config={path}: get_config() returned {type(cfg).__name__}, not a ConfigDict")
  _check_keys(path, cfg)
  return cfg, getattr(module, "HARDWARE", {})


def apply_hardware(cfg: ml_collections.ConfigDict, name: str, model_presets: dict[str, dict[str, Any]]) -> None:
  """Sets the keys of hardware preset `name` (config/hardware.py, then the config file's HARDWARE);
  `auto` picks the preset of the machine's accelerators (config/hardware.py `detect`)."""
  if name == "auto":
    name, reason = hardware.detect()
    log.info("hardware=auto: %s", reason)
  for key, value in hardware.preset(name, model_presets).items() if name else ():
    set_override(cfg, key, str(value))
  cfg.hardware = name


def parse_args(argv: Sequence[str]) -> tuple[str | Path, list[tuple[str, str]]]:
  """`--config=PATH` (default configs/default.py) and the `--config.a.b=value` overrides, in order."""
  path, overrides = DEFAULT_CONFIG, []
  args = list(argv)
  while args:
    arg = args.pop(0)
    if arg.startswith("--config.") or arg.startswith("--config="):
      name, eq, value = arg[2:].partition("=")
      if not eq:
        if not args:
          raise UserError(f"{arg}: missing value (use {arg}=VALUE)")
        value = args.pop(0)
    elif arg == "--config":
      if not args:
        raise UserError("--config: missing path")
      name, value = "config", args.pop(0)
    else:
      raise UserError(f"unexpected argument {arg!r}: use --config=PATH and --config.KEY=VALUE (--help lists the keys)")
    if name == "config":
      path = value
    else:
      overrides.append((name[len("config."):], value))
  return path, overrides


def load(argv: Sequence[str]) -> ml_collections.ConfigDict:
  """The config file, its hardware preset (`hardware`, from the file or the command line), then the
  `--config.a.b=value` overrides, in order; locked."""
  path, overrides = parse_args(argv)
  # model.family on the command line: the file starts from that family's published model (the last one wins)
  cfg, model_presets = load_file(path, next((v for k, v in reversed(overrides) if k == "model.family"), None))
  # The hardware preset goes first so that every explicit --config.* override wins over it.
  apply_hardware(cfg, next((v for k, v in reversed(overrides) if k == "hardware"), cfg.hardware), model_presets)
  for key, value in overrides:
    if key != "hardware":
      set_override(cfg, key, value)
  ranges.check(cfg)  # before the warmup check, which compares numbers it assumes are in range
  # An inherited warmup longer than the run is legal (the trainer warns); one asked for here is a mistake.
  sections.warmup(cfg, asked="optimizer.warmup_steps" in {key for key, _ in overrides})
  # Checked at load, not in plan.validate: the supervisor writes its events there before any trainer runs.
  if not str(cfg.output_dir).strip():
    raise UserError(f"config.output_dir={cfg.output_dir!r}: empty, which would write the run into the current "
                    "directory. Name a directory, e.g. --config.output_dir=runs/my-run")
  cfg.lock()
  return cfg
