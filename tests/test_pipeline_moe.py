"""MoE layers under the pipeline (sharding/pipeline.py, sharding/schedules.py): a model with a dense first layer
(run before the pipeline on every stage) and MoE layers split over 2 stages, their experts over `expert` = 2 inside
each stage (fsdp = 2), trains like the model without a pipeline under gpipe and 1f1b: the same per-step losses,
the same MoE metrics (balance and z losses of the whole batch, per-expert load, drops, the capacity that drops
nothing) and the same aux-loss-free router bias, and the gpipe run resumes bitwise. The balance loss is a product of two batch means: under gpipe its
gradient is autodiff's through the statistics summed over microbatches (checked on a toy stack against the
unpipelined scan); the other schedules refuse its weight. Each run compiles once (the `runs` fixture)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from maxtrain.checkpoint.identity import run_meta
from maxtrain.checkpoint.storage import Checkpointer
from maxtrain.config import loader as config_lib
from maxtrain.errors import UserError
from maxtrain.models import moe as moe_lib
from maxtrain.program import batch as batch_lib
from maxtrain.program import build as build_lib
from maxtrain.program import state as state_lib
from maxtrain.program.plan import validate
from maxtrain.sharding import pipeline as pipeline_lib
from maxtrain.sharding.layout import param_name
from tiny import TINY_MODEL

STEPS = 10
# 1 dense + 2 MoE layers (capacity dispatch: it drops), aux-loss-free balancing and the router z-loss; the balance
# loss's weight is 0 in every run so that 1f1b runs the same objective (its value is still reported and compared).
MODEL = TINY_MODEL + ["--config.model.num_layers=3", "--config.model.d_model=64", "--config.data.batch_size=16",
                      "--config.optimizer.warmup_steps=1", "--config.model.moe.num_experts=4",
                      "--config.model.moe.expert_d_ff=32", "--config.model.moe.first_dense_layers=1",
                      "--config.model.moe.num_shared_experts=1", "--config.model.moe.capacity_factor=1.0",
                      "--config.model.moe.bias_update_rate=0.01", "--config.model.moe.aux_loss_weight=0",
                      "--config.model.moe.router_z_loss_weight=0.01"]
COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
PIPELINE = ["--config.mesh.pipeline=2", "--config.mesh.fsdp=2", "--config.mesh.expert=2",
            "--config.pipeline.microbatches=4"]
MESHES = {"reference": ["--config.mesh.fsdp=4", "--config.mesh.expert=2"],
          "gpipe": PIPELINE + ["--config.model.remat=full"],
          "1f1b": PIPELINE + ["--config.pipeline.schedule=1f1b"]}
# moe/all_to_all_bytes is left out: dropless dispatch counts the rows that leave their device, which depends on
# which device holds which token (the meshes differ); capacity dispatch's figure is compared (shapes only).
METRICS = ("loss", "moe/aux_loss", "moe/router_z_loss", "moe/dropped", "moe/dropped_fraction",
           "moe/all_to_all_bytes", "moe/expert_load", "moe/capacity_needed", "moe/load_entropy", "moe/max_load")


def _batches(cfg, n):
  rng = np.random.default_rng(0)
  b, t = cfg.data.batch_size, cfg.data.seq_len
  out = []
  for _ in range(n):
    tokens = rng.integers(0, 16, size=(b, t + 1), dtype=np.int32)
    segments = np.ones((b, t), np.int32)
    segments[:, t // 2:] = 2
    positions = np.concatenate([np.arange(t // 2), np.arange(t - t // 2)]).astype(np.int32)[None].repeat(b, 0)
    out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments,
                "positions": positions, "loss_mask": (rng.random((b, t)) > 0.1).astype(np.float32)})
  return out


def _train(args):
  """(program, per-step metrics, the parameters after STEPS steps, the state then (numpy), a function of a state:
  the loss of one more step on the next batch)."""
  cfg = config_lib.load(MODEL + args)
  program = build_lib.program_for(cfg, jax.devices(), require_data=False)
  compiled = program.lower().compile(compiler_options=COMPILE)
  rows, metrics = _batches(cfg, STEPS + 1), []
  with jax.set_mesh(program.mesh):
    state = state_lib.initialize(program.state, program.mesh)
    for i in range(STEPS):
      state, m = compiled(state, batch_lib.to_device(rows[i], program.batch_shardings))
      metrics.append({k: np.asarray(v) for k, v in m.items()})
  saved = jax.tree.map(np.asarray, state)

  def next_loss(state):
    with jax.set_mesh(program.mesh):
      return float(compiled(jax.device_put(state, program.state.shardings),
                            batch_lib.to_device(rows[STEPS], program.batch_shardings))[1]["loss"])
  return program, metrics, saved.params, saved, next_loss


@pytest.fixture(scope="module")
def runs():
  return {name: _train(args) for name, args in MESHES.items()}


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_moe_pipeline_trains_like_no_pipeline(runs, name):
  _, ref, ref_params, _, _ = runs["reference"]
  program, run, params, _, _ = runs[name]
  assert program.plan.pipeline.stages == 2 and program.plan.pipeline.kind == name
  np.testing.assert_allclose([m["loss"] for m in run], [m["loss"] for m in ref], rtol=1e-5)
  assert ref[-1]["loss"] < ref[0]["loss"] and ref[-1]["moe/dropped"] > 0  # it trains, and capacity drops tokens
  for key in METRICS:
    got, want = np.stack([m[key] for m in run]), np.stack([m[key] for m in ref])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.max(np.abs(want)), err_msg=key)
  named = lambda tree: {param_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
  got, want = named(params), named(ref_params)
  assert got.keys() == want.keys() and any(moe_lib.is_router_bias(k) for k in got)
  for k in want:  # the router bias moved by the same loads, the weights by the same gradients
    np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_dense_first_layers_are_held_by_every_stage_and_moe_layers_split(runs):
  program = runs["gpipe"][0]
  shardings = {param_name(p): s for p, s in jax.tree_util.tree_flatten_with_path(program.state.shardings.params)[0]}
  dense = [s.spec for k, s in shardings.items() if k.startswith("blocks/")]
  moe = [s.spec for k, s in shardings.items() if k.startswith("moe_blocks/") and not moe_lib.is_router_bias(k)]
  assert dense and all(spec[0] is None for spec in dense)
  assert moe and all(spec[0] == "pipeline" for spec in moe)


def test_moe_pipeline_resumes_bitwise(runs, tmp_path):
  """The gpipe run's state (the router bias included) saves and restores bitwise, and its next step gives the loss
  it gave without the round trip, exactly."""
  program, _, _, saved, next_loss = runs["gpipe"]
  ckpt = Checkpointer(program.cfg.checkpoint, str(tmp_path))
  with jax.set_mesh(program.mesh):
    ckpt.save(STEPS, jax.device_put(saved, program.state.shardings), {}, run_meta(program.cfg, dict(program.mesh.shape)))
  ckpt.close()
  ckpt = Checkpointer(program.cfg.checkpoint, str(tmp_path / "restore"))
  restored = ckpt.restore(tmp_path / str(STEPS), program.state.abstract, program.state.shardings)
  ckpt.close()
  assert restored.step == STEPS
  state = jax.tree.map(np.asarray, restored.state)
  jax.tree.map(np.testing.assert_array_equal, state, saved)
  assert next_loss(state) == next_loss(saved)


def test_summed_statistics_give_the_full_batch_aux_and_z():
  """`from_sums` of the microbatches' `summable` statistics is `route`'s aux and z on the whole batch (a mean of
  the microbatches' aux is not: it is a product of two means)."""
  cfg = moe_lib.MoEConfig(num_experts=4, experts_per_token=2)
  rng = np.random.default_rng(1)
  x_BTD = jnp.asarray(rng.normal(size=(8, 16, 32)), jnp.float32)
  router_DE = jnp.asarray(rng.normal(size=(32, 4)) * 0.3, jnp.float32)
  bias_E = jnp.zeros((4,), jnp.float32)
  route = jax.jit(lambda x_BTD: moe_lib.route(x_BTD, router_DE, bias_E, cfg)[2])
  whole = route(x_BTD)
  parts = [moe_lib.summable(route(x_BTD[i::4])) for i in range(4)]
  summed = {k: (jnp.max if k.endswith("_max") else jnp.sum)(jnp.stack([p[k] for p in parts]), axis=0)[None]
            for k in parts[0]}
  got = moe_lib.from_sums(summed)
  for key in ("aux", "z", "load", "assignments", "capacity_needed"):
    np.testing.assert_allclose(got[key][0], whole[key], rtol=1e-6, err_msg=key)
  per_microbatch = np.mean([route(x_BTD[i::4])["aux"] for i in range(4)])
  assert abs(per_microbatch - whole["aux"]) > 1e-4  # the statistic that needs the sums


def test_gpipe_differentiates_a_product_of_batch_sums_like_the_scan():
  """pipeline.run's statistics, summed over microbatches and stages, carry autodiff's gradient of a function that
  is not a sum over microbatches (aux's shape: sum_e load_e x probs_e): equal to the plain scan's on the batch."""
  mesh = jax.make_mesh((2, 4), ("pipeline", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rng = np.random.default_rng(2)
  w_LDD = jnp.asarray(rng.normal(size=(4, 8, 8)) * 0.3, jnp.float32)
  x_BTD = jnp.asarray(rng.normal(size=(8, 4, 8)), jnp.float32)
  ids_BT = jnp.ones((8, 4), jnp.int32)

  def layer(w_DD, x_BTD):
    y_BTD = jnp.tanh(x_BTD @ w_DD)
    probs_BTE = jax.nn.softmax(y_BTD[..., :4], axis=-1)
    load_E = jax.lax.stop_gradient(jnp.sum(jax.nn.one_hot(jnp.argmax(y_BTD[..., :4], -1), 4), axis=(0, 1)))
    return y_BTD, {"probs": jnp.sum(probs_BTE, axis=(0, 1)), "load": load_E}

  def objective(sums, y_BTD):
    return jnp.sum(sums["load"] * sums["probs"]) / 1e3 + jnp.sum(y_BTD ** 2)

  def plain(w_LDD):
    y_BTD, stats = jax.lax.scan(lambda x, w: layer(w, x), x_BTD, w_LDD)
    return objective(stats, y_BTD)

  def group(stage, r, x_BTD, *_):
    return jax.lax.scan(lambda x, w: layer(w[r], x), x_BTD, stage)

  def piped(w_LDD):
    y_BTD, sums = pipeline_lib.run(group, w_LDD, x_BTD, ids_BT, ids_BT, pipeline_lib.Schedule(2, 4, 2))
    return objective(sums, y_BTD)

  with jax.set_mesh(mesh):
    w = jax.device_put(w_LDD, jax.sharding.NamedSharding(mesh, P("pipeline")))
    want, got = jax.jit(jax.value_and_grad(plain))(w_LDD), jax.jit(jax.value_and_grad(piped))(w)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("args, message", [
    (["--config.model.num_layers=4"], "the 3 MoE layers (config.model.num_layers=4 - model.moe.first_dense_layers=1"),
    (["--config.pipeline.schedule=1f1b", "--config.model.moe.aux_loss_weight=0.01"],
     "config.pipeline.schedule='1f1b' with model.moe.aux_loss_weight=0.01"),
    (["--config.pipeline.schedule=zb", "--config.model.moe.aux_loss_weight=0.001"],
     "config.pipeline.schedule='zb' with model.moe.aux_loss_weight=0.001"),
])
def test_moe_pipeline_settings_that_cannot_run_are_refused_before_compiling(args, message):
  with pytest.raises(UserError, match=re.escape(message)):
    validate(config_lib.load(MODEL + PIPELINE + args), 8, require_data=False)


def test_the_deepseek_v3_preset_plans_a_moe_pipeline_with_experts_inside_stages():
  """configs/deepseek_v3_671b.py on 32 H200 nodes: 2 stages of 29 MoE layers, the 3 dense ones before them, experts
  over each node's 8 GPUs (its AOT fit: docs/fitting.md)."""
  cfg = config_lib.load(["--config=configs/deepseek_v3_671b.py", "--config.hardware=h200x8"])
  plan = validate(cfg, 256, require_data=False)
  assert (plan.pipeline.stages, plan.pipeline.kind, plan.pipeline.microbatches) == (2, "gpipe", 8)
  assert plan.layout.shards("experts") == 8 and plan.layout.shards("layers") == 2
  assert plan.layout.shards("dense_layers") == 1 and cfg.model.moe.first_dense_layers == 3



@pytest.mark.parametrize("aux_loss_weight", [0.0, 0.01])
def test_auto_offers_only_the_schedules_the_plan_accepts_for_a_moe_model(aux_loss_weight):
  """pipeline.schedule=auto (program/schedule_fit.py) compiles only candidates the plan accepts: with a balance
  loss weight, gpipe alone (the plan refuses 1f1b and zb); without one, all three."""
  from maxtrain.program import schedule_fit

  cfg = config_lib.load(MODEL + PIPELINE + [f"--config.model.moe.aux_loss_weight={aux_loss_weight}",
                                            "--config.pipeline.schedule=auto"])
  accepted = []
  for kind in ("gpipe", "1f1b", "zb"):
    try:
      validate(schedule_fit._with_schedule(cfg, kind), 8, require_data=False)
      accepted.append(kind)
    except UserError:
      pass
  offered = schedule_fit.candidates(cfg.pipeline.repeats, cfg.pipeline.microbatches, 2, schedule_fit.balance_loss(cfg))
  assert offered == accepted == (["gpipe"] if aux_loss_weight else ["gpipe", "1f1b", "zb"])
