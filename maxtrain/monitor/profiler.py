"""Captures a `jax.profiler` trace of a few steps into the TensorBoard log dir.

The trace lands in `<logdir>/plugins/profile/<run>/<host>.xplane.pb`, where TensorBoard's profile
plugin (`pip install tensorboard-plugin-profile`, then `tensorboard --logdir <output_dir>/tensorboard`,
tab PROFILE) finds it. Config: `profile.start_step` (-1 = off), `profile.num_steps`.

Steps are numbered as the loop's `step` before running one: the step that starts from `step`
optimizer steps completed. Compilation should happen before `start_step` (the trainer compiles ahead
of the loop), or the trace is mostly compiler time.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import jax

log = logging.getLogger("maxtrain")


class Profiler:
  def __init__(self, logdir: str | os.PathLike, start_step: int = -1, num_steps: int = 3):
    self.logdir = str(logdir)
    self.start_step = start_step
    self.stop_step = start_step + max(num_steps, 1) - 1  # Last step inside the trace.
    self.active = False
    self.done = start_step < 0

  def maybe_start(self, step: int) -> None:
    """Call before dispatching step `step`: starts the trace at `start_step` (or at the first step
    after it, when the run resumed past it with steps still left to capture)."""
    if self.done or self.active or not self.start_step <= step <= self.stop_step:
      return
    jax.profiler.start_trace(self.logdir)
    self.active = True
    log.info("profiler: tracing steps %d..%d into %s", step, self.stop_step, self.logdir)

  def step_annotation(self, step: int) -> contextlib.AbstractContextManager:
    """Wrap the dispatch of a step in this: the profile plugin's step-time view keys on it."""
    if self.active:
      return jax.profiler.StepTraceAnnotation("train", step_num=step)
    return contextlib.nullcontext()

  def maybe_stop(self, step: int, outputs: Any = None) -> None:
    """Call after dispatching step `step` with its outputs: at the last traced step, waits for them
    (dispatch is asynchronous; the device work must land inside the trace) and writes the trace."""
    if self.active and step >= self.stop_step:
      if outputs is not None:
        jax.block_until_ready(outputs)
      self.stop()

  def stop(self) -> None:
    """Ends a running trace (also for a loop that ends or fails early); safe to call any time."""
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
      self.done = True
      log.info("profiler: trace written under %s/plugins/profile", self.logdir)


# Trace events that are not one XLA op: the executor's whole-program spans, waits and Python frames.
_NOT_OPS = ("ThunkExecutor", "SlinkyThreadPool", "$")


def top_ops(trace_dir: str | os.PathLike, steps: int, n: int = 25) -> list[tuple[str, float, float]]:
  """The `n` XLA ops that took the most time in a `jax.profiler` trace of `steps` steps taken with
  `create_perfetto_trace=True`: (op name as in the compiled HLO, ms per step, runs per step), summed
  over threads. On XLA:CPU each fusion, dot or copy is one event (`hlo_op_lines` finds it in the
  compiled HLO); a `while` (a scan) spans its body, whose ops are also listed on their own."""
  import collections
  import glob
  import gzip
  import json

  files = glob.glob(os.path.join(str(trace_dir), "**", "*.trace.json.gz"), recursive=True)
  if not files:
    raise FileNotFoundError(f"no perfetto trace (*.trace.json.gz) under {trace_dir}")
  with gzip.open(max(files, key=os.path.getmtime)) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  total, count = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and not e["name"].startswith(_NOT_OPS):
      total[e["name"]] += e.get("dur", 0.0)
      count[e["name"]] += 1
  return [(name, us / 1e3 / steps, count[name] / steps) for name, us in total.most_common(n)]


def hlo_op_lines(hlo_text: str, names: list[str]) -> dict[str, str]:
  """name -> "shape <- jax op" for ops of the compiled HLO text: what a `top_ops` name computes."""
  import re

  wanted, found = set(names), {}
  for line in hlo_text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+)", line)
    if m and m.group(1) in wanted and m.group(1) not in found:
      source = re.search(r'op_name="([^"]*)"', line)
      found[m.group(1)] = m.group(2) + (" <- " + source.group(1).split("/")[-1] if source else "")
  return found
