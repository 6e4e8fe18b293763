"""The training loop's one metrics logger: TensorBoard, Prometheus, throughput and MFU, memory, the
console line, and the `steps` records of the event log (`events.StepsSummary`).

Every scalar the step returns is logged as `train/<name>`: new metrics need no change here. A
per-layer metric (a 1-D array, e.g. `moe/load_entropy`) is logged as `train/<name>/layer_<i>`, a per-layer and
expert one (2-D, `moe/expert_load`) as `train/<name>/layer_<i>/expert_<j>`, to TensorBoard only.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

import jax

from maxtrain.monitor import events as ev
from maxtrain.monitor import memory, mfu as mfu_lib, prometheus
from maxtrain.monitor.tensorboard import MetricWriter

log = logging.getLogger("maxtrain")


def scalar_tags(metrics: Mapping[str, Any]) -> dict[str, float]:
  """`train/<name>` -> value of each metric; per-layer arrays become `train/<name>/layer_<i>`; [layer, expert]
  tables are left to `table_tags`."""
  scalars = {}
  for k, v in metrics.items():
    if getattr(v, "ndim", 0) == 1:
      scalars.update({f"train/{k}/layer_{i}": x for i, x in enumerate(v)})
    elif getattr(v, "ndim", 0) == 2:  # per layer and expert: TensorBoard only (`table_tags`)
      continue
    else:
      scalars[f"train/{k}"] = v
  return scalars


def table_tags(metrics: Mapping[str, Any]) -> dict[str, float]:
  """`train/<name>/layer_<i>/expert_<j>` of each 2-D metric (moe/expert_load): for TensorBoard only, since a
  large MoE has thousands (DeepSeek-V3: 58 x 256), past Prometheus's series cap, which would drop the rest."""
  return {f"train/{k}/layer_{i}/expert_{j}": x for k, v in metrics.items() if getattr(v, "ndim", 0) == 2
          for i, row in enumerate(v) for j, x in enumerate(row)}


class MetricsLogger:
  def __init__(self, out_dir: Path, events: ev.EventLog, *, total_steps: int, tokens_per_step: int,
               flops_per_token: float, peak_flops: float, prometheus_port: int = 0, prometheus_host: str = "127.0.0.1",
               peak_contended: bool = False):
    self.events = events
    self.total_steps = total_steps
    self.tokens_per_step = tokens_per_step
    self.flops_per_token = flops_per_token
    self.peak_flops = peak_flops
    self.peak_contended = peak_contended  # the CPU peak rests on contended measurements only: MFU reads high
    self.prometheus = prometheus.start(prometheus_port, out_dir.name, jax.process_index(), prometheus_host)
    self.writer = MetricWriter(out_dir / "tensorboard")
    self.gauge_sinks: list = []  # what gets the Prometheus gauges too (monitor/otel.py)
    self.summary: ev.StepsSummary | None = None  # from the attempt's first step on

  def first_step(self, step: int, metrics: Any, t_process_start: float) -> None:
    """The attempt's first step (mostly compilation) is done: timed intervals start after it."""
    jax.block_until_ready(metrics)
    self.events.emit(ev.FIRST_STEP, step)
    self.summary = ev.StepsSummary(self.events, step)
    log.info("first step (%d) done %.1fs after process start", step, time.monotonic() - t_process_start)

  def data_wait(self, seconds: float) -> None:
    if self.summary is not None:
      self.summary.add_data_wait(seconds)

  def restart_interval(self, step: int) -> None:
    """After a rollback: the steps interval starts again at `step`."""
    if self.summary is not None:
      self.summary.reset(step)

  def outside(self, step: int) -> contextlib.AbstractContextManager:
    """Time inside (eval, checkpoint) is not step time."""
    return self.summary.outside(step) if self.summary is not None else contextlib.nullcontext()

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    self.writer.scalars(step, values)

  def text(self, tag: str, value: str) -> None:
    self.writer.text(tag, value)

  def train(self, step: int, metrics: Mapping[str, Any], fleet: Mapping[str, float] | None = None) -> dict:
    """A log step: the step's metrics, speed, MFU and memory, the fleet's straggler scalars (process
    0); then the steps record. Returns the metrics on the host."""
    metrics = jax.device_get(metrics)  # note: a host-device sync point, once per log interval
    scalars = scalar_tags(metrics)
    scalars.update(fleet or {})
    pending = self.summary.pending(step) if self.summary is not None else None
    speed = ""
    if pending is not None:  # None at the attempt's first step, whose time is mostly compilation
      seconds, count, data_wait_s = pending
      step_time = seconds / count
      tokens_per_s = self.tokens_per_step / step_time
      scalars.update({"train/step_time_s": step_time, "train/tokens_per_s": tokens_per_s,
                      "train/data_wait_s": data_wait_s / count})
      speed = f"  {step_time:.3f}s/step  {tokens_per_s:.0f} tok/s"
      mfu = mfu_lib.mfu(tokens_per_s, self.flops_per_token, jax.device_count(), self.peak_flops)
      if mfu is not None:
        scalars["train/mfu"] = mfu
        speed += f"  MFU {mfu:.1%}" + (" (vs a contended peak: reads high)" if self.peak_contended else "")
    scalars.update(memory.memory_scalars())
    self.writer.scalars(step, {**scalars, **table_tags(metrics)})
    if self.prometheus is not None:
      self.prometheus.update(scalars)
    for sink in self.gauge_sinks:
      sink.update(scalars)
    moe = ""
    if "moe/aux_loss" in metrics:
      moe = (f"  moe aux {metrics['moe/aux_loss']:.3f} dropped {metrics['moe/dropped_fraction']:.1%} "
             f"max/mean load {max(metrics['moe/max_load']):.2f} "
             f"dropless capacity {max(metrics['moe/capacity_needed']):.2f}")
    log.info("step %d/%d  loss %.4f  grad_norm %.3f  lr %.2e%s%s", step, self.total_steps, metrics["loss"],
             metrics["grad_norm"], metrics["lr"], moe, speed)
    # Flushed after the logging above, so that its time is inside the steps interval (the loop's
    # own cost) rather than a gap the goodput report could only call `other`.
    if self.summary is not None:
      self.summary.flush(step)
    return metrics

  @contextlib.contextmanager
  def eval(self, step: int) -> Iterator[dict]:
    """Times an evaluation (outside step time); the body sets `result["loss"]`."""
    result: dict[str, float] = {}
    with self.outside(step):
      t0 = time.monotonic()
      yield result
      self.events.emit(ev.EVAL, step, seconds=time.monotonic() - t0, loss=result["loss"])
    self.writer.scalars(step, {"eval/loss": result["loss"]})
    log.info("step %d  eval loss %.4f", step, result["loss"])

  def close(self) -> None:
    self.writer.close()
    if self.prometheus is not None:
      self.prometheus.close()
