"""Pipeline schedules (maxtrain/sharding/schedules.py): the host tables' idle stage-ticks equal each schedule's
bubble formula, their dependencies and buffer slots hold, and 1f1b / zb keep O(S) stage inputs where gpipe keeps
all M; the hand-written backward of 1f1b, zb and interleaved_1f1b gives gpipe's gradient (tensor and data parallel
inside the stages, gradient accumulation, the chunked loss); `auto` compiles the candidates and picks by its cost
model; settings that cannot run are refused before compiling. Training 20 steps like the model without a pipeline,
and resuming bitwise: tests/test_pipeline_parallel.py (`pipeline4xfsdp2_1f1b`, `pipeline4xfsdp2_zb`,
`pipeline2xfsdp4_interleaved`)."""

import functools
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
from maxtrain.sharding import schedules
from maxtrain.sharding.pipeline import Schedule
from tiny import TINY_MODEL

MODEL = TINY_MODEL + ["--config.model.num_layers=4", "--config.data.batch_size=16"]
COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


FORMULAS = {"gpipe": lambda s_, m_, r_: (s_ - 1) / (r_ * m_ + s_ - 1), "1f1b": lambda s_, m_, r_: (s_ - 1) / (m_ + s_ - 1),
            "interleaved_1f1b": lambda s_, m_, r_: (s_ - 1) / (r_ * m_ + s_ - 1),
            "zb": lambda s_, m_, r_: (s_ - 1) / (3 * m_ + s_ - 1)}


@pytest.mark.parametrize("kind, stages, microbatches, repeats", [
    ("gpipe", 4, 4, 1), ("gpipe", 4, 16, 1), ("gpipe", 2, 4, 2), ("gpipe", 8, 3, 3),
    ("1f1b", 4, 4, 1), ("1f1b", 4, 16, 1), ("1f1b", 2, 2, 1), ("1f1b", 8, 32, 1), ("1f1b", 4, 5, 1),
    ("zb", 4, 4, 1), ("zb", 4, 8, 1), ("zb", 2, 4, 1), ("zb", 8, 16, 1), ("zb", 3, 7, 1),
    ("interleaved_1f1b", 2, 4, 2), ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 4, 8, 3),
    ("interleaved_1f1b", 2, 2, 2)])
def test_idle_slots_of_the_table_equal_the_bubble_formula(kind, stages, microbatches, repeats):
  """The idle stage-ticks counted in each table equal the schedule's formula, every pass runs each of its ops
  once per stage, after what it needs was sent at an earlier tick, and the buffers' slots are never
  overwritten while a pass still needs them."""
  schedule = Schedule(stages=stages, microbatches=microbatches, repeats=repeats, kind=kind)
  tab = schedules.table(schedule)
  s_, m_, r_ = stages, microbatches, repeats
  assert schedules.bubble(tab) == pytest.approx(FORMULAS[kind](s_, m_, r_)) == pytest.approx(schedule.bubble)
  assert tab.shape[0] == (2 * schedule.iterations if kind == "gpipe" else schedule.iterations)
  backward = (schedules.B, schedules.W) if kind == "zb" else (schedules.BW,)
  when = {}
  for s in range(s_):
    for ops in ((schedules.F, schedules.H), *[(o,) for o in backward]):
      passes = tab[:, s, 1][np.isin(tab[:, s, 0], ops)]
      assert sorted(passes) == list(range(r_ * m_)), (s, ops)
    for t, (op, p) in enumerate(tab[:, s]):
      if op != schedules.IDLE:
        when[(schedules.F if op == schedules.H else op, (p // m_) * s_ + s, p % m_)] = t
  if kind == "gpipe":
    return
  b_ = backward[0]
  for (op, v, i), t in when.items():  # dependencies: strictly earlier ticks (sent at the end of a tick)
    if op == schedules.F and v > 0:
      assert when[(schedules.F, v - 1, i)] < t
    if op == b_:
      assert when[(schedules.F, v, i)] < t and (v == r_ * s_ - 1 or when[(b_, v + 1, i)] < t)
    if op == schedules.W:
      assert when[(schedules.B, v, i)] < t
  _check_slots(schedule, schedules.program(schedule))


def _check_slots(schedule: Schedule, prog: schedules.Program) -> None:
  """Replays the program's buffer writes and reads by name: every read finds the pass it wants."""
  s_, m_ = schedule.stages, schedule.microbatches
  xbuf = [[None] * prog.x_slots for _ in range(s_)]
  gbuf = [[None] * prog.g_slots for _ in range(s_)]
  for row in prog.rows:
    for s in range(s_):
      op, p, xk, gk = row[s, :4]
      if op != schedules.IDLE and not (s == 0 and p < m_):
        assert xbuf[s][xk] == p, (s, op, p)
      if op in (schedules.B, schedules.W, schedules.BW):
        assert gbuf[s][gk] == p, (s, op, p)
      if op == schedules.H:
        gbuf[s][gk] = p
    for s in range(s_):
      for col, src, step, buf in ((4, (s - 1) % s_, 1, xbuf), (5, (s + 1) % s_, -1, gbuf)):
        if row[s, col] >= 0:
          op, p = row[src, :2]
          v = (p // m_) * s_ + src + step
          buf[s][row[s, col]] = (v // s_) * m_ + p % m_


@pytest.mark.parametrize("kind", ["1f1b", "zb", "interleaved_1f1b"])
def test_1f1b_and_zb_hold_O_S_microbatches_gpipe_all_M(kind):
  for m_ in (4, 8, 16):
    gpipe = schedules.held(schedules.table(Schedule(stages=4, microbatches=m_, repeats=1)))
    r_ = 2 if kind == "interleaved_1f1b" else 1
    held = schedules.held(schedules.table(Schedule(stages=4, microbatches=m_, repeats=r_, kind=kind)))
    assert list(gpipe) == [m_] * 4
    want = {"1f1b": [min(m_, 4 - s) for s in range(4)], "zb": [4] * 4,
            "interleaved_1f1b": [min(2 * m_, 2 * (4 - s - 1) + 4 + 1) for s in range(4)]}[kind]
    assert list(held) == want  # O(S): 1f1b S - s, zb S (ZB-H1: 1F1B's peak), interleaved Megatron's warm-up + 1
    if r_ == 1:  # the slots hold what arrived and waits: at most S
      assert schedules.slots(Schedule(stages=4, microbatches=m_, repeats=r_, kind=kind)) <= 4


@functools.lru_cache(maxsize=None)
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

  def f(params, batch):  # the graphdef's model: the plan's rules and pipeline (program/state.py)
    return step_lib.loss_and_grads(program.state.graphdef, params, batch, z_loss=1e-4, grad_accum_steps=2)

  with jax.set_mesh(program.mesh):
    params = state_lib.initialize(program.state, program.mesh).params
    metrics, grads = jax.jit(f).lower(params, batch).compile(COMPILE)(params, batch)
  return jax.tree.map(np.asarray, metrics), jax.tree.map(np.asarray, grads)


@pytest.mark.parametrize("kind, extra", [
    ("1f1b", ()), ("zb", ()),
    # and the chunked loss (its own backward) as the last stage's head
    ("interleaved_1f1b", ("--config.pipeline.repeats=2", "--config.model.loss_chunk_tokens=16"))])
def test_schedule_gradient_equals_gpipes(kind, extra):
  """One step's loss and gradient (pipeline=2 x tensor=2 x data=2, M = 4 > 2S - 1 slots, 2 accumulation steps,
  z-loss, a loss mask and two documents per row; pipeline=4 x fsdp=2: tests/test_pipeline_parallel.py). Both sum the same per-microbatch f32 terms in another order (and the others recompute each
  stage's forward): reassociating a sum of n terms moves it by at most (n - 1) eps of the sum of their magnitudes;
  with n <= M x 2 accumulation steps = 8 terms per gradient entry, each itself a reduction over <= 16 rows' tokens
  of this batch, the bound is 8 x 16 x eps = 1.5e-5 of the largest entry of a leaf."""
  want_metrics, want = _loss_and_grads("gpipe")
  got_metrics, got = _loss_and_grads(kind, *extra)
  eps = np.finfo(np.float32).eps
  for k in want_metrics:
    np.testing.assert_allclose(got_metrics[k], want_metrics[k], rtol=8 * 16 * eps, err_msg=k)
  for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
    assert np.max(np.abs(w)) > 0, jax.tree_util.keystr(path)
    np.testing.assert_allclose(g, w, rtol=0, atol=8 * 16 * eps * np.max(np.abs(w)), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("args, message", [
    (["--config.pipeline.schedule=1f1c"], "config.pipeline.schedule='1f1c': choose one of"),
    (["--config.pipeline.schedule=1f1b", "--config.pipeline.repeats=2", "--config.model.num_layers=8"],
     "config.pipeline.schedule='1f1b' with pipeline.repeats=2"),
    (["--config.pipeline.schedule=zb", "--config.pipeline.repeats=2", "--config.model.num_layers=8"],
     "config.pipeline.schedule='zb' with pipeline.repeats=2"),
    (["--config.pipeline.schedule=interleaved_1f1b"], "config.pipeline.schedule='interleaved_1f1b' with "
     "pipeline.repeats=1, pipeline.microbatches=4"),
    (["--config.pipeline.schedule=interleaved_1f1b", "--config.pipeline.repeats=2", "--config.model.num_layers=8",
      "--config.pipeline.microbatches=6", "--config.data.batch_size=24"], "microbatches a multiple of 4"),
    (["--config.mesh.pipeline=1", "--config.mesh.fsdp=8", "--config.pipeline.microbatches=1",
      "--config.pipeline.schedule=1f1b"], "config.pipeline.schedule='1f1b' without a pipeline"),
])
def test_schedules_that_cannot_run_are_refused_before_compiling(args, message):
  cfg = config_lib.load(MODEL + ["--config.mesh.pipeline=4", "--config.mesh.fsdp=2",
                                 "--config.pipeline.microbatches=4", *args])
  with pytest.raises(UserError, match=re.escape(message)):
    validate(cfg, 8, require_data=False)


@pytest.mark.parametrize("kind, live", [("1f1b", [4, 3, 2, 1]), ("zb", [4, 4, 4, 4])])
def test_the_estimate_reports_the_schedule_per_stage(kind, live):
  """tools/estimate.py under 1f1b / zb: the table's bubble and held microbatches per stage, and saved activations
  of the slots' stage inputs and gradients (S each at most), less than gpipe's with stage remat (M = 16 inputs)."""
  from maxtrain.aot import estimate

  args = ["--config.mesh.pipeline=4", "--config.mesh.fsdp=2", "--config.data.batch_size=32", "--config.model.remat=full"]
  one = estimate.estimate(config_lib.load(MODEL + args + ["--config.pipeline.microbatches=16",
                                                          f"--config.pipeline.schedule={kind}"]), 8).pipeline
  gpipe = estimate.estimate(config_lib.load(MODEL + args + ["--config.pipeline.microbatches=16",
                                                            "--config.pipeline.stage_remat=true"]), 8).pipeline
  assert one["schedule"] == kind and one["bubble_fraction"] == pytest.approx(FORMULAS[kind](4, 16, 1))
  assert [s["live_passes"] for s in one["per_stage"]] == live
  assert [s["live_passes"] for s in gpipe["per_stage"]] == [16] * 4
  assert one["max_stage_saved_bytes"] < gpipe["max_stage_saved_bytes"]


def test_the_cost_model_counts_lockstep_ticks():
  """Stage forwards of one microbatch per step (program/schedule_fit.py), S = 4, M = 8, no model remat: gpipe
  (M+S-1) iterations x (1 forward + 2 backward); 1f1b 2(M+S-1) ticks x the BW op (recompute 1 + 2); zb 3M+S-1
  ticks x B or W (recompute 1 + 1); branchless (Neuron) zb ticks pay F + B + W + BW-free: 1 + 2 + 2 (+ H 1)."""
  from maxtrain.program import schedule_fit

  cost = lambda kind, **kw: schedule_fit.tick_units(Schedule(stages=4, microbatches=8, repeats=1, kind=kind, **kw), 0.0)
  assert cost("gpipe") == 11 * 3 and cost("gpipe", stage_remat=True) == 11 * 4
  assert cost("1f1b") == 22 * 3 and cost("zb") == 27 * 2
  assert cost("zb", branchless=True) == 27 * (1 + 1 + 2 + 2)


def test_the_network_decides_whether_to_pipeline():
  """`auto`'s cost model on plain values (program/schedule_fit.py step_times): 18 H200 nodes of 8 GPUs (tensor=8
  inside), the layers of a 405B-size model (1.6e12 bytes of f32 weights: 2e11 per tensor shard), full remat. fsdp
  across the 18 nodes gathers a device's 2e11 bytes twice and reduce-scatters them once per step through its
  50 GB/s share of the node's 8 x 400 Gb/s: 3 x 2e11 x 17/18 / 50e9 = 11.3 s, overlapped with its layer work.
  A pipeline of 18 stages across the nodes (gpipe, M=18, stage remat) sends only activations, and pays its
  bubble and recompute: 35 iterations x 5 forwards of a microbatch. At 1024 tokens per device the network makes
  fsdp lose; at 16384 the layer work hides the collectives and fsdp wins."""
  from maxtrain.program import fit, schedule_fit
  from maxtrain.sharding.mesh import MeshLayout

  target = fit.TARGETS["h200x8"]  # AXES: pipeline, data, fsdp, expert, context, tensor
  fsdp_mesh, pipe_mesh = MeshLayout((1, 1, 1, 1, 1, 8), (1, 1, 18, 1, 1, 1)), MeshLayout((1, 1, 1, 1, 1, 8), (18, 1, 1, 1, 1, 1))
  schedule = Schedule(stages=18, microbatches=18, repeats=1, stage_remat=True)
  layer_bytes, width = 1.6e12 / 8, 16384
  winners = {}
  for tokens in (1024, 16384):
    forward = tokens * 2 * 4e11 / target.flops  # all layers, per device
    sent = 2 * schedule.iterations * tokens / 18 * width * 2  # both ways, a microbatch of bf16 activations per iteration
    common = dict(forward_seconds=forward, recompute=1.0, layer_bytes=layer_bytes, accumulation=1, target=target)
    fsdp = schedule_fit.step_times(None, fsdp_mesh, boundary_bytes=0, **common)
    piped = schedule_fit.step_times(schedule, pipe_mesh, boundary_bytes=sent, **common)
    assert fsdp.fsdp == pytest.approx(3 * layer_bytes * 17 / 18 / (8 * 50e9 / 8))
    assert fsdp.compute == pytest.approx(4 * forward) and fsdp.boundary == 0
    assert fsdp.step == pytest.approx(max(4 * forward, fsdp.fsdp))  # overlapped
    assert piped.compute == pytest.approx(35 * 5 * forward / 18) and piped.fsdp == 0  # no fsdp axis in a stage
    assert piped.boundary == pytest.approx(sent / 2 / 50e9) and piped.step == pytest.approx(piped.compute + piped.boundary)
    winners[tokens] = "fsdp" if fsdp.step < piped.step else "pipeline"
  assert winners == {1024: "pipeline", 16384: "fsdp"}
  # Inside a node the collective runs over the link: 4 nodes x 8 GPUs of fsdp, across nodes first then NVLink
  assert schedule_fit.collective_seconds(1e9, 8, 4, 8, target) == pytest.approx(1e9 * 3 / 4 / 8 / 50e9 + 1e9 * 7 / 8 / 450e9)
  # fsdp collectives per accumulation step on the busiest stage, S = 4, M = 8, + 1 gradient reduction: gpipe the
  # forward's gathers once and the backward's per iteration; 1f1b F 1 + BW 2 per microbatch; zb F 1 + B 2 + W 2;
  # branchless zb every op of the table (F, H, B, W) every tick
  units = lambda kind, **kw: schedule_fit.collective_units(Schedule(stages=4, microbatches=8, repeats=1, kind=kind, **kw))
  assert (units("gpipe"), units("1f1b"), units("zb"), units("zb", branchless=True)) == (13, 25, 41, 27 * 6 + 1)


def test_auto_compiles_each_schedule_and_picks_the_cheapest_that_fits():
  """pipeline.schedule=auto (program/schedule_fit.py): gpipe, 1f1b and zb compiled for the run's mesh, each one's
  bubble (its formula), peak and boundary bytes tabled, the cheapest by the cost model chosen (every one fits
  this host's RAM). build.resolve_schedule runs the same with the default compile options."""
  from maxtrain.program import schedule_fit

  cfg = config_lib.load(MODEL + ["--config.mesh.pipeline=2", "--config.mesh.fsdp=4", "--config.pipeline.microbatches=2",
                                 "--config.pipeline.schedule=auto"])

  def compile_fn(trial):
    program = build_lib.program_for(trial, jax.devices(), require_data=False)
    with jax.set_mesh(program.mesh):
      return program.lower().compile(COMPILE), program.plan

  kind, table, rows = schedule_fit.choose_schedule(cfg, jax.devices(), compile_fn)
  print(table)
  assert [r.schedule for r in rows] == ["gpipe", "1f1b", "zb", schedule_fit.NO_PIPELINE] and all(r.fits for r in rows)
  for r in rows[:3]:
    assert r.bubble == pytest.approx(FORMULAS[r.schedule](2, 2, 1)) and r.device_peak > r.temporaries > 0
    assert f"{r.schedule:<17} {r.bubble:7.4f}" in table
  # No pipeline: the same 8 devices as fsdp=8, compiled the same way; its own peak, no bubble, nothing sent
  unpiped = rows[3]
  assert unpiped.device_peak > unpiped.temporaries > 0 and unpiped.bubble == 0 and unpiped.boundary_bytes == 0
  assert unpiped.times.boundary == 0 and unpiped.times.compute < min(r.times.compute for r in rows[:3])
  assert unpiped.device_peak not in [r.device_peak for r in rows[:3]]
  assert f"{schedule_fit.NO_PIPELINE:<17} {0.0:7.4f}" in table
  resolved = schedule_fit.resolved(cfg, schedule_fit.NO_PIPELINE, 8)
  assert (resolved.mesh.fsdp, resolved.mesh.pipeline, resolved.optimizer.microbatch_size) == (8, 1, 2)
  assert kind == min(rows, key=lambda r: r.step_seconds).schedule and f"{kind:<17}" in table.split("<- chosen")[0]
  # 1f1b and zb tick twice per ppermute pair what gpipe iterates: 2 ticks per stage boundary each way
  by = {r.schedule: r for r in rows}
  assert by["1f1b"].boundary_bytes == 2 * by["gpipe"].boundary_bytes
