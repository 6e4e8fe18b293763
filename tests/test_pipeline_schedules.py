"""Pipeline schedules (maxtrain/sharding/schedules.py): the host tables' idle slots equal each schedule's bubble
formula and 1F1B keeps O(S) stage inputs where gpipe keeps all M; 1F1B's hand-written backward gives gpipe's
gradient (tensor and data parallel inside the stages, gradient accumulation); settings not built are refused before compiling. Training 20 steps like
the model without a pipeline, and resuming bitwise: tests/test_pipeline_parallel.py (`pipeline4xfsdp2_1f1b`)."""

import re

import jax
import numpy as np
import pytest

from maxtrain.config import loader as config_lib
from maxtrain.errors import UserError
from maxtrain.program import build as build_lib
from maxtrain.program import state as state_lib
from maxtrain.program import step as step_lib
from maxtrain.program.plan import validate
from maxtrain.sharding import pipeline as pipeline_lib
from maxtrain.sharding import rules as rules_lib
from maxtrain.sharding import schedules
from maxtrain.sharding.pipeline import Schedule
from tiny import TINY_MODEL

MODEL = TINY_MODEL + ["--config.model.num_layers=4", "--config.data.batch_size=16"]
COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@pytest.mark.parametrize("kind, stages, microbatches, repeats", [
    ("gpipe", 4, 4, 1), ("gpipe", 4, 16, 1), ("gpipe", 2, 4, 2), ("gpipe", 8, 3, 3),
    ("1f1b", 4, 4, 1), ("1f1b", 4, 16, 1), ("1f1b", 2, 2, 1), ("1f1b", 8, 32, 1)])
def test_idle_slots_of_the_table_equal_the_bubble_formula(kind, stages, microbatches, repeats):
  schedule = Schedule(stages=stages, microbatches=microbatches, repeats=repeats, kind=kind)
  tab = schedules.table(schedule)
  s_, m_, r_ = stages, microbatches, repeats
  formula = (s_ - 1) / (r_ * m_ + s_ - 1) if kind == "gpipe" else (2 * s_ - 2) / (m_ + 2 * s_ - 2)
  assert schedules.bubble(tab) == pytest.approx(formula) == pytest.approx(schedule.bubble)
  for col in (0, 1):  # every stage runs every pass once forward and once backward
    for s in range(s_):
      assert sorted(tab[:, s, col][tab[:, s, col] >= 0]) == sorted(list(range(r_ * m_)))
  if kind == "1f1b":
    # the backward of microbatch i on stage s follows its forward there and the backward on stage s + 1
    for i in range(m_):
      f = [int(np.flatnonzero(tab[:, s, 0] == i)[0]) for s in range(s_)]
      b = [int(np.flatnonzero(tab[:, s, 1] == i)[0]) for s in range(s_)]
      assert all(f[s] == f[s - 1] + 1 for s in range(1, s_)) and b[-1] == f[-1]
      assert all(b[s] == b[s + 1] + 1 for s in range(s_ - 1))


def test_1f1b_holds_O_S_microbatches_gpipe_all_M():
  for m_ in (4, 8, 16):
    gpipe = schedules.held(schedules.table(Schedule(stages=4, microbatches=m_, repeats=1)))
    one = schedules.held(schedules.table(Schedule(stages=4, microbatches=m_, repeats=1, kind="1f1b")))
    assert list(gpipe) == [m_] * 4
    assert list(one) == [min(m_, 2 * (4 - s) - 1) for s in range(4)]  # at most 2S - 1: the saved slots
    assert max(one) == schedules.slots(Schedule(stages=4, microbatches=m_, repeats=1, kind="1f1b"))


def _loss_and_grads(kind: str, *extra: str):
  cfg = config_lib.load(MODEL + ["--config.mesh.pipeline=2", "--config.mesh.tensor=2", "--config.mesh.data=2",
                                 "--config.mesh.fsdp=1", "--config.pipeline.microbatches=4",
                                 f"--config.pipeline.schedule={kind}", "--config.optimizer.grad_accum_steps=2", *extra])
  program = build_lib.program_for(cfg, jax.devices(), require_data=False)
  rng = np.random.default_rng(0)
  b, t = cfg.data.batch_size, cfg.data.seq_len
  tokens = rng.integers(0, 16, size=(b, t + 1), dtype=np.int32)
  segments = np.ones((b, t), np.int32)
  segments[:, t // 3:] = 2
  positions = np.concatenate([np.arange(t // 3), np.arange(t - t // 3)]).astype(np.int32)[None].repeat(b, 0)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments, "positions": positions,
           "loss_mask": (rng.random((b, t)) > 0.2).astype(np.float32)}

  def f(params, batch):
    with rules_lib.activate(program.plan.layout.rules), pipeline_lib.activate(program.plan.pipeline):
      return step_lib.loss_and_grads(program.state.graphdef, params, batch, z_loss=1e-4, grad_accum_steps=2)

  with jax.set_mesh(program.mesh):
    params = state_lib.initialize(program.state, program.mesh).params
    metrics, grads = jax.jit(f).lower(params, batch).compile(COMPILE)(params, batch)
  return jax.tree.map(np.asarray, metrics), jax.tree.map(np.asarray, grads)


def test_1f1b_gradient_equals_gpipes():
  """One step's loss and gradient (pipeline=2 x tensor=2 x data=2, M = 4 > 2S - 1 slots, 2 accumulation steps,
  z-loss, a loss mask and two documents per row; pipeline=4 x fsdp=2: tests/test_pipeline_parallel.py). Both sum the same per-microbatch f32 terms in another order (and 1f1b recomputes each
  stage's forward): reassociating a sum of n terms moves it by at most (n - 1) eps of the sum of their magnitudes;
  with n <= M x 2 accumulation steps = 8 terms per gradient entry, each itself a reduction over <= 16 rows' tokens
  of this batch, the bound is 8 x 16 x eps = 1.5e-5 of the largest entry of a leaf."""
  want_metrics, want = _loss_and_grads("gpipe")
  got_metrics, got = _loss_and_grads("1f1b")
  eps = np.finfo(np.float32).eps
  for k in want_metrics:
    np.testing.assert_allclose(got_metrics[k], want_metrics[k], rtol=8 * 16 * eps, err_msg=k)
  for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
    assert np.max(np.abs(w)) > 0, jax.tree_util.keystr(path)
    np.testing.assert_allclose(g, w, rtol=0, atol=8 * 16 * eps * np.max(np.abs(w)), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("args, message", [
    (["--config.pipeline.schedule=zb"], "config.pipeline.schedule='zb' is not built yet"),
    (["--config.pipeline.schedule=1f1c"], "config.pipeline.schedule='1f1c': choose one of"),
    (["--config.pipeline.schedule=1f1b", "--config.pipeline.repeats=2", "--config.model.num_layers=8"],
     "config.pipeline.schedule='1f1b' with pipeline.repeats=2"),
    (["--config.mesh.pipeline=1", "--config.mesh.fsdp=8", "--config.pipeline.microbatches=1",
      "--config.pipeline.schedule=1f1b"], "config.pipeline.schedule='1f1b' without a pipeline"),
])
def test_schedules_not_built_are_refused_before_compiling(args, message):
  cfg = config_lib.load(MODEL + ["--config.mesh.pipeline=4", "--config.mesh.fsdp=2",
                                 "--config.pipeline.microbatches=4", *args])
  with pytest.raises(UserError, match=re.escape(message)):
    validate(cfg, 8, require_data=False)


def test_the_estimate_reports_1f1b_per_stage():
  """tools/estimate.py under 1f1b: the table's bubble and held microbatches per stage, and saved activations of
  min(M, 2S - 1) stage inputs, less than gpipe's with stage remat once M > 2S - 1."""
  from maxtrain.aot import estimate

  args = ["--config.mesh.pipeline=4", "--config.mesh.fsdp=2", "--config.data.batch_size=32", "--config.model.remat=full"]
  one = estimate.estimate(config_lib.load(MODEL + args + ["--config.pipeline.microbatches=16",
                                                          "--config.pipeline.schedule=1f1b"]), 8).pipeline
  gpipe = estimate.estimate(config_lib.load(MODEL + args + ["--config.pipeline.microbatches=16",
                                                            "--config.pipeline.stage_remat=true"]), 8).pipeline
  assert one["schedule"] == "1f1b" and one["bubble_fraction"] == pytest.approx(6 / 22)
  assert [s["live_passes"] for s in one["per_stage"]] == [7, 5, 3, 1]
  assert [s["live_passes"] for s in gpipe["per_stage"]] == [16] * 4
  assert one["max_stage_saved_bytes"] < gpipe["max_stage_saved_bytes"]
