"""lm-eval tasks inside the trainer (`eval.tasks`, run with each validation eval: every
`eval.every_steps` and at the end), on the training mesh with the live parameters: the same
`MaxtrainLM` as `python -m maxtrain.eval`, built over the training model once (its jitted scoring
compiled at the first eval), no checkpoint read and no server. A task that fails is an
`eval_task_failed` event and a warning, never a dead run. Off (lm-eval not imported) when `eval.tasks` is "".
"""

from __future__ import annotations

import logging
import time
from typing import Any

from maxtrain.data.tokenizer import load_tokenizer
from maxtrain.evaluation import run
from maxtrain.inference import sampling

log = logging.getLogger("maxtrain")
TASKS_DONE = "eval_tasks"  # In-loop lm-eval tasks finished at `step`: seconds, scalars.
TASK_FAILED = "eval_task_failed"  # One in-loop lm-eval task raised at `step`: task, error (the run goes on).


class TaskEval:
  def __init__(self, cfg: Any, program: Any, events: Any, metrics: Any):
    self.names = [n.strip() for n in cfg.eval.tasks.split(",") if n.strip()]
    self.program, self.events, self.metrics, self.cfg = program, events, metrics, cfg
    self.lm: Any = None
    if self.names:  # checked now, before compiling: an unknown task is exit 2, not a failure at step N
      self.manager = run.task_manager(cfg.eval.tasks_include_path or None, key="config.eval.tasks_include_path")
      run.check_tasks(self.names, self.manager, key="config.eval.tasks")

  def _lm(self, params: Any) -> Any:
    if self.lm is None:
      from maxtrain.evaluation.lm import MaxtrainLM  # imports lm-eval (an optional extra): only with eval.tasks

      generator = sampling.for_program(self.program, params)
      tokenizer = load_tokenizer(self.cfg.data.tokenizer)
      self.lm = MaxtrainLM(generator, tokenizer, min(tokenizer.vocab_size, generator.cfg.vocab_size))
    self.lm.generator.params = params
    return self.lm

  def run(self, params: Any, step: int) -> None:
    """Each task at `step` (its scalars `eval/<task>/<metric>`); a failing task is reported, skipped."""
    if not self.names:
      return
    lm, scalars, t0 = self._lm(params), {}, time.monotonic()
    try:
      for name in self.names:
        try:
          scalars.update(run.scalars(run.evaluate(lm, [name], self.manager)))
        except Exception as e:  # a task's own bug or data: the run is worth more than one eval
          self.events.emit(TASK_FAILED, step, task=name, error=f"{type(e).__name__}: {e}"[:1000])
          log.warning("step %d: eval task %s failed (%s: %s); training goes on", step, name, type(e).__name__, e)
    finally:
      lm.generator.params = None  # the next step donates these buffers
    self.metrics.scalars(step, scalars)
    self.events.emit(TASKS_DONE, step, seconds=time.monotonic() - t0, scalars=scalars)
