"""Evaluate one checkpoint on lm-eval tasks: the shipped tasks (maxtrain/evaluation/tasks) plus any
`--include-path`, task names checked before the model is loaded, lm-eval's results JSON written
atomically, each `results.<task>.<metric>` also a TensorBoard scalar `eval/<task>/<metric>`."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

from maxtrain.errors import UserError

TASKS_DIR = Path(__file__).resolve().parent / "tasks"


def task_manager(include_path: str | None = None, key: str = "--include-path") -> Any:
  from lm_eval.tasks import TaskManager

  paths = [str(TASKS_DIR)]
  if include_path:
    if not Path(include_path).is_dir():
      raise UserError(f"{key}={include_path}: no such directory (a folder of lm-eval task YAML files)")
    paths.append(str(include_path))
  return TaskManager(include_path=paths, include_defaults=False)


def check_tasks(names: Sequence[str], manager: Any, key: str = "--tasks") -> list[str]:
  """The task names, each one lm-eval knows from the include paths; UserError naming the first unknown."""
  names = [n.strip() for n in names if n.strip()]
  if not names:
    raise UserError(f"{key} is empty: give comma-separated lm-eval task names, e.g. --tasks=pycode_mc")
  known = set(manager.all_tasks)
  for name in names:
    if name not in known:
      raise UserError(f"{key}: unknown task {name!r}; the known tasks are {sorted(known)[:12]} (add your own "
                      "YAML tasks with an include path)")
  check_data_files(names, manager, key)
  return names


def _data_files(value: Any) -> list[str]:
  """The paths of a `dataset_kwargs.data_files` (a path, a list, or a split -> path(s) mapping)."""
  if isinstance(value, str):
    return [value]
  if isinstance(value, dict):
    return [p for v in value.values() for p in _data_files(v)]
  if isinstance(value, (list, tuple)):
    return [p for v in value for p in _data_files(v)]
  return []


def check_data_files(names: Sequence[str], manager: Any, key: str = "--tasks") -> None:
  """UserError naming the task, its YAML and the file when a task's local `dataset_kwargs.data_files`
  does not exist (before the model loads, instead of a `datasets` traceback after). Relative paths are
  relative to the current directory, as `datasets.load_dataset` reads them."""
  import glob

  from lm_eval.tasks._yaml_loader import load_yaml

  for name in names:
    entry = manager.task_index.get(name)
    yaml_path = getattr(entry, "yaml_path", None)
    if not yaml_path:
      continue  # a group or a tag: its tasks are checked by lm-eval as they load
    try:
      config = load_yaml(yaml_path, resolve_func=False, recursive=True)
    except Exception as e:  # noqa: BLE001 - a task file that does not parse is bad input
      raise UserError(f"{key}: task {name!r}: its file {yaml_path} does not load ({type(e).__name__}: {e})") from None
    kwargs = config.get("dataset_kwargs") or {}
    for path in _data_files(kwargs.get("data_files") if isinstance(kwargs, dict) else None):
      if "://" in path:
        continue  # a URL: datasets downloads it (or says why not)
      found = glob.glob(path) if glob.has_magic(path) else [path] if Path(path).is_file() else []
      if not found:
        raise UserError(f"{key}: task {name!r} ({yaml_path}): dataset_kwargs.data_files {path!r} does not exist "
                        f"(relative paths are read from the current directory, {Path.cwd()}): fix the path in the "
                        "task's YAML, or give an absolute one")


def scalars(results: dict) -> dict[str, float]:
  """`eval/<task>/<metric>` for every finite number in lm-eval's `results` (the metric's ',none' filter
  suffix dropped)."""
  out = {}
  for task, metrics in results.get("results", {}).items():
    for key, value in metrics.items():
      if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        out[f"eval/{task}/{key.replace(',none', '')}"] = float(value)
  return out


def write_json(path: Path, payload: dict) -> None:
  """Atomic: a reader sees the old file or the whole new one."""
  from lm_eval.utils import handle_non_serializable

  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  try:
    tmp.write_text(json.dumps(payload, indent=2, default=handle_non_serializable))
    with open(tmp, "rb") as f:
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)  # only left when the rename did not happen: never leave it behind


def check_output(text: str, key: str = "--output") -> Path:
  """The results file's path; UserError, before any evaluation, when `text` cannot become it: a folder
  (or a name ending in /), under a regular file, or in a folder that cannot be written."""
  path = Path(text)
  if text.endswith(os.sep) or path.is_dir():
    raise UserError(f"{key}={text}: a folder; give the results file's path, e.g. {key}={path / 'results.json'}")
  parent = path.absolute().parent
  while not parent.exists():
    parent = parent.parent
  if not parent.is_dir():
    raise UserError(f"{key}={text}: {parent} is a file, not a folder: choose another path for the results")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise UserError(f"{key}={text}: {parent} is not writable: choose another path for the results")
  return path


def evaluate(lm: Any, names: Sequence[str], manager: Any, *, log_samples: bool = False) -> dict:
  """lm-eval's `simple_evaluate` over `lm`; the results dict without its environment dump."""
  import lm_eval

  results = lm_eval.simple_evaluate(model=lm, tasks=list(names), task_manager=manager, log_samples=log_samples,
                                    bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                    fewshot_random_seed=0)
  return {k: v for k, v in results.items() if k in ("results", "configs", "versions", "n-shot", "higher_is_better",
                                                    "n-samples", "samples")}


def load_lm(checkpoint: str, overrides: Sequence[str] = (), batch_size: int = 8,
            after_batch: Any = None) -> tuple[Any, Any]:
  """(MaxtrainLM, source) for the checkpoint, on the mesh its run trained on; `after_batch`: MaxtrainLM's."""
  # lm-eval (an optional extra) and jax once a checkpoint is evaluated: `maxtrain.eval --help` needs neither
  from maxtrain.evaluation.lm import MaxtrainLM
  from maxtrain.inference import sampling

  generator, tokenizer, source = sampling.load(checkpoint, overrides=overrides)
  vocab_limit = min(source.vocab_size, generator.cfg.vocab_size)
  return MaxtrainLM(generator, tokenizer, vocab_limit, batch_size, after_batch), source
