"""The circular pipeline over the `pipeline` mesh axis (maxtrain/sharding/pipeline.py): it trains like the same
model without it, lowers to stage-to-stage collective-permutes, reports its bubble, and refuses what it does
not support before compiling."""

import jax
import numpy as np
import pytest

from maxtrain.config import loader as config_lib
from maxtrain.errors import UserError
from maxtrain.program import batch as batch_lib
from maxtrain.program import build as build_lib
from maxtrain.program import state as state_lib
from maxtrain.program.plan import validate
from maxtrain.runtime import faults
from tiny import TINY_MODEL

# 4 layers so that 4 stages, and 2 stages x 2 repeats, each hold one layer per repeat; eval off (no data needed).
MODEL = TINY_MODEL + ["--config.model.num_layers=4", "--config.data.batch_size=16", "--config.optimizer.warmup_steps=1"]
STEPS = 4


def _cfg(*args):
  return config_lib.load(MODEL + list(args))


def _batches(cfg, n):
  rng = np.random.default_rng(0)
  b, t, v = cfg.data.batch_size, cfg.data.seq_len, cfg.model.vocab_size
  out = []
  for _ in range(n):
    tokens = rng.integers(0, v, size=(b, t + 1), dtype=np.int32)
    segments = np.ones((b, t), np.int32)
    segments[:, t // 2:] = 2  # two documents per row: the mask and positions travel with the microbatches
    positions = np.concatenate([np.arange(t // 2), np.arange(t - t // 2)]).astype(np.int32)[None].repeat(b, 0)
    out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments,
                "positions": positions, "loss_mask": np.ones((b, t), np.int32)})
  return out


def _train(*args):
  """Per-step losses and the final parameters of STEPS steps on fixed batches."""
  cfg = _cfg(*args)
  program = build_lib.program_for(cfg, jax.devices(), require_data=False)
  with jax.set_mesh(program.mesh):
    state = state_lib.initialize(program.state, program.mesh)
    losses = []
    for rows in _batches(cfg, STEPS):
      batch = batch_lib.to_device(rows, program.batch_shardings)
      batch = faults.attach(batch, faults.NONE, program.batch_shardings[faults.INPUT])
      state, metrics = program.train_step(state, batch)
      losses.append(float(metrics["loss"]))
  return np.array(losses), jax.tree.map(np.asarray, state.params), program


@pytest.fixture(scope="module")
def reference():
  return _train("--config.mesh.fsdp=8")


@pytest.mark.parametrize("mesh", [
    ["--config.mesh.pipeline=4", "--config.mesh.fsdp=2", "--config.pipeline.microbatches=4"],
    ["--config.mesh.pipeline=2", "--config.mesh.fsdp=4", "--config.pipeline.repeats=2",
     "--config.pipeline.microbatches=2"],
], ids=["pipeline4xfsdp2", "pipeline2_repeats2"])
def test_pipeline_trains_like_no_pipeline(reference, mesh):
  ref_losses, ref_params, _ = reference
  losses, params, program = _train(*mesh)
  assert program.plan.pipeline is not None
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params, ref_params)
