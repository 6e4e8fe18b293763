"""The in-graph drills (config.faults.nan_at_step, spike_at_step) wrapped around a step from outside, by
the builders (`program/build.py`, `posttrain/rl_step.py`), and only when one of them is set: the default
step has no fault input and no fault ops. The one module of `program/` that names the faults
(tests/test_architecture.py checks it).

A step factory takes `perturb(loss, grads) -> (loss, grads)`, applied where the guarded update starts
(`program/update.py`); the drilled step splits the fault input off its batch and builds the step around
it at trace time (`runtime/faults.py` inject: NaN, or x spike_factor), so the guards see exactly what a
real NaN or spike would give them.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxtrain.config import schema
from maxtrain.runtime import faults

Step = Callable[[Any, dict], tuple[Any, dict]]


def armed(faults_cfg: schema.FaultDrills) -> bool:
  """Whether the run's step carries the fault input (an in-graph drill is set)."""
  return faults.in_graph_armed(faults_cfg)


def wrap_step(faults_cfg: schema.FaultDrills, make_step: Callable[..., Step]) -> Step:
  """`make_step()` as it is, or, with an in-graph drill set, a step whose batch carries the fault input.
  `make_step(perturb=...)` builds the step with the loss and gradients changed before its guards."""
  if not armed(faults_cfg):
    return make_step()

  def drilled_step(state: Any, batch: dict) -> tuple[Any, dict]:
    rows, fault = faults.split(batch)
    return make_step(perturb=lambda loss, grads: faults.inject(fault, loss, grads))(state, rows)

  return drilled_step


def batch_shardings(faults_cfg: schema.FaultDrills, mesh: Mesh, rows: dict[str, NamedSharding]) -> dict[str, NamedSharding]:
  """The train step's batch shardings: the rows', plus the replicated fault input when drilled."""
  return {**rows, faults.INPUT: NamedSharding(mesh, P())} if armed(faults_cfg) else dict(rows)


def abstract_batch(batch_shardings: dict[str, NamedSharding], rows: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.ShapeDtypeStruct]:
  """`rows` plus the fault input's shape when the step takes one (`batch_shardings` has it)."""
  if faults.INPUT not in batch_shardings:
    return rows
  return {**rows, faults.INPUT: jax.ShapeDtypeStruct((2,), np.float32, sharding=batch_shardings[faults.INPUT])}
