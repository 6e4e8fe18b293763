"""The circular pipeline over the `pipeline` mesh axis (maxtrain/sharding/pipeline.py): it trains like the same
model without it, lowers to stage-to-stage collective-permutes without gathering layer stacks across stages,
reports its bubble, and refuses what it does not support before compiling."""

import functools
import re

import jax
import numpy as np
import pytest

from maxtrain.aot import estimate
from maxtrain.checkpoint.storage import Checkpointer
from maxtrain.config import loader as config_lib
from maxtrain.errors import UserError
from maxtrain.program import batch as batch_lib
from maxtrain.program import build as build_lib
from maxtrain.program import state as state_lib
from maxtrain.program.plan import validate
from maxtrain.runtime import faults
from tiny import TINY_MODEL

# 4 layers so that 4 stages, and 2 stages x 2 repeats, each hold one layer per repeat (no data source needed).
# The reference is the same model without the pipeline.
MODEL = TINY_MODEL + ["--config.model.num_layers=4", "--config.data.batch_size=16", "--config.optimizer.warmup_steps=1"]
STEPS = 4
MESHES = {
    "reference": ["--config.mesh.fsdp=8"],
    "pipeline4xfsdp2": ["--config.mesh.pipeline=4", "--config.mesh.fsdp=2", "--config.pipeline.microbatches=4"],
    # tensor and data parallelism inside each stage, circular repeats and gradient accumulation, in one compile
    "pipeline2xtensor2xdata2_repeats2_accum2": [
        "--config.mesh.pipeline=2", "--config.mesh.tensor=2", "--config.mesh.data=2", "--config.mesh.fsdp=1",
        "--config.pipeline.repeats=2", "--config.pipeline.microbatches=2", "--config.optimizer.grad_accum_steps=2"],
}


def _cfg(*args):
  return config_lib.load(MODEL + list(args))


def _batches(cfg, n):
  rng = np.random.default_rng(0)
  b, t, v = cfg.data.batch_size, cfg.data.seq_len, cfg.model.vocab_size
  out = []
  for _ in range(n):
    tokens = rng.integers(0, v, size=(b, t + 1), dtype=np.int32)
    segments = np.ones((b, t), np.int32)
    segments[:, t // 2:] = 2  # two documents per row: the masks and positions travel with the microbatches
    positions = np.concatenate([np.arange(t // 2), np.arange(t - t // 2)]).astype(np.int32)[None].repeat(b, 0)
    out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments,
                "positions": positions, "loss_mask": np.ones((b, t), np.float32)})
  return out


@functools.cache
def _train(name):
  """(per-step losses, final parameters, program, compiled step, final state) of STEPS steps on fixed batches,
  compiled once."""
  cfg = _cfg(*MESHES[name])
  program = build_lib.program_for(cfg, jax.devices(), require_data=False)
  compiled = program.lower().compile()
  with jax.set_mesh(program.mesh):
    state = state_lib.initialize(program.state, program.mesh)
    losses = []
    for rows in _batches(cfg, STEPS):
      batch = faults.attach(batch_lib.to_device(rows, program.batch_shardings), faults.NONE,
                            program.batch_shardings[faults.INPUT])
      state, metrics = compiled(state, batch)
      losses.append(float(metrics["loss"]))
  return np.array(losses), jax.tree.map(np.asarray, state.params), program, compiled, state


@pytest.mark.parametrize("name", ["pipeline4xfsdp2", "pipeline2xtensor2xdata2_repeats2_accum2"])
def test_pipeline_trains_like_no_pipeline(name):
  ref_losses, ref_params, *_ = _train("reference")
  losses, params, program, *_ = _train(name)
  assert program.plan.pipeline is not None and program.plan.pipeline.stages == int(name[8])
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params, ref_params)


def _groups(attrs: str, num_devices: int) -> list[set[int]]:
  """The replica groups of an HLO collective: explicit {{0,2},{1,3}} or iota [G,N]<=[dims]T(perm)."""
  explicit = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", attrs)
  if explicit:
    return [set(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", explicit.group(1))]
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
  assert iota, attrs
  ids = np.arange(num_devices).reshape([int(x) for x in iota.group(3).split(",")])
  if iota.group(4):
    ids = ids.transpose([int(x) for x in iota.group(4).split(",")])
  return [set(row) for row in ids.reshape(int(iota.group(1)), int(iota.group(2))).tolist()]


def test_lowered_step_permutes_between_stages_and_gathers_no_layer_stack():
  _, _, program, compiled, _ = _train("pipeline4xfsdp2")
  hlo = compiled.as_text()
  devices = program.mesh.devices  # [pipeline, data, fsdp, expert, context, tensor]
  stage_of = {d.id: s for s in range(devices.shape[0]) for d in devices[s].flat}
  ring = [line for line in hlo.splitlines() if "collective-permute" in line and "ppermute" in line]
  assert ring, "no stage-to-stage collective-permute"
  pairs = {tuple(map(int, p)) for line in ring for p in re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])}
  assert {(stage_of[a], stage_of[b]) for a, b in pairs} >= {(s, (s + 1) % 4) for s in range(4)}  # the ring, forward
  stacked = {tuple(leaf.shape) for leaf in jax.tree.leaves(program.state.abstract.params["blocks"])}
  crossing = []
  for line in hlo.splitlines():
    if re.search(r"= \S+ all-gather(-start)?\(", line):
      if any(len({stage_of[d] for d in g}) > 1 for g in _groups(line, devices.size)):
        crossing.append(tuple(int(x) for x in re.search(r"= \w+\[([\d,]*)\]", line).group(1).split(",") if x))
  # Whole layer stacks [L, ...] (or a stage's [L/S, ...] slab regrouped) never cross the pipeline axis.
  assert not [s for s in crossing if s and s[0] in (4, 1) and np.prod(s) in {np.prod(t) for t in stacked}], crossing


def test_checkpoint_of_pipeline4_restores_bitwise_onto_pipeline1_and_pipeline2(tmp_path):
  """The state keeps the stacked [L, ...] layout, so the resharding restore moves it between stage counts."""
  *_, program, _, state = _train("pipeline4xfsdp2")
  saved = jax.tree.map(np.asarray, state)
  ckpt = Checkpointer(program.cfg.checkpoint, str(tmp_path))
  ckpt.save(STEPS, state, {}, program.cfg, dict(program.mesh.shape))
  ckpt.wait()
  for target in (_train("reference")[2], build_lib.program_for(_cfg(*MESHES["pipeline2xtensor2xdata2_repeats2_accum2"]), jax.devices(),
                                                               require_data=False)):
    restored = ckpt.restore(tmp_path / str(STEPS), target.state.abstract, target.state.shardings)
    assert restored.step == STEPS
    wq = restored.state.params["blocks"]["attn"]["wq"][...]
    assert wq.sharding.mesh.shape == target.mesh.shape
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored.state), saved)
  ckpt.close()


def test_bubble_is_reported_by_the_estimate():
  for args, bubble in [(MESHES["pipeline4xfsdp2"], 3 / 7), (MESHES["pipeline2xtensor2xdata2_repeats2_accum2"], 1 / 5),
                       (["--config.mesh.pipeline=2", "--config.mesh.fsdp=4", "--config.pipeline.microbatches=8",
                        "--config.data.batch_size=32"], 1 / 9)]:
    e = estimate.estimate(_cfg(*args), 8)
    assert e.pipeline["bubble_fraction"] == pytest.approx(bubble)
    assert f"bubble {bubble:.4f}" in e.table()
  assert estimate.estimate(_cfg(*MESHES["reference"]), 8).pipeline is None


@pytest.mark.parametrize("args, message", [
    (["--config.mesh.pipeline=4", "--config.mesh.fsdp=2", "--config.pipeline.microbatches=4",
      "--config.pipeline.repeats=2"], "num_layers=4 is not divisible by stages x pipeline.repeats = 4 x 2 = 8"),
    (["--config.mesh.pipeline=4", "--config.mesh.fsdp=2", "--config.pipeline.microbatches=2"],
     "microbatches=2 is fewer than the 4 stages"),
    (["--config.mesh.pipeline=2", "--config.mesh.fsdp=4", "--config.pipeline.microbatches=3"],
     "microbatches=3 does not divide the 4 sequences per batch shard"),
    (["--config.mesh.pipeline=2", "--config.mesh.fsdp=4", "--config.pipeline.microbatches=2",
      "--config.model.scan_layers=False"], "does not support config.model.scan_layers=False"),
    (["--config.mesh.pipeline=2", "--config.mesh.fsdp=2", "--config.mesh.context=2", "--config.data.seq_len=32",
      "--config.pipeline.microbatches=2"], "context parallelism"),
    (["--config.mesh.fsdp=8", "--config.pipeline.microbatches=4"], "without a pipeline"),
])
def test_bad_pipeline_settings_are_refused_before_compiling(args, message):
  with pytest.raises(UserError, match=re.escape(message)):
    validate(_cfg(*args), 8, require_data=False)
