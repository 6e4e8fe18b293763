"""The drills off the production path: the default step has no fault input and no fault ops (its jaxpr
against a drilled one's), a drilled step fed "nothing injected" is bitwise the default step, and the
host-side drills are observers the loop calls (`loop/drills.py`), registered only in one place.
The drills' end-to-end behaviour (NaN, spike, kill, hang, corrupt checkpoint ...) is tested where the
guards, rollbacks, tiers and supervisor are (test_guards, test_tiers, test_supervisor, ...)."""

import functools
import json

import jax
import jax.extend.core as jcore
import numpy as np
import pytest

from maxtrain import config as config_lib
from maxtrain.data import pipeline
from maxtrain.loop import drills as loop_drills
from maxtrain.loop.observers import Observers
from maxtrain.program import build, state as state_lib
from maxtrain.runtime import faults
from tiny import TINY_MODEL

DRILL = ["--config.faults.spike_at_step=5"]  # any in-graph drill: the step takes the fault input


@functools.lru_cache(maxsize=None)
def program(*extra: str) -> build.Program:
  cfg = config_lib.load(TINY_MODEL + ["--config.mesh.fsdp=1", *extra])
  return build.program_for(cfg, jax.devices()[:1], require_data=False)


def jaxpr_of(p: build.Program) -> jcore.ClosedJaxpr:
  with jax.set_mesh(p.mesh):
    return jax.make_jaxpr(p.train_step)(p.abstract_state(), p.abstract_batch())


def count_eqns(jaxpr: jcore.Jaxpr) -> int:
  """Equations, those of every sub-jaxpr (the jit, scans, custom vjps) included."""
  n = 0
  for eqn in jaxpr.eqns:
    n += 1
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        if isinstance(sub, jcore.ClosedJaxpr):
          n += count_eqns(sub.jaxpr)
        elif isinstance(sub, jcore.Jaxpr):
          n += count_eqns(sub)
  return n


def test_the_default_step_has_no_fault_input_and_no_fault_ops():
  default, drilled = program(), program(*DRILL)
  assert set(default.abstract_batch()) == set(pipeline.KEYS)
  assert set(drilled.abstract_batch()) == set(pipeline.KEYS) | {faults.INPUT}
  plain, wrapped = jaxpr_of(default), jaxpr_of(drilled)
  # The drilled step's operands are the default's plus one f32[2]: the fault input, and only there.
  avals = lambda j: [(v.aval.shape, str(v.aval.dtype)) for v in j.jaxpr.invars]
  extra = list(avals(wrapped))
  for aval in avals(plain):
    extra.remove(aval)
  assert extra == [((2,), "float32")]
  assert len(plain.jaxpr.invars) == len(jax.tree.leaves(default.abstract_state())) + len(pipeline.KEYS)
  # The injection (a NaN or a scale applied to the loss and every gradient) is in the drilled step only.
  num_grads = len(jax.tree.leaves(default.abstract_state().params))
  assert count_eqns(wrapped.jaxpr) - count_eqns(plain.jaxpr) >= num_grads + 1


@pytest.mark.parametrize("fault", [faults.NONE, (1.0, 1.0)], ids=["nothing", "nan"])
def test_a_drilled_step_without_a_fault_is_the_default_step(fault):
  """Fed (not NaN, x 1), the drilled step is bitwise the production step; fed NaN, its guards skip the update."""
  default, drilled = program(), program(*DRILL)
  rng = np.random.default_rng(0)
  shapes = default.abstract_batch()
  rows = {k: np.asarray(rng.integers(1, 2 if k == "segment_ids" else 200, a.shape), a.dtype) for k, a in shapes.items()}
  out = {}
  for name, p in (("default", default), ("drilled", drilled)):
    with jax.set_mesh(p.mesh):
      batch = {k: jax.device_put(v, shapes[k].sharding) for k, v in rows.items()}
      if name == "drilled":
        batch = faults.attach(batch, fault, faults.replicated(batch))
      state, metrics = p.train_step(state_lib.initialize(p.state, p.mesh), batch)
      out[name] = jax.device_get((state.params, metrics))
  (params, metrics), (drilled_params, drilled_metrics) = out["default"], out["drilled"]
  if fault == faults.NONE:
    assert float(drilled_metrics["loss"]) == float(metrics["loss"])
    jax.tree.map(np.testing.assert_array_equal, drilled_params, params)
  else:
    assert int(drilled_metrics["nonfinite"]) == 1 and int(metrics["nonfinite"]) == 0
    initial = jax.device_get(state_lib.initialize(drilled.state, drilled.mesh).params)
    jax.tree.map(np.testing.assert_array_equal, drilled_params, initial)


def test_host_drills_are_observers_of_the_loop(tmp_path):
  """Without an in-graph drill no observer touches the batch; with one, every batch gets its step's input;
  the step events reach the drills (the record of what fired) through the observers alone."""
  inputs = program().abstract_batch()["inputs"]  # rows on a mesh, as the loaders place them
  batch = {"inputs": jax.device_put(np.zeros(inputs.shape, inputs.dtype), inputs.sharding)}
  quiet = Observers()
  loop_drills.install(quiet, config_lib.load([]).faults, tmp_path / "a", 0, settle=lambda: None)
  assert quiet.batch(3, batch) is batch and quiet.publish(1)
  cfg = config_lib.load(["--config.faults.nan_at_step=3", "--config.faults.publish_stall_at_step=2"])
  (tmp_path / "b").mkdir()
  observers = Observers()
  loop_drills.install(observers, cfg.faults, tmp_path / "b", 0, settle=lambda: None)
  assert np.asarray(observers.batch(2, batch)[faults.INPUT]).tolist() == list(faults.NONE)
  assert np.asarray(observers.batch(3, batch)[faults.INPUT]).tolist() == [1.0, 1.0]
  observers.step_ran(3)  # the NaN step ran: fired, recorded, and a redone step 3 is clean
  assert np.asarray(observers.batch(3, batch)[faults.INPUT]).tolist() == list(faults.NONE)
  assert observers.publish(1) and not observers.publish(2) and observers.publish(2)  # the stall fires once
  fired = json.loads((tmp_path / "b" / "faults_fired.json").read_text())
  assert fired == ["nan_at_step", "publish_stall_at_step"]
  with pytest.raises(ValueError, match="unknown loop event"):
    observers.on("step_finished", lambda step: None)
