"""Mixture of experts: the layer against NumPy (routing, capacity drops, combine, losses), dropless
against capacity-based, one expert against the dense MLP, the optimizer routing of expert weights,
the router bias (sign rule, guard skip), routing-collapse detection, and the real trainer with
expert parallelism (expert=4 x fsdp=2 against expert=1) and bitwise resume.

Shape legend: B batch, T length, D model, E experts, K experts per token, F expert hidden width.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from maxtrain import config as config_lib
from maxtrain.optim import optimizer as optim
from maxtrain.cli import train
from maxtrain.errors import UserError
from maxtrain.models import moe as moe_lib
from maxtrain.models import moe_dispatch
from maxtrain.models.layers import MLP
from maxtrain.models.moe import MoE, MoEConfig
from maxtrain.monitor import events as ev
from maxtrain.monitor.routing import RoutingMonitor
from maxtrain.program.plan import validate
from tiny import TINY_MODEL

B, T, D, F = 3, 16, 8, 6


def make_moe(seed=0, **kw) -> MoE:
  cfg = MoEConfig(**{"num_experts": 4, "experts_per_token": 2, "expert_d_ff": F, **kw})
  with nnx.use_eager_sharding(False):
    moe = MoE(D, cfg, init_std=0.5, out_std=0.5, param_dtype=jnp.float32, compute_dtype=jnp.float32,
              rngs=nnx.Rngs(params=seed))
  return moe


call = nnx.jit(lambda moe, x: moe(x))  # one compile instead of op-by-op dispatch


def np_route(x, router, bias, cfg):
  """NumPy router: scores, top-k by score + bias (lower index first among ties), normalised weights."""
  logits = np.einsum("btd,de->bte", x, router).astype(np.float64)
  if cfg.router == "softmax":
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
  else:
    scores = 1 / (1 + np.exp(-logits))
  experts = np.argsort(-(scores + bias), axis=-1, kind="stable")[..., :cfg.experts_per_token]
  chosen = np.take_along_axis(scores, experts, -1)
  return logits, scores, experts, chosen / chosen.sum(-1, keepdims=True)


def np_capacity(experts, num_experts, capacity):
  """Kept mask and positions, filling each sequence's expert queues first choice first, token by token."""
  kept, pos = np.zeros(experts.shape, bool), np.zeros(experts.shape, int)
  for b in range(experts.shape[0]):
    fill = np.zeros(num_experts, int)
    for k in range(experts.shape[2]):
      for t in range(experts.shape[1]):
        e = experts[b, t, k]
        pos[b, t, k], kept[b, t, k] = fill[e], fill[e] < capacity
        fill[e] += 1
  return kept, pos


def np_swiglu(x, gate, up, down):
  g, u = x @ gate, x @ up
  return (g / (1 + np.exp(-g)) * u) @ down


def np_moe(x, moe: MoE, bias):
  cfg = moe.cfg
  w = {n: np.asarray(getattr(moe, n)[...], np.float64) for n in ("router", "gate", "up", "down")}
  _, _, experts, weights = np_route(x, w["router"], bias, cfg)
  kept, _ = np_capacity(experts, cfg.num_experts, cfg.capacity(x.shape[1]))
  if cfg.dispatch == "dropless":
    kept[:] = True
  out = np.zeros(x.shape)
  for b, t, k in zip(*np.nonzero(kept)):
    e = experts[b, t, k]
    out[b, t] += weights[b, t, k] * np_swiglu(x[b, t], w["gate"][e], w["up"][e], w["down"][e])
  return out, kept


@pytest.mark.parametrize("router", moe_lib.ROUTERS)
@pytest.mark.parametrize("dispatch,capacity_factor", [("capacity", 0.75), ("capacity", 1.25), ("dropless", 1.0)])
def test_layer_matches_numpy(router, dispatch, capacity_factor):
  moe = make_moe(router=router, dispatch=dispatch, capacity_factor=capacity_factor)
  rng = np.random.default_rng(1)
  x = rng.standard_normal((B, T, D)).astype(np.float32)
  bias = rng.standard_normal(4).astype(np.float32) * 0.1
  moe.router_bias[...] = jnp.asarray(bias)
  y, stats = call(moe, jnp.asarray(x))
  ref, kept = np_moe(x.astype(np.float64), moe, bias)
  np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-6)
  assert float(stats["dropped"]) == np.sum(~kept)
  if dispatch == "capacity" and capacity_factor < 1:
    assert np.sum(~kept) > 0  # the test exercises drops


def test_routing_and_capacity_slots_match_numpy():
  rng = np.random.default_rng(2)
  cfg = MoEConfig(num_experts=6, experts_per_token=3, router="sigmoid")
  x, router = rng.standard_normal((B, T, D)), rng.standard_normal((D, 6))
  bias = rng.standard_normal(6) * 0.3
  experts, weights, _ = moe_lib.route(jnp.asarray(x, jnp.float32), jnp.asarray(router, jnp.float32),
                                      jnp.asarray(bias, jnp.float32), cfg)
  _, _, ref_experts, ref_weights = np_route(x, router, bias, cfg)
  np.testing.assert_array_equal(np.asarray(experts), ref_experts)  # same experts, in score order
  np.testing.assert_allclose(np.asarray(weights), ref_weights, rtol=1e-5)
  capacity = 5
  slot, kept = moe_dispatch.capacity_slots(experts, 6, capacity)
  ref_kept, ref_pos = np_capacity(ref_experts, 6, capacity)
  np.testing.assert_array_equal(np.asarray(kept), ref_kept)
  np.testing.assert_array_equal(np.asarray(slot), np.where(ref_kept, ref_experts * capacity + ref_pos, 6 * capacity))
  # Dispatch puts each kept token in its slot, zeros elsewhere.
  x_BECD = np.asarray(moe_dispatch.dispatch(jnp.asarray(x, jnp.float32), slot, 6, capacity)).reshape(B, -1, D)
  expected = np.zeros_like(x_BECD)
  for b, t, k in zip(*np.nonzero(ref_kept)):
    expected[b, slot[b, t, k]] = x[b, t]
  np.testing.assert_allclose(x_BECD, expected, rtol=1e-6)


@pytest.mark.parametrize("router", moe_lib.ROUTERS)
def test_aux_and_z_loss_match_numpy(router):
  rng = np.random.default_rng(3)
  cfg = MoEConfig(num_experts=5, experts_per_token=2, router=router)
  x, router_w = rng.standard_normal((B, T, D)), rng.standard_normal((D, 5))
  _, _, stats = moe_lib.route(jnp.asarray(x, jnp.float32), jnp.asarray(router_w, jnp.float32), jnp.zeros(5), cfg)
  logits, scores, experts, _ = np_route(x, router_w, np.zeros(5), cfg)
  f = np.bincount(experts.ravel(), minlength=5) / experts.size
  p = (scores / scores.sum(-1, keepdims=True)).mean(axis=(0, 1))
  lse = np.log(np.exp(logits).sum(-1))
  np.testing.assert_allclose(float(stats["aux"]), 5 * np.sum(f * p), rtol=1e-5)
  np.testing.assert_allclose(float(stats["z"]), np.mean(lse ** 2), rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(stats["load"]), np.bincount(experts.ravel(), minlength=5))


def test_dropless_equals_capacity_when_nothing_drops():
  x = jnp.asarray(np.random.default_rng(4).standard_normal((B, T, D)), jnp.float32)
  capacity = make_moe(dispatch="capacity", capacity_factor=4.0)  # C = T: nothing can drop
  dropless = make_moe(dispatch="dropless")
  y_cap, stats = call(capacity, x)
  assert float(stats["dropped"]) == 0
  np.testing.assert_allclose(np.asarray(call(dropless, x)[0]), np.asarray(y_cap), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dispatch", moe_lib.DISPATCHES)
@pytest.mark.parametrize("router", moe_lib.ROUTERS)
def test_one_expert_top1_is_the_dense_mlp(dispatch, router):
  moe = make_moe(num_experts=1, experts_per_token=1, dispatch=dispatch, router=router, capacity_factor=1.0)
  with nnx.use_eager_sharding(False):
    mlp = MLP(D, F, init_std=0.5, out_std=0.5, param_dtype=jnp.float32, compute_dtype=jnp.float32,
              rngs=nnx.Rngs(params=5))
  for name in ("gate", "up", "down"):
    getattr(moe, name)[...] = getattr(mlp, name)[...][None]
  x = jnp.asarray(np.random.default_rng(5).standard_normal((B, T, D)), jnp.float32)
  # fp32 parity at the repository's usual tolerances: the two sum their products in different orders.
  np.testing.assert_allclose(np.asarray(call(moe, x)[0]), np.asarray(mlp(x)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sizes", [{"data": 1, "fsdp": 2, "expert": 4, "tensor": 1},
                                   {"data": 2, "fsdp": 1, "expert": 2, "tensor": 2}])
def test_expert_parallel_dispatch_matches_one_device(sizes):
  """sharding/expert_dispatch.py under shard_map on 8 devices against the plain path: outputs and the
  gradients of inputs, routing weights and expert weights (FSDP, data and tensor axes included)."""
  from maxtrain.sharding import expert_dispatch
  from maxtrain.sharding.mesh import make_mesh
  from maxtrain.sharding.rules import DEFAULT_RULES

  rng = np.random.default_rng(9)
  E, C = 4, 6
  x = jnp.asarray(rng.standard_normal((8, T, D)), jnp.float32)  # one sequence per batch shard
  experts, weights, _ = moe_lib.route(x, jnp.asarray(rng.standard_normal((D, E)), jnp.float32), jnp.zeros(E),
                                      MoEConfig(num_experts=E, experts_per_token=2))
  slot, kept = moe_dispatch.capacity_slots(experts, E, C)
  assert not np.all(kept)  # some assignments drop
  gate, up = (jnp.asarray(rng.standard_normal((E, D, F)), jnp.float32) for _ in range(2))
  down = jnp.asarray(rng.standard_normal((E, F, D)), jnp.float32)
  cotangent = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

  def plain(x, w, g, u, d):
    return moe_dispatch.combine(moe_dispatch.experts_ffn(moe_dispatch.dispatch(x, slot, E, C), g, u, d), slot, w)

  def value_and_grads(fn):
    return jax.jit(lambda *a: jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * cotangent), argnums=(0, 1, 2, 3, 4))(*a))

  ref = value_and_grads(plain)(x, weights, gate, up, down)
  mesh = make_mesh(sizes)
  parallel = expert_dispatch.sharded(mesh, DEFAULT_RULES, local=moe_dispatch.LOCAL, num_experts=E, capacity=C)
  with jax.set_mesh(mesh):
    got = value_and_grads(lambda x, w, g, u, d: parallel(x, slot, w, g, u, d))(x, weights, gate, up, down)
  for a, b, name in zip(jax.tree.leaves(got), jax.tree.leaves(ref), ("loss", "dx", "dweights", "dgate", "dup", "ddown")):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=name)


def test_validation_names_the_keys():
  def plan(*args):
    return validate(config_lib.load(TINY_MODEL + list(args)), 8, require_data=False)

  moe = ["--config.model.moe.num_experts=4"]
  with pytest.raises(UserError, match=r"model.moe.experts_per_token=5: must be in 1..model.moe.num_experts=4"):
    plan(*moe, "--config.model.moe.experts_per_token=5")
  with pytest.raises(UserError, match=r"model.moe.router='top'"):
    plan(*moe, "--config.model.moe.router=top")
  with pytest.raises(UserError, match=r"first_dense_layers=2: must be in 0..model.num_layers-1=1"):
    plan(*moe, "--config.model.moe.first_dense_layers=2")
  ep = ["--config.mesh.expert=4", "--config.mesh.fsdp=2"]
  with pytest.raises(UserError, match=r"splits experts over mesh.expert=4, but config.model.moe.num_experts=0"):
    plan(*ep)
  with pytest.raises(UserError, match=r"routes whole sequences per device"):
    plan("--config.mesh.expert=2", "--config.mesh.context=2", "--config.mesh.fsdp=2", *moe)
  assert plan(*ep, *moe).layout.shards("experts") == 4


MOE_ARGS = ["--config.model.moe.num_experts=4", "--config.model.moe.expert_d_ff=16"]


# ---- optimizer --------------------------------------------------------------------------------------

def moe_params(scan: bool = True):
  from maxtrain.models.llama import Llama, ModelConfig

  cfg = ModelConfig(num_layers=3, d_model=16, num_heads=2, num_kv_heads=2, d_ff=32, vocab_size=32, max_seq_len=16,
                    scan_layers=scan, moe=MoEConfig(num_experts=4, expert_d_ff=8, first_dense_layers=1,
                                                    num_shared_experts=1))
  abstract = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(params=0))))[1]
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)  # shapes are all these tests need


def test_optimizer_routes_every_moe_parameter():
  from maxtrain.sharding.layout import param_name

  params = moe_params()
  labels = {param_name(p): l for p, l in jax.tree_util.tree_leaves_with_path(optim.param_labels(params, "muon"))}
  moe_labels = {k.removeprefix("moe_blocks/"): v for k, v in labels.items() if k.startswith("moe_blocks/moe/")}
  assert moe_labels == {"moe/gate": "muon", "moe/up": "muon", "moe/down": "muon", "moe/router": "adam",
                        "moe/router_bias": "none", "moe/shared/gate": "muon", "moe/shared/up": "muon",
                        "moe/shared/down": "muon"}
  assert labels["blocks/mlp/gate"] == "muon"
  unscanned = optim.param_labels(moe_params(scan=False), "adamw")
  assert {param_name(p): l for p, l in jax.tree_util.tree_leaves_with_path(unscanned)}["moe_blocks/1/moe/router_bias"] == "none"


def test_muon_orthogonalises_each_expert_on_its_own():
  cfg = config_lib.base_config().optimizer
  cfg.name, cfg.weight_decay, cfg.clip_norm, cfg.warmup_steps = "muon", 0.0, 0.0, 0
  tx = optim.make(cfg, 10).tx
  from flax import nnx

  from maxtrain.models.moe import RouterBias

  def var(x, axes, kind=nnx.Param):  # routing reads the logical axes the model gives its variables
    with nnx.use_eager_sharding(False):
      return kind(jnp.asarray(x), out_sharding=axes)

  rng = np.random.default_rng(6)
  raw = {"gate": rng.standard_normal((2, 3, 8, 5)).astype(np.float32),
         "router": rng.standard_normal((2, 8, 3)).astype(np.float32), "router_bias": rng.standard_normal((2, 3))}
  grads = {"moe_blocks": {"moe": {"gate": var(raw["gate"], ("layers", "experts", "expert_embed", "expert_mlp")),
                                  "router": var(raw["router"], ("layers", "embed", "router_experts")),
                                  "router_bias": var(raw["router_bias"].astype(np.float32), ("layers", "router_experts"),
                                                     RouterBias)}}}
  params = jax.tree.map(jnp.zeros_like, grads)
  updates, _ = tx.update(grads, tx.init(params), params)
  gate = np.asarray(updates["moe_blocks"]["moe"]["gate"][...])
  for layer in range(2):
    for e in range(3):
      alone = {"blocks": {"mlp": {"gate": var(raw["gate"][layer, e], ("embed", "mlp"))}}}
      ref, _ = tx.update(alone, tx.init(jax.tree.map(jnp.zeros_like, alone)), alone)
      np.testing.assert_allclose(gate[layer, e], np.asarray(ref["blocks"]["mlp"]["gate"][...]), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(updates["moe_blocks"]["moe"]["router_bias"][...]), 0.0)  # never trained
  assert np.all(np.asarray(updates["moe_blocks"]["moe"]["router"][...]) != 0)  # AdamW


def test_flops_and_estimate_count_active_parameters():
  from maxtrain.aot import estimate as estimate_lib
  from maxtrain.models.llama import ModelConfig

  L, D, N, F, V, T, E, K, S, FE = 3, 32, 4, 64, 256, 32, 8, 2, 1, 16
  cfg = config_lib.load(TINY_MODEL + [f"--config.model.vocab_size={V}", "--config.model.moe.num_experts=8",
                                      "--config.model.moe.experts_per_token=2", "--config.model.moe.num_shared_experts=1",
                                      "--config.model.moe.expert_d_ff=16", "--config.model.moe.first_dense_layers=1",
                                      "--config.model.num_layers=3", "--config.mesh.fsdp=2", "--config.mesh.expert=4"])
  attention = 4 * D * D  # wq, wk, wv, wo (4 kv heads of 8)
  matmul = L * attention + 1 * 3 * D * F + 2 * (D * E + 3 * D * FE * (K + S)) + D * V
  assert ModelConfig.from_config(cfg.model).train_flops_per_token(T) == 6 * matmul + L * 6 * N * (D // N) * (T + 1)
  est = estimate_lib.estimate(cfg, 8)
  routed = 2 * 3 * E * D * FE
  assert est.params["active"] == est.params["total"] - routed * (E - K) // E
  assert est.params["total"] == 2 * V * D + D + L * (attention + 2 * D) + 3 * D * F + 2 * (D * E + E + 3 * D * FE * (E + S))


def test_microbatches_weight_the_moe_losses_by_their_loss_tokens():
  from maxtrain.program import microbatch, step as step_lib
  from maxtrain.models.llama import Llama, ModelConfig

  moe = MoEConfig(num_experts=4, expert_d_ff=8, aux_loss_weight=0.5, router_z_loss_weight=0.25)
  cfg = ModelConfig(num_layers=2, d_model=16, num_heads=2, num_kv_heads=2, d_ff=32, vocab_size=32, max_seq_len=16,
                    moe=moe)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(params=0))))
  rng = np.random.default_rng(8)  # random weights: the model's own init would cost a compile
  params = jax.tree.map(lambda s: jnp.asarray(0.2 * rng.normal(size=s.shape), s.dtype), abstract)
  n, t = 4, 16
  mask = (rng.random((n, t)) < np.array([[0.9], [0.3], [0.6], [0.5]])).astype(np.float32)  # uneven loss tokens
  batch = {"inputs": rng.integers(0, 32, (n, t)).astype(np.int32), "targets": rng.integers(0, 32, (n, t)).astype(np.int32),
           "segment_ids": np.ones((n, t), np.int32), "positions": np.arange(t, dtype=np.int32)[None].repeat(n, 0),
           "loss_mask": mask}
  run = jax.jit(lambda p, b, k: step_lib.loss_and_grads(graphdef, p, b, grad_accum_steps=k), static_argnums=2)
  metrics, grads = run(params, batch, 2)
  # Reference: each microbatch alone (k=1), weighted by its loss tokens.
  parts = [run(params, jax.tree.map(lambda x, i=i: microbatch.split(x, 2)[i], batch), 1) for i in range(2)]
  counts = [float(m["loss_tokens"]) for m, _ in parts]
  for key in ("moe/aux_loss", "moe/router_z_loss", "loss"):
    expected = sum(c * float(m[key]) for c, (m, _) in zip(counts, parts)) / sum(counts)
    np.testing.assert_allclose(float(metrics[key]), expected, rtol=1e-5, err_msg=key)
  # The gradient is that of the token-weighted objective, auxiliary terms included.
  expected_grads = jax.tree.map(lambda *g: sum(c * x for c, x in zip(counts, g)) / sum(counts), *[g for _, g in parts])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), grads, expected_grads)
  np.testing.assert_array_equal(metrics["moe_load"], parts[0][0]["moe_load"] + parts[1][0]["moe_load"])


# ---- router bias ------------------------------------------------------------------------------------

def test_router_bias_sign_rule_in_scanned_and_unscanned_models():
  load = jnp.asarray([[10.0, 2.0, 6.0, 6.0], [1.0, 1.0, 1.0, 9.0]])  # 2 MoE layers, mean 6 and 3
  for scan in (True, False):
    new = moe_lib.update_router_bias(moe_params(scan), load, 0.5)
    bias = [np.asarray(leaf) for p, leaf in jax.tree_util.tree_leaves_with_path(new)
            if "router_bias" in jax.tree_util.keystr(p)]
    np.testing.assert_array_equal(np.stack(bias).reshape(2, 4), [[-0.5, 0.5, 0.0, 0.0], [0.5, 0.5, 0.5, -0.5]])


def test_router_bias_follows_the_load_and_a_skipped_step_keeps_it():
  from maxtrain.program import build as program_lib, state as state_lib
  from maxtrain.runtime import faults
  from maxtrain.sharding.mesh import make_mesh

  cfg = config_lib.load(TINY_MODEL + MOE_ARGS + ["--config.mesh.fsdp=1", "--config.model.moe.bias_update_rate=0.25",
                                                 "--config.faults.nan_at_step=2"])  # drilled: the step takes a fault input
  plan = validate(cfg, 1, require_data=False)
  program = program_lib.build(cfg, plan, mesh=make_mesh(plan.mesh, jax.devices()[:1]))
  rng = np.random.default_rng(7)
  rows = {k: v for k, v in program.abstract_batch().items() if k != faults.INPUT}
  batch = {k: jnp.asarray(rng.integers(1, 3 if k == "segment_ids" else 200, a.shape).astype(a.dtype))
           for k, a in rows.items()}
  bias = lambda state: np.asarray(state.params["moe_blocks"]["moe"]["router_bias"][...])
  with jax.set_mesh(program.mesh):
    state = state_lib.initialize(program.state, program.mesh)
    state, metrics = program.train_step(state, {**batch, faults.INPUT: jnp.asarray([0.0, 1.0])})
    first = bias(state)
    # One sign step from zero (0 for an expert exactly at the mean load); the rule itself is tested above.
    assert set(np.abs(first).ravel()) <= {0.0, 0.25} and np.sum(np.abs(first) > 0) >= 6
    assert "moe_load" not in metrics and metrics["moe/load_entropy"].shape == (2,)
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = program.train_step(state, {**batch, faults.INPUT: jnp.asarray([1.0, 1.0])})  # NaN step
  assert int(metrics["nonfinite"]) == 1
  np.testing.assert_array_equal(bias(state), first)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params), before)


def test_routing_collapse_fires_once_per_episode(tmp_path):
  log = ev.EventLog(tmp_path / "events.jsonl")
  monitor = RoutingMonitor(log, threshold=0.5, steps=20)
  seen = [monitor.check(step, {"moe/load_entropy": [0.9, entropy]})
          for step, entropy in ((10, 0.2), (20, 0.3), (30, 0.1), (40, 0.1), (50, 0.8), (60, 0.1), (80, 0.1))]
  assert seen == [[], [], [1], [], [], [], [1]]
  records = [r for r in ev.read_events(tmp_path / "events.jsonl") if r["kind"] == ev.ROUTING_COLLAPSE]
  assert [(r["step"], r["layer"], r["since_step"]) for r in records] == [(30, 1, 10), (80, 1, 60)]
  assert monitor.check(90, {"loss": 1.0}) == []  # a dense model has no entropy metric


# ---- the trainer: expert parallelism, checkpoints, bitwise resume ------------------------------------
# Capacity 1.0 drops assignments (so the drops must match across meshes too); the router bias moves.
MOE = ["--config.model.moe.num_experts=4", "--config.model.moe.expert_d_ff=16", "--config.model.moe.capacity_factor=1.0",
       "--config.model.moe.bias_update_rate=0.01", "--config.model.moe.num_shared_experts=1"]
TINY = TINY_MODEL + MOE + ["--config.data.seq_len=64", "--config.eval.every_steps=0", "--config.log_every=1",
                           "--config.model.moe.collapse_entropy=1.0", "--config.model.moe.collapse_steps=5",
                           "--config.checkpoint.every_steps=10", "--config.optimizer.decay_steps=20"]
EXPERT_1 = ["--config.mesh.fsdp=8"]
EXPERT_4 = ["--config.mesh.fsdp=2", "--config.mesh.expert=4"]
MOE_TAGS = ("train/moe/aux_loss", "train/moe/router_z_loss", "train/moe/dropped_fraction",
            "train/moe/load_entropy/layer_0", "train/moe/max_load/layer_1", "train/moe/dropped",
            "train/moe/capacity_needed/layer_1", "train/moe/expert_load/layer_0/expert_3")


def scalars(out, tag):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  events = EventAccumulator(str(out / "tensorboard"))
  events.Reload()
  return {e.step: e.value for e in events.Scalars(tag)}


@pytest.mark.slow
def test_expert4_trains_like_expert1_and_its_checkpoint_restores_elsewhere(store, tmp_path, monkeypatch):
  from maxtrain.sharding import expert_dispatch
  from test_checkpoint import assert_bitwise_equal, losses, restore_raw

  traced = []
  sharded = expert_dispatch.sharded
  monkeypatch.setattr(expert_dispatch, "sharded", lambda mesh, rules, **kw: traced.append(mesh.shape["expert"]) or
                      sharded(mesh, rules, **kw))

  def run(name, mesh):
    code = train.main(TINY + mesh + [f"--config.data.path={store}", "--config.steps=20",
                                     f"--config.output_dir={tmp_path / name}"])
    assert code == 0, name

  run("one", EXPERT_1)
  assert traced == []
  # Every layer is "collapsed" under threshold 1.0 (entropy < 1 unless perfectly balanced): one event each.
  collapses = [r for r in ev.read_events(tmp_path / "one" / ev.FILENAME) if r["kind"] == ev.ROUTING_COLLAPSE]
  assert sorted(r["layer"] for r in collapses) == [0, 1] and all(r["step"] == 6 for r in collapses)
  run("four", EXPERT_4)
  assert traced and set(traced) == {4}
  ref, got = losses(tmp_path / "one"), losses(tmp_path / "four")
  assert sorted(got) == sorted(ref) == list(range(1, 21))
  np.testing.assert_allclose([got[s] for s in ref], [ref[s] for s in ref], rtol=1e-5)
  for tag in MOE_TAGS:
    a, b = scalars(tmp_path / "one", tag), scalars(tmp_path / "four", tag)
    np.testing.assert_allclose([b[s] for s in a], list(a.values()), rtol=1e-5, atol=1e-7, err_msg=tag)
  assert max(scalars(tmp_path / "one", "train/moe/dropped_fraction").values()) > 0  # drops happened
  # All-to-all bytes: none on one expert shard; on four, capacity's whole slot buffers every step (the same).
  assert set(scalars(tmp_path / "one", "train/moe/all_to_all_bytes").values()) == {0.0}
  assert len(set(scalars(tmp_path / "four", "train/moe/all_to_all_bytes").values()) - {0.0}) == 1
  saved = restore_raw(tmp_path / "four" / "checkpoints", 20)
  ref_params = restore_raw(tmp_path / "one" / "checkpoints", 20)["params"]
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(saved["params"]), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
  bias = saved["params"]["moe_blocks"]["moe"]["router_bias"]["value"]
  assert np.any(bias != 0)
  _restore_onto_other_meshes(tmp_path / "four" / "checkpoints", saved, assert_bitwise_equal)


def _restore_onto_other_meshes(ckpt_dir, saved, assert_bitwise_equal):
  from maxtrain.program import state as state_lib
  from maxtrain.checkpoint.storage import Checkpointer
  from maxtrain.models.llama import ModelConfig
  from maxtrain.sharding.mesh import make_mesh

  cfg = config_lib.load(TINY)
  model_cfg, tx = ModelConfig.from_config(cfg.model), optim.make(cfg.optimizer, 20).tx
  ckpt = Checkpointer(cfg.checkpoint, str(ckpt_dir))
  for sizes, devices in (({"data": 1, "fsdp": 4, "expert": 2, "tensor": 1}, jax.devices()),
                         ({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])):
    mesh = make_mesh(sizes, devices)
    spec = state_lib.spec(model_cfg, tx, mesh, seed=0)
    restored = ckpt.restore(ckpt_dir / "20", spec.abstract, spec.shardings)
    assert restored.meta["mesh"]["expert"] == 4
    gate = restored.state.params["moe_blocks"]["moe"]["gate"][...]
    assert gate.sharding.shard_shape(gate.shape)[1] == 4 // sizes.get("expert", 1)
    assert_bitwise_equal(jax.tree.map(np.asarray, restored.state), saved)
  ckpt.close()


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["muon"])  # per-expert Newton-Schulz state; AdamW's resume: test_checkpoint
def test_moe_resume_is_bitwise_identical(store, tmp_path, optimizer):
  from test_checkpoint import OPTIMIZERS, assert_bitwise_equal, losses, restore_raw

  base = TINY + EXPERT_4 + OPTIMIZERS[optimizer] + [f"--config.data.path={store}", "--config.checkpoint.every_steps=4",
                                                    "--config.optimizer.decay_steps=8"]

  def run(name, steps):
    assert train.main(base + [f"--config.output_dir={tmp_path / name}", f"--config.steps={steps}"]) == 0

  run("a", 8)
  run("b", 4)  # stops after step 4; the second trainer resumes its checkpoint
  run("b", 8)
  final_a, final_b = restore_raw(tmp_path / "a/checkpoints", 8), restore_raw(tmp_path / "b/checkpoints", 8)
  assert_bitwise_equal(final_a, final_b)  # parameters, router biases, optimizer state, guard, step
  assert np.any(final_a["params"]["moe_blocks"]["moe"]["router_bias"]["value"] != 0)
  assert losses(tmp_path / "b") == losses(tmp_path / "a")
  assert sorted(losses(tmp_path / "a")) == list(range(1, 9))
