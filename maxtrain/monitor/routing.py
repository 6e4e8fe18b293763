"""Routing collapse, detected on the host at log steps: a MoE layer whose load entropy (entropy of
its per-expert load / log E, the step's `moe/load_entropy` metric: 1 balanced, 0 everything on one
expert) stays below `model.moe.collapse_entropy` for `model.moe.collapse_steps` steps gets one
`routing_collapse` event and a warning; it can fire again after the layer recovers.

Measured at log steps only (the metrics reach the host there), so "for N steps" means: below at every
log step from the first one below, and that one at least N steps ago.
"""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

from maxtrain.monitor import events as ev

log = logging.getLogger("maxtrain")
METRIC = "moe/load_entropy"


class RoutingMonitor:
  def __init__(self, events: ev.EventLog, threshold: float, steps: int):
    self.events, self.threshold, self.steps = events, threshold, steps
    self.below_since: dict[int, int] = {}  # layer -> first log step of its current run below the threshold
    self.fired: set[int] = set()  # layers reported in their current run below

  def check(self, step: int, metrics: Mapping[str, Sequence[float]]) -> list[int]:
    """Layers (MoE layer indices) newly reported as collapsed at this log step."""
    if METRIC not in metrics or self.steps <= 0:
      return []
    collapsed = []
    for layer, entropy in enumerate(metrics[METRIC]):
      if entropy >= self.threshold:
        self.below_since.pop(layer, None)
        self.fired.discard(layer)
        continue
      since = self.below_since.setdefault(layer, step)
      if step - since >= self.steps and layer not in self.fired:
        self.fired.add(layer)
        collapsed.append(layer)
        self.events.emit(ev.ROUTING_COLLAPSE, step, layer=layer, load_entropy=float(entropy),
                         threshold=self.threshold, since_step=since)
        log.warning("routing collapse in MoE layer %d: load entropy %.3f of log(num_experts) below "
                    "model.moe.collapse_entropy=%.3f since step %d; the router sends most tokens to few "
                    "experts (raise model.moe.aux_loss_weight or bias_update_rate)", layer, entropy,
                    self.threshold, since)
    return collapsed
