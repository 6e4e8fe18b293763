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
  return names


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
  tmp.write_text(json.dumps(payload, indent=2, default=handle_non_serializable))
  with open(tmp, "rb") as f:
    os.fsync(f.fileno())
  os.replace(tmp, path)


def evaluate(lm: Any, names: Sequence[str], manager: Any, *, log_samples: bool = False) -> dict:
  """lm-eval's `simple_evaluate` over `lm`; the results dict without its environment dump."""
  import lm_eval

  results = lm_eval.simple_evaluate(model=lm, tasks=list(names), task_manager=manager, log_samples=log_samples,
                                    bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                    fewshot_random_seed=0)
  return {k: v for k, v in results.items() if k in ("results", "configs", "versions", "n-shot", "higher_is_better",
                                                    "n-samples", "samples")}


def load_lm(checkpoint: str, overrides: Sequence[str] = (), batch_size: int = 8) -> tuple[Any, Any]:
  """(MaxtrainLM, source) for the checkpoint, on the mesh its run trained on."""
  from maxtrain.evaluation.lm import MaxtrainLM
  from maxtrain.inference import sampling

  generator, tokenizer, source = sampling.load(checkpoint, overrides=overrides)
  vocab_limit = min(source.vocab_size, generator.cfg.vocab_size)
  return MaxtrainLM(generator, tokenizer, vocab_limit, batch_size), source
