"""The circular pipeline over the `pipeline` mesh axis (maxtrain/sharding/pipeline.py): it trains like the same
model without it for 20 steps (with remat, gradient accumulation, the chunked loss and the guards' skips),
lowers to stage-to-stage collective-permutes without gathering layer stacks across stages, moves checkpoints
between stage counts both ways, runs Muon per stage, reports its bubble, and refuses what it does not support
before compiling. Each mesh compiles once (the `runs` fixture); every test reads its results."""

import dataclasses
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import print_saved_residuals
import numpy as np
import pytest

from maxtrain.aot import estimate, hlo_lint
from maxtrain.checkpoint.identity import run_meta
from maxtrain.checkpoint.storage import Checkpointer
from maxtrain.config import loader as config_lib
from maxtrain.errors import UserError
from maxtrain.optim import muon
from maxtrain.optim import optimizer as optim
from maxtrain.program import batch as batch_lib
from maxtrain.program import build as build_lib
from maxtrain.program import state as state_lib
from maxtrain.program import step as step_lib
from maxtrain.program.plan import validate
from maxtrain.runtime import faults
from maxtrain.sharding import rules as rules_lib
from maxtrain.sharding.layout import param_name
from tiny import TINY_MODEL

# 4 layers so that 4 stages, and 2 stages x 2 repeats, each hold one layer per repeat (no data source needed).
# spike_warmup=5: the loss-spike policy is armed by the spike step below.
MODEL = TINY_MODEL + ["--config.model.num_layers=4", "--config.data.batch_size=16", "--config.optimizer.warmup_steps=1",
                      "--config.guards.spike_warmup=5"]
STEPS = 20
# In-graph faults (the step's fault input: the same compiled program): a NaN step and a x100 loss spike,
# whose updates the guards skip in every run alike.
FAULTS = {6: (1.0, 1.0), 13: (0.0, 100.0)}
DRILLED = ["--config.faults.nan_at_step=6"]  # an in-graph drill set: the builder gives the step its fault input
# Less backend (LLVM) optimisation: half the compile time on CPU; the optimised HLO the tests read (collectives,
# layouts) is the same, and every run compared here is compiled alike.
COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
MESHES = {
    "reference": ["--config.mesh.fsdp=8"],  # the same model without the pipeline
    # M = S; remat of every layer inside the stages
    "pipeline4xfsdp2": ["--config.mesh.pipeline=4", "--config.mesh.fsdp=2", "--config.pipeline.microbatches=4",
                        "--config.model.remat=full"],
    # tensor and data parallelism inside each stage, circular repeats with M > S (microbatches wait at stage 0
    # for their next repeat), gradient accumulation and the chunked loss, in one compile
    "pipeline2xtensor2xdata2_repeats2": [
        "--config.mesh.pipeline=2", "--config.mesh.tensor=2", "--config.mesh.data=2", "--config.mesh.fsdp=1",
        "--config.pipeline.repeats=2", "--config.pipeline.microbatches=4", "--config.optimizer.grad_accum_steps=2",
        "--config.model.loss_chunk_tokens=16"],
    # 1F1B (sharding/schedules.py) with M = 8 > 2S - 1: its saved stage inputs wrap around their 7 slots
    "pipeline4xfsdp2_1f1b": ["--config.mesh.pipeline=4", "--config.mesh.fsdp=2", "--config.pipeline.microbatches=8",
                             "--config.pipeline.schedule=1f1b", "--config.model.remat=full"],
    # zero-bubble (ZB-H1): the backward split into input and weight gradients, W deferred into the drain
    "pipeline4xfsdp2_zb": ["--config.mesh.pipeline=4", "--config.mesh.fsdp=2", "--config.pipeline.microbatches=8",
                           "--config.pipeline.schedule=zb"],
    # Megatron's interleaved 1F1B over 2 layer groups per stage
    "pipeline2xfsdp4_interleaved": ["--config.mesh.pipeline=2", "--config.mesh.fsdp=4", "--config.pipeline.repeats=2",
                                    "--config.pipeline.microbatches=4", "--config.pipeline.schedule=interleaved_1f1b"],
}


def _cfg(*args):
  return config_lib.load(MODEL + list(args))


def _batches(cfg, n):
  rng = np.random.default_rng(0)
  b, t = cfg.data.batch_size, cfg.data.seq_len
  out = []
  for _ in range(n):
    tokens = rng.integers(0, 16, size=(b, t + 1), dtype=np.int32)  # 16 of the v tokens: a loss that falls
    segments = np.ones((b, t), np.int32)
    segments[:, t // 2:] = 2  # two documents per row: the masks and positions travel with the microbatches
    positions = np.concatenate([np.arange(t // 2), np.arange(t - t // 2)]).astype(np.int32)[None].repeat(b, 0)
    out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments,
                "positions": positions, "loss_mask": np.ones((b, t), np.float32)})
  return out


@dataclasses.dataclass
class Run:
  program: Any
  compiled: Any
  losses: np.ndarray  # [STEPS + 1]: the last one from the step after the final state
  metrics: list[dict[str, float]]
  state: Any  # numpy, after STEPS steps

  def step(self, state, rows):
    """One more step from `state` (on this run's mesh): its loss."""
    batch = faults.attach(batch_lib.to_device(rows, self.program.batch_shardings), faults.NONE,
                          self.program.batch_shardings[faults.INPUT])
    with jax.set_mesh(self.program.mesh):
      return float(self.compiled(state, batch)[1]["loss"])


def _train(name):
  """STEPS steps on fixed batches (with FAULTS), compiled once, then the loss of one more step."""
  cfg = _cfg(*MESHES[name], *DRILLED)
  program = build_lib.program_for(cfg, jax.devices(), require_data=False)
  compiled = program.lower().compile(compiler_options=COMPILE)
  rows = _batches(cfg, STEPS + 1)
  with jax.set_mesh(program.mesh):
    state = state_lib.initialize(program.state, program.mesh)
    metrics = []
    for i in range(STEPS):
      batch = faults.attach(batch_lib.to_device(rows[i], program.batch_shardings), FAULTS.get(i, faults.NONE),
                            program.batch_shardings[faults.INPUT])
      state, m = compiled(state, batch)
      metrics.append({k: float(v) for k, v in m.items() if np.ndim(v) == 0})
  saved = jax.tree.map(np.asarray, state)
  run = Run(program, compiled, np.array([m["loss"] for m in metrics]), metrics, saved)
  run.losses = np.append(run.losses, run.step(state, rows[STEPS]))
  return run


@pytest.fixture(scope="module")
def runs():
  return {name: _train(name) for name in MESHES}


@pytest.mark.parametrize("name", ["pipeline4xfsdp2", "pipeline2xtensor2xdata2_repeats2", "pipeline4xfsdp2_1f1b",
                                  "pipeline4xfsdp2_zb", "pipeline2xfsdp4_interleaved"])
def test_pipeline_trains_like_no_pipeline(runs, name):
  ref, run = runs["reference"], runs[name]
  assert run.program.plan.pipeline is not None and run.program.plan.pipeline.stages == int(name[8])
  np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-5)  # 20 steps and the next one
  finite = np.isfinite(ref.losses)
  assert list(np.flatnonzero(~finite)) == [6] and ref.losses[finite][-1] < ref.losses[0]  # it trains
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), run.state.params, ref.state.params)


@pytest.mark.parametrize("name", list(MESHES))
def test_every_loop_that_holds_a_collective_is_ordered(runs, name):
  """No collective sits beside a loop that holds collectives unordered (a loss-head token count hoisted beside the
  schedules' per-op loops did, and the step hung on XLA:CPU: aot/hlo_lint.py)."""
  assert hlo_lint.unordered_collective_loops(runs[name].compiled.as_text()) == []


def test_guards_skip_the_same_steps_under_the_pipeline(runs):
  """The NaN step and the loss spike are skipped (parameters kept) by the pipelined runs as by the reference."""
  for name, run in runs.items():
    nonfinite = [i for i, m in enumerate(run.metrics) if m["nonfinite"]]
    spikes = [i for i, m in enumerate(run.metrics) if m["spike"]]
    assert (nonfinite, spikes, run.metrics[-1]["skipped_steps"]) == ([6], [13], 2), name
    assert run.metrics[6]["param_norm"] == pytest.approx(run.metrics[5]["param_norm"], rel=1e-6), name


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


def _crossing(hlo: str, stage_of: dict[int, int], op: str) -> list[tuple[int, ...]]:
  """Shapes of the `op` collectives (all-gather, all-to-all) whose groups span stages."""
  out = []
  for line in hlo.splitlines():
    if re.search(rf"= \S+ {op}(-start)?\(", line):
      if any(len({stage_of[d] for d in g}) > 1 for g in _groups(line, len(stage_of))):
        out.append(tuple(int(x) for x in re.search(r"= \w+\[([\d,]*)\]", line).group(1).split(",") if x))
  return out


def _stage_of(mesh) -> dict[int, int]:
  devices = mesh.devices  # [pipeline, data, fsdp, expert, context, tensor]
  return {d.id: s for s in range(devices.shape[0]) for d in devices[s].flat}


def test_lowered_step_permutes_between_stages_and_gathers_no_layer_stack(runs):
  run = runs["pipeline4xfsdp2"]
  hlo, stage_of = run.compiled.as_text(), _stage_of(run.program.mesh)
  ring = [line for line in hlo.splitlines() if "collective-permute" in line and "ppermute" in line]
  assert ring, "no stage-to-stage collective-permute"
  pairs = {tuple(map(int, p)) for line in ring for p in re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])}
  assert {(stage_of[a], stage_of[b]) for a, b in pairs} >= {(s, (s + 1) % 4) for s in range(4)}  # the ring, forward
  stacked = {tuple(leaf.shape) for leaf in jax.tree.leaves(run.program.state.abstract.params["blocks"])}
  crossing = _crossing(hlo, stage_of, "all-gather")
  # Whole layer stacks [L, ...] (or a stage's [L/S, ...] slab regrouped) never cross the pipeline axis.
  assert not [s for s in crossing if s and s[0] in (4, 1) and np.prod(s) in {np.prod(t) for t in stacked}], crossing


@pytest.mark.parametrize("name, remat", [("pipeline4xfsdp2", "full"), ("pipeline2xtensor2xdata2_repeats2", "full"),
                                         ("pipeline2xtensor2xdata2_repeats2", "none")])
def test_the_backward_keeps_activations_per_iteration_not_the_stage_weights(name, remat, capsys):
  """What the backward keeps from each of the R M + S - 1 iterations of the pipeline loop: with remat=full
  each layer's input [rows of a microbatch, T, D] only; without remat activations, but no layer weight. The
  stage's weights are kept once, not copied per iteration (they were: see pipeline.run). Traced, not compiled."""
  cfg = _cfg(*MESHES[name], f"--config.model.remat={remat}")
  program = build_lib.program_for(cfg, jax.devices(), require_data=False)
  schedule, batch = program.plan.pipeline, program.abstract_batch()  # no drill set: the rows only

  def loss(params, batch):  # the graphdef's model: the plan's rules and pipeline (program/state.py)
    return step_lib.loss_sums(program.state.graphdef, params, batch)[0]

  with jax.set_mesh(program.mesh):
    print_saved_residuals(loss, program.abstract_state().params, batch)
  shapes = [tuple(int(d) for d in dims.split(",")) for dims in
            re.findall(r"^f32\[([\d,]+)\] output of shard_map", capsys.readouterr().out, re.MULTILINE)]
  per_iteration = {s for s in shapes if s[0] == schedule.stages * schedule.iterations}
  weights = {tuple(leaf.shape[1:]) for leaf in jax.tree.leaves(program.state.abstract.params["blocks"])}
  assert per_iteration and not [s for s in per_iteration if s[2:] in weights], per_iteration
  rows = cfg.data.batch_size // schedule.microbatches
  layers_per_group = cfg.model.num_layers // (schedule.stages * schedule.repeats)
  if remat == "full":
    assert per_iteration == {(schedule.stages * schedule.iterations, layers_per_group, rows, cfg.data.seq_len,
                              cfg.model.d_model)}, per_iteration


def _assert_restores(ckpt, path, target, saved):
  restored = ckpt.restore(path, target.program.state.abstract, target.program.state.shardings)
  assert restored.step == STEPS
  wq = restored.state.params["blocks"]["attn"]["wq"][...]
  assert wq.sharding.mesh.shape == target.program.mesh.shape
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored.state), saved)
  return restored.state


def test_checkpoints_move_between_stage_counts_bitwise(runs, tmp_path):
  """The state keeps the stacked [L, ...] layout, so the resharding restore moves it between stage counts:
  pipeline=4 onto pipeline=1 and 2, and pipeline=1 and 2 onto pipeline=4, bitwise; the pipeline=1 checkpoint
  resumes on pipeline=4 to the reference's next loss."""
  names = {1: "reference", 2: "pipeline2xtensor2xdata2_repeats2", 4: "pipeline4xfsdp2"}
  paths = {}
  for stages, name in names.items():
    run = runs[name]
    ckpt = Checkpointer(run.program.cfg.checkpoint, str(tmp_path / name))
    with jax.set_mesh(run.program.mesh):
      state = jax.device_put(run.state, run.program.state.shardings)
    ckpt.save(STEPS, state, {}, run_meta(run.program.cfg, dict(run.program.mesh.shape)))
    ckpt.close()
    paths[stages] = tmp_path / name / str(STEPS)
  ckpt = Checkpointer(runs["reference"].program.cfg.checkpoint, str(tmp_path / "restore"))
  for source, target in ((4, 1), (4, 2), (1, 4), (2, 4)):
    state = _assert_restores(ckpt, paths[source], runs[names[target]], runs[names[source]].state)
    if (source, target) == (1, 4):
      rows = _batches(runs["reference"].program.cfg, STEPS + 1)[STEPS]
      loss = runs[names[target]].step(state, rows)
      np.testing.assert_allclose(loss, runs["reference"].losses[STEPS], rtol=1e-5)
  ckpt.close()


@pytest.mark.parametrize("kind, name", [("1f1b", "pipeline4xfsdp2_1f1b"), ("zb", "pipeline4xfsdp2_zb"),
                                        ("interleaved_1f1b", "pipeline2xfsdp4_interleaved")])
def test_schedule_resumes_bitwise(runs, tmp_path, kind, name):
  """The 1f1b / zb / interleaved run's state after STEPS steps saves and restores bitwise, and its next step gives
  the loss the run gave without the round trip, exactly."""
  run = runs[name]
  assert run.program.plan.pipeline.kind == kind
  ckpt = Checkpointer(run.program.cfg.checkpoint, str(tmp_path))
  with jax.set_mesh(run.program.mesh):
    ckpt.save(STEPS, jax.device_put(run.state, run.program.state.shardings), {},
              run_meta(run.program.cfg, dict(run.program.mesh.shape)))
  ckpt.close()
  ckpt = Checkpointer(run.program.cfg.checkpoint, str(tmp_path / "restore"))
  state = _assert_restores(ckpt, tmp_path / str(STEPS), run, run.state)
  ckpt.close()
  assert run.step(state, _batches(run.program.cfg, STEPS + 1)[STEPS]) == run.losses[STEPS]


def test_bubble_is_reported_by_the_estimate():
  for args, bubble in [(MESHES["pipeline4xfsdp2"], 3 / 7), (MESHES["pipeline2xtensor2xdata2_repeats2"], 1 / 9),
                       (["--config.mesh.pipeline=2", "--config.mesh.fsdp=4", "--config.pipeline.microbatches=2"], 1 / 3)]:
    e = estimate.estimate(_cfg(*args), 8)
    assert e.pipeline["bubble_fraction"] == pytest.approx(bubble)
    assert f"bubble {bubble:.4f}" in e.table()
  assert estimate.estimate(_cfg(*MESHES["reference"]), 8).pipeline is None


def test_muon_under_the_pipeline_orthogonalises_each_stages_own_layers():
  """Muon is accepted with a pipeline; its Newton-Schulz of the stacked weights (the one part of its update
  that depends on the mesh), as the step runs it on pipeline=4 x fsdp=2 with 8 layers, splits each stage's
  2 layers over its fsdp pair with no collective across stages, and equals the unsharded iteration."""
  program = build_lib.program_for(_cfg("--config.optimizer.name=muon", "--config.model.num_layers=8",
                                       *MESHES["pipeline4xfsdp2"]), jax.devices(), require_data=False)
  assert rules_lib.layer_split(8, dict(program.mesh.shape)) == rules_lib.LayerSplit(("pipeline", "fsdp"), 4, 2)
  names = muon.logical_names(program.state.abstract.params)
  weights = ["blocks/mlp/gate", "blocks/attn/wo", "blocks/attn/wk"]  # a matrix, heads folded into fan_in and fan_out
  shardings = {k: v for k, v in _named(program.state.shardings.params).items() if k in weights}
  rng = np.random.default_rng(1)
  x = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in _named(program.state.abstract.params).items()
       if k in weights}
  coeffs, steps = optim.parse_ns_coeffs(program.cfg.optimizer.muon_ns_coeffs), program.cfg.optimizer.muon_ns_steps

  def run(x, rules):
    return {k: muon.orthogonalize(v, optim.matrix_dimension_numbers(names[k]), names[k], coeffs, steps, jnp.float32,
                                  rules_lib.Parallel.of(rules)) for k, v in x.items()}

  want = jax.jit(functools.partial(run, rules=None))(x)  # one device, no rules: the plain iteration
  with jax.set_mesh(program.mesh):
    compiled = jax.jit(functools.partial(run, rules=program.plan.layout.rules), in_shardings=(shardings,),
                       out_shardings=shardings).lower(x).compile(COMPILE)
    got = compiled(jax.device_put(x, shardings))
  for k in weights:
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6, err_msg=k)
  hlo, stage_of = compiled.as_text(), _stage_of(program.mesh)
  assert re.search(r"all-to-all(-start)?\(", hlo)  # the split inside each stage
  assert not _crossing(hlo, stage_of, "all-to-all") and not _crossing(hlo, stage_of, "all-gather")


def _named(tree):
  return {param_name(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("layers, sizes, axes, per_group", [
    # 32 layers on 64 devices: the axes that divide them when that costs no work (fsdp=32: 1 layer per device;
    # tensor would only add 32 zero layers) ...
    (32, {"fsdp": 32, "tensor": 2}, ("fsdp",), 32),
    (32, {"fsdp": 8, "tensor": 4, "context": 2}, ("fsdp", "tensor"), 32),
    # ... and zero layers where they halve it: 1 layer per device, not 2 on each fsdp device duplicated over tensor
    (32, {"fsdp": 16, "tensor": 4}, ("fsdp", "tensor"), 64),
    (4, {"fsdp": 4, "tensor": 2}, ("fsdp",), 4),
    # a pipeline: each stage its own layers (8 per stage), padded inside the stage only if that shortens the work
    (32, {"pipeline": 4, "fsdp": 2, "tensor": 4}, ("pipeline", "fsdp", "tensor"), 8),
    (32, {"pipeline": 4, "fsdp": 4, "tensor": 4}, ("pipeline", "fsdp", "tensor"), 16),
    (32, {"pipeline": 4, "fsdp": 8, "tensor": 2}, ("pipeline", "fsdp"), 8),
    (32, {"pipeline": 2, "data": 4}, ("pipeline",), 16),  # data is not in opt_layers (it replicates the parameters)
])
def test_muon_layer_split_prefers_dividing_axes_and_pads_only_to_shorten_the_work(layers, sizes, axes, per_group):
  split = rules_lib.layer_split(layers, sizes)
  assert (split.axes, split.per_group) == (axes, per_group)
  assert split.groups == sizes.get("pipeline", 1)


@pytest.mark.parametrize("args, message", [
    (["--config.mesh.pipeline=4", "--config.mesh.fsdp=2", "--config.pipeline.microbatches=4",
      "--config.pipeline.repeats=2"], "num_layers=4 is not divisible by stages x pipeline.repeats = 4 x 2 = 8"),
    (["--config.mesh.pipeline=4", "--config.mesh.fsdp=2", "--config.pipeline.microbatches=2"],
     "microbatches=2 is fewer than the 4 stages"),
    (["--config.mesh.pipeline=2", "--config.mesh.fsdp=4", "--config.pipeline.microbatches=3"],
     "microbatches=3 does not divide the 4 sequences per batch shard"),
    (["--config.mesh.pipeline=2", "--config.mesh.fsdp=2", "--config.mesh.context=2", "--config.data.seq_len=32",
      "--config.pipeline.microbatches=2"], "context parallelism"),
    (["--config.mesh.fsdp=8", "--config.pipeline.microbatches=4"], "without a pipeline"),
])
def test_bad_pipeline_settings_are_refused_before_compiling(args, message):
  with pytest.raises(UserError, match=re.escape(message)):
    validate(_cfg(*args), 8, require_data=False)


def test_the_pipeline_stack_refuses_unscanned_layers_before_compiling():
  """The stack owns what it cannot run (models/stack.py): a pipeline over a list of layers is its UserError,
  raised while the program builds the model's state spec (nothing is compiled)."""
  cfg = _cfg("--config.mesh.pipeline=2", "--config.mesh.fsdp=4", "--config.pipeline.microbatches=2",
             "--config.model.scan_layers=False")
  validate(cfg, 8, require_data=False)  # the plan keeps no list of what the stack cannot do
  with pytest.raises(UserError, match=re.escape("config.model.scan_layers=False with a pipeline of 2 stages")):
    build_lib.program_for(cfg, jax.devices(), require_data=False)
