"""TensorBoard scalars, written by process 0 only (tensorboardX: no TensorFlow needed)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Mapping

import jax


def _summary_writer_class() -> type:
  """tensorboardX.SummaryWriter, imported with torch hidden unless torch is loaded already: tensorboardX
  imports torch when it is installed only to accept torch tensors (maxtrain writes floats), which cost
  every trainer start seconds (52 s against 4.7 s for the import on the loaded 2-core machine)."""
  if "torch" in sys.modules:
    from tensorboardX import SummaryWriter
    return SummaryWriter
  sys.modules["torch"] = None  # `import torch` raises ImportError: tensorboardX falls back to numpy
  try:
    from tensorboardX import SummaryWriter
  finally:
    del sys.modules["torch"]
  return SummaryWriter


class MetricWriter:
  def __init__(self, logdir: str | Path):
    self._writer = None
    self.sinks: list = []  # trackers that get every scalar and text too (monitor/tracking.py)
    if jax.process_index() == 0:
      self._writer = _summary_writer_class()(str(logdir), flush_secs=30)

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    if self._writer is not None:
      for name, value in values.items():
        self._writer.add_scalar(name, float(value), step)
      for sink in self.sinks:
        sink.scalars(step, values)

  def text(self, tag: str, value: str, step: int = 0) -> None:
    if self._writer is not None:
      self._writer.add_text(tag, value, step)
      for sink in self.sinks:
        sink.text(tag, value, step)

  def flush(self) -> None:
    if self._writer is not None:
      self._writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None
