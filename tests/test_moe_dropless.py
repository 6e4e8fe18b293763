"""Dropless expert parallelism (sharding/ragged_dispatch.py): the exchange's offsets and sizes and the
padded transport against a NumPy model of `lax.ragged_all_to_all`'s documented semantics, the layer under
shard_map on 8 devices against the single-device dropless path (values and gradients), the ragged
transport traced and lowered (XLA:CPU cannot compile it), `mesh.dcn_expert`, and the trainer's step:
dropless expert=4 (and expert=2 x dcn_expert=2) = expert=1 over 20 steps, = capacity dispatch with a
capacity that drops nothing, and under a skewed router capacity drops and dropless does not (metrics).

Shape legend: B batch, T length, D model, E experts, K experts per token, F expert hidden width, X expert
shards, El local experts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from maxtrain import config as config_lib
from maxtrain.errors import UserError
from maxtrain.models import moe as moe_lib
from maxtrain.models import moe_dispatch
from maxtrain.models.moe import MoEConfig
from maxtrain.program.plan import validate
from maxtrain.sharding import ragged_dispatch
from maxtrain.sharding.mesh import make_mesh
from maxtrain.sharding.rules import DEFAULT_RULES
from tiny import TINY_MODEL

T, D, F = 16, 8, 6


def np_ragged_all_to_all(operands, outputs, input_offsets, send_sizes, output_offsets, recv_sizes):
  """`lax.ragged_all_to_all` over X devices as its docstring states it: device i's slice j
  (operand[input_offsets[i][j]:][:send_sizes[i][j]]) lands in device j's output at output_offsets[i][j]."""
  X = len(operands)
  results = [o.copy() for o in outputs]
  for i in range(X):
    for j in range(X):
      n = send_sizes[i][j]
      assert n == recv_sizes[j][i]  # the caller's contract
      results[j][output_offsets[i][j]:output_offsets[i][j] + n] = operands[i][input_offsets[i][j]:][:n]
  return results


def np_plan(counts, me):
  """The exchange of `counts[i, j, e]` rows (shard i to local expert e of shard j) by plain loops."""
  X, _, El = counts.shape
  sizes = counts.sum(-1)
  input_offsets = [sum(sizes[me, :j]) for j in range(X)]
  output_offsets = [sum(sizes[:me, j]) for j in range(X)]  # earlier senders fill shard j first
  recv_offsets = [sum(sizes[:i, me]) for i in range(X)]
  return_offsets = [sum(sizes[i, :me]) for i in range(X)]  # where shard i's rows for me started
  row_expert = [e for i in range(X) for e in range(El) for _ in range(counts[i, me, e])]
  return input_offsets, output_offsets, recv_offsets, return_offsets, row_expert


def test_exchange_plan_matches_numpy_and_routes_every_row_there_and_back():
  rng = np.random.default_rng(0)
  X, El, rows = 4, 3, 40
  counts = rng.integers(0, 4, (X, X, El))
  counts[2, 1] = 0  # an empty message
  plans = [jax.tree.map(np.asarray, ragged_dispatch.exchange_plan(jnp.asarray(counts), me, rows)) for me in range(X)]
  for me, p in enumerate(plans):
    input_offsets, output_offsets, recv_offsets, return_offsets, row_expert = np_plan(counts, me)
    np.testing.assert_array_equal(p.input_offsets_X, input_offsets)
    np.testing.assert_array_equal(p.output_offsets_X, output_offsets)
    np.testing.assert_array_equal(p.recv_offsets_X, recv_offsets)
    np.testing.assert_array_equal(p.return_offsets_X, return_offsets)
    np.testing.assert_array_equal(p.send_sizes_X, counts[me].sum(-1))
    np.testing.assert_array_equal(p.recv_sizes_X, counts[:, me].sum(-1))
    np.testing.assert_array_equal(p.local_sizes_El, counts[:, me].sum(0))
    np.testing.assert_array_equal(p.row_expert_M, row_expert + [El] * (rows - len(row_expert)))
  # Simulated with the semantics of ragged_all_to_all: each row (tagged src, dst, expert, n) reaches its
  # expert, and the reverse exchange puts it back in place.
  sent = [np.array([(me, j, e, n) for j in range(X) for e in range(El) for n in range(counts[me, j, e])]).reshape(-1, 4)
          for me in range(X)]
  arg = lambda name: [getattr(p, name) for p in plans]
  got = np_ragged_all_to_all(sent, [np.full((rows, 4), -1)] * X, arg("input_offsets_X"), arg("send_sizes_X"),
                             arg("output_offsets_X"), arg("recv_sizes_X"))
  for me, (buffer, p) in enumerate(zip(got, plans)):
    used = p.row_expert_M < El
    assert np.all(buffer[used, 1] == me) and np.all(buffer[used, 2] == p.row_expert_M[used])
    assert np.all(buffer[~used] == -1) and used.sum() == counts[:, me].sum()
  back = np_ragged_all_to_all(got, [np.zeros_like(s) for s in sent], arg("recv_offsets_X"), arg("recv_sizes_X"),
                              arg("return_offsets_X"), arg("send_sizes_X"))
  for a, b in zip(back, sent):
    np.testing.assert_array_equal(a, b)


def test_padded_all_to_all_is_ragged_all_to_all():
  """The CPU transport under shard_map on 4 devices gives the NumPy model's result, padding and all."""
  rng = np.random.default_rng(1)
  X, N, M, C = 4, 12, 20, 5
  send = rng.integers(0, C + 1, (X, X))
  send[0, 3] = 0
  input_offsets = np.stack([np.cumsum(s) - s for s in send])  # contiguous runs, room left over at the end
  output_offsets = np.cumsum(send, axis=0) - send + 1  # receivers keep row 0 and leave gaps
  assert np.all(send.sum(0) + 1 <= M) and np.all(send.sum(1) <= N)
  operands = rng.standard_normal((X, N, 3)).astype(np.float32)
  outputs = np.full((X, M, 3), 7.0, np.float32)
  ref = np_ragged_all_to_all(list(operands), list(outputs), input_offsets, send, output_offsets, send.T)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:X]), ("expert",))
  body = lambda *a: ragged_dispatch.padded_all_to_all(*(x[0] for x in a), axis_name=("expert",), max_chunk=C)[None]
  args = (operands, outputs, input_offsets, send, output_offsets, send.T)
  got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("expert"),) * 6, out_specs=P("expert")))(
      *(jnp.asarray(a, jnp.int32 if a.dtype.kind == "i" else a.dtype) for a in args))
  np.testing.assert_array_equal(np.asarray(got), np.stack(ref))


def _routed(rng, batch, E, K=2):
  x = jnp.asarray(rng.standard_normal((batch, T, D)), jnp.float32)
  experts, weights, _ = moe_lib.route(x, jnp.asarray(rng.standard_normal((D, E)), jnp.float32), jnp.zeros(E),
                                      MoEConfig(num_experts=E, experts_per_token=K))
  gate, up = (jnp.asarray(rng.standard_normal((E, D, F)), jnp.float32) for _ in range(2))
  down = jnp.asarray(rng.standard_normal((E, F, D)), jnp.float32)
  return x, experts, weights, gate, up, down


def _value_and_grads(fn, cotangent):
  return jax.jit(lambda *a: jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * cotangent), argnums=(0, 1, 2, 3, 4))(*a))


# expert=4 x fsdp=2 runs in the train-step test below, expert x fsdp x tensor in the GPT-OSS one.
@pytest.mark.parametrize("sizes", [{"fsdp": 2, "expert": 2, "dcn_expert": 2}])
def test_dropless_expert_parallel_matches_one_device(sizes):
  """The padded transport under shard_map on 8 devices against moe_dispatch.dropless: outputs and the
  gradients of inputs, routing weights and expert weights (FSDP and dcn_expert axes)."""
  rng = np.random.default_rng(2)
  E = 8
  x, experts, weights, gate, up, down = _routed(rng, 8, E)
  cotangent = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  ref = _value_and_grads(lambda x, w, g, u, d: moe_dispatch.dropless(x, experts, w, (g, u, d)), cotangent)(
      x, weights, gate, up, down)
  mesh = make_mesh({"data": 1, "tensor": 1, **sizes})
  parallel = ragged_dispatch.sharded(mesh, DEFAULT_RULES, grouped_ffn=moe_dispatch.grouped_swiglu, num_experts=E,
                                     transport="padded")

  def loss_and_bytes(x, w, g, u, d):
    y, moved = parallel(x, experts, w, g, u, d)
    return jnp.sum(y * cotangent), moved

  with jax.set_mesh(mesh):
    (loss, moved), grads = jax.jit(jax.value_and_grad(loss_and_bytes, argnums=(0, 1, 2, 3, 4), has_aux=True))(
        x, weights, gate, up, down)
  got = (loss, grads)
  for a, b, name in zip(jax.tree.leaves(got), jax.tree.leaves(ref), ("loss", "dx", "dweights", "dgate", "dup", "ddown")):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=name)
  # Bytes: the assignments whose expert lives on another expert shard than their token's, x D x 4 bytes,
  # there and back, forward and backward, on every replica of the tokens (tensor).
  shards = mesh.shape["expert"]
  # A token row's shard in the expert axis: act_batch = (data, fsdp, expert), expert fastest.
  block = np.arange(x.shape[0]) // (x.shape[0] // (mesh.shape["data"] * mesh.shape["fsdp"] * shards))
  token_shard = (block % shards)[:, None, None]
  away = np.sum(np.asarray(experts) // (E // shards) != token_shard)
  assert float(moved) == away * D * 4 * 4 * mesh.shape["tensor"]


def test_gpt_oss_experts_expert_parallel_match_one_device():
  """GPT-OSS's fused clamped-SwiGLU experts with biases on every matmul, dropless over expert=2 x fsdp=2 x
  tensor=2 (interleaved gate_up columns split over tensor, the down bias added once after their sum)
  against the single-device path: outputs and every gradient."""
  rng = np.random.default_rng(4)
  E = 4
  x, experts, weights, _, _, _ = _routed(rng, 8, E)
  gate_up = jnp.asarray(rng.standard_normal((E, D, 2 * F)), jnp.float32)
  down = jnp.asarray(rng.standard_normal((E, F, D)), jnp.float32)
  gate_up_b, down_b = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((E, 2 * F), (E, D)))
  cotangent = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  ffn = functools.partial(moe_dispatch.grouped_clamped_swiglu, alpha=1.702, limit=1.5)  # the clamp bites

  def grads(fn):
    loss = lambda x, w, *ws: jnp.sum(fn(x, w, *ws) * cotangent)
    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6))))

  ref = grads(lambda x, w, *ws: moe_dispatch.dropless(x, experts, w, ws, ffn))(x, weights, gate_up, down, gate_up_b, down_b)
  mesh = make_mesh({"data": 1, "fsdp": 2, "expert": 2, "tensor": 2})
  parallel = ragged_dispatch.sharded(mesh, DEFAULT_RULES, grouped_ffn=ffn, num_experts=E, transport="padded",
                                     weight_logical=ragged_dispatch.CLAMPED_LOGICAL + ragged_dispatch.CLAMPED_BIAS_LOGICAL)
  with jax.set_mesh(mesh):
    got = grads(lambda x, w, *ws: parallel(x, experts, w, *ws)[0])(x, weights, gate_up, down, gate_up_b, down_b)
  names = ("loss", "dx", "dweights", "dgate_up", "ddown", "dgate_up_b", "ddown_b")
  for a, b, name in zip(jax.tree.leaves(got), jax.tree.leaves(ref), names):
    # The tensor shards' partial sums add in another order: fp32 rounding of the largest terms, and for
    # the loss, of its x.size terms of O(1) (a random walk: sqrt of the count).
    scale = np.sqrt(x.size) if name == "loss" else max(1.0, float(np.max(np.abs(b))))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * scale, err_msg=name)


def test_ragged_transport_lowers_with_its_gradient():
  """The GPU/TPU path (`lax.ragged_all_to_all`, whose transpose is JAX's) traces and lowers, forward and
  backward; XLA:CPU cannot compile it, so it is not run here (tools/gpu_moe_dropless_check.py runs it)."""
  rng = np.random.default_rng(3)
  E = 8
  x, experts, weights, gate, up, down = _routed(rng, 8, E)
  mesh = make_mesh({"data": 1, "fsdp": 2, "expert": 4, "tensor": 1})
  parallel = ragged_dispatch.sharded(mesh, DEFAULT_RULES, grouped_ffn=moe_dispatch.grouped_swiglu, num_experts=E,
                                     transport="ragged")
  with jax.set_mesh(mesh):
    text = _value_and_grads(lambda x, w, g, u, d: parallel(x, experts, w, g, u, d)[0], x).lower(
        x, weights, gate, up, down).as_text()
  assert text.count("ragged_all_to_all") >= 4  # there and back, and both transposed
  assert ragged_dispatch.transport_for("cpu") == "padded" and ragged_dispatch.transport_for("gpu") == "ragged"


def test_validation_allows_dropless_expert_parallelism_and_dcn_expert():
  def plan(*args):
    return validate(config_lib.load(TINY_MODEL + list(args)), 8, require_data=False)

  moe = ["--config.model.moe.num_experts=4", "--config.model.moe.dispatch=dropless"]
  assert plan(*moe, "--config.mesh.expert=4", "--config.mesh.fsdp=2").layout.shards("experts") == 4
  p = plan(*moe, "--config.mesh.expert=2", "--config.mesh.dcn_expert=2", "--config.mesh.fsdp=2")
  assert p.layout.shards("experts") == 4 and p.mesh.granules == 2
  with pytest.raises(UserError, match=r"does not divide config.model.moe.num_experts=6"):
    plan("--config.model.moe.num_experts=6", "--config.mesh.expert=4", "--config.mesh.fsdp=2")
  mesh = make_mesh({"data": 1, "fsdp": 2, "expert": 2, "tensor": 1, "dcn_expert": 2})
  # granule-major: the expert axis is (dcn_expert, expert) with the granule slowest
  ids = [d.id for d in mesh.devices[0, 0, 0, :, 0, 0]]
  assert mesh.shape["expert"] == 4 and max(ids[:2]) < 4 <= min(ids[2:])


# ---- the train step: 20 steps on 8 devices, one compile per configuration ---------------------------------
# 4 experts, top 2, seq_len 32: capacity_factor 2.0 gives C = T slots (nothing can drop), 1.0 gives T / 2.
STEP_MOE = ["--config.model.num_layers=1", "--config.model.moe.num_experts=4", "--config.model.moe.expert_d_ff=16", "--config.model.moe.bias_update_rate=0",
            "--config.optimizer.lr=0.01", "--config.optimizer.warmup_steps=2", "--config.optimizer.decay_steps=20"]
DROPLESS = ["--config.model.moe.dispatch=dropless"]
EXPERT_1, EXPERT_4 = ["--config.mesh.fsdp=8"], ["--config.mesh.fsdp=2", "--config.mesh.expert=4"]
STEPS = 20


def batches(shapes: dict, steps: int) -> list[dict[str, np.ndarray]]:
  rng = np.random.default_rng(11)
  B, T = shapes["inputs"].shape
  out = []
  for _ in range(steps):
    tokens = rng.integers(1, 200, (B, T + 1))
    out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": np.ones((B, T)),
                "segment_ids": np.ones((B, T)), "positions": np.broadcast_to(np.arange(T), (B, T))})
  return out


@functools.lru_cache(maxsize=None)
def program_of(args: tuple[str, ...]):
  """The real train step built from `args` on 8 devices: one compile per configuration for all tests."""
  from maxtrain.program import build as program_lib

  cfg = config_lib.load(TINY_MODEL + STEP_MOE + list(args))
  plan = validate(cfg, 8, require_data=False)
  return program_lib.build(cfg, plan, mesh=make_mesh(plan.mesh))


@functools.lru_cache(maxsize=None)
def train_metrics(args: tuple[str, ...], skew: bool = False, steps: int = STEPS) -> list[dict]:
  """Each step's metrics (on the host) of `program_of(args)` on fixed random batches; `skew`: the router
  bias starts at +4 for expert 0 (no bias updates: it stays), so every token takes expert 0 as one of two."""
  from maxtrain.program import state as state_lib

  program = program_of(args)
  shapes = program.abstract_batch()
  got = []
  with jax.set_mesh(program.mesh):
    state = state_lib.initialize(program.state, program.mesh)
    if skew:
      bias = state.params["moe_blocks"]["moe"]["router_bias"]
      bias[...] = jax.device_put(jnp.zeros(bias.shape).at[..., 0].set(4.0), bias[...].sharding)
    for rows in batches(shapes, steps):
      batch = {k: jax.device_put(v.astype(shapes[k].dtype), shapes[k].sharding) for k, v in rows.items()}
      state, metrics = program.train_step(state, batch)
      got.append(jax.device_get(metrics))
  return got


def series(run: list[dict], key: str) -> np.ndarray:
  return np.asarray([m[key] for m in run])


def test_dropless_expert4_trains_like_expert1_and_like_capacity_that_drops_nothing():
  one, four = train_metrics(tuple(DROPLESS + EXPERT_1)), train_metrics(tuple(DROPLESS + EXPERT_4))
  capacity = train_metrics(tuple(EXPERT_4 + ["--config.model.moe.capacity_factor=2.0"]))
  np.testing.assert_allclose(series(four, "loss"), series(one, "loss"), rtol=1e-5)
  np.testing.assert_allclose(series(capacity, "loss"), series(one, "loss"), rtol=1e-5)
  assert series(one, "loss")[-1] < series(one, "loss")[0] - 0.1  # it trains
  for run in (one, four, capacity):
    assert np.all(series(run, "moe/dropped") == 0)
  # Same routing, so the same per-expert load and the same capacity dispatch would have needed.
  np.testing.assert_array_equal(series(four, "moe/expert_load"), series(one, "moe/expert_load"))
  assert series(four, "moe/expert_load")[0].sum() == 8 * 32 * 2  # B x T x K
  np.testing.assert_allclose(series(four, "moe/capacity_needed"), series(one, "moe/capacity_needed"), rtol=1e-6)
  assert np.all(series(one, "moe/capacity_needed") >= 1.0)  # the fullest queue is at least the mean
  assert np.all(series(one, "moe/all_to_all_bytes") == 0)
  # Capacity: every slot of the [B, E, C=T, D] fp32 buffers, 3/4 of each device's leaving it, there and back,
  # forward and backward. Ragged: only the assignments (B x T x K = half the slots here) that leave their
  # device, whole rows of D fp32 x 4; with 4 expert shards about 3/4 of them.
  capacity_bytes = 4 * (8 * 4 * 32 * 32 * 4) * 3 / 4
  assert np.all(series(capacity, "moe/all_to_all_bytes") == capacity_bytes)
  moved = series(four, "moe/all_to_all_bytes")
  assert np.all(moved % (32 * 4 * 4) == 0) and np.all((0.3 < moved / capacity_bytes) & (moved / capacity_bytes < 0.7))


def test_skewed_router_capacity_drops_and_dropless_does_not():
  dropless = train_metrics(tuple(DROPLESS + EXPERT_4), skew=True, steps=1)[0]
  capacity = train_metrics(tuple(EXPERT_4 + ["--config.model.moe.capacity_factor=1.0"]), skew=True, steps=1)[0]
  # Expert 0 takes every token: 32 per sequence against C = 16 slots, so capacity drops at least 16 per
  # sequence; it would have needed capacity_factor 32 x 4 / (32 x 2) = 2.
  for run in (dropless, capacity):
    np.testing.assert_array_equal(run["moe/expert_load"][:, 0], [8 * 32])
    np.testing.assert_allclose(run["moe/capacity_needed"], [2.0])
  assert dropless["moe/dropped"] == 0 and dropless["moe/dropped_fraction"] == 0
  assert capacity["moe/dropped"] >= 8 * 16 and capacity["moe/dropped_fraction"] >= 0.25


def test_microbatches_take_the_max_of_capacity_needed():
  """microbatch.accumulate sums every part but a `*_max` one (the MoE capacity needed), whose max it keeps."""
  from maxtrain.program import microbatch

  def sums_and_grads(params, batch):
    return {"count": jnp.sum(batch), "moe_capacity_needed_max": jnp.max(batch, axis=0)}, params * jnp.sum(batch)

  batch = jnp.asarray([[1.0, 5.0], [3.0, 2.0], [2.0, 1.0], [0.5, 4.0]])  # microbatches: rows 0, 2 and rows 1, 3
  sums, grads = microbatch.accumulate(sums_and_grads, jnp.float32(2.0), batch, 2)
  np.testing.assert_array_equal(np.asarray(sums["moe_capacity_needed_max"]), [3.0, 5.0])
  assert float(sums["count"]) == float(jnp.sum(batch)) and float(grads) == 2 * float(jnp.sum(batch))


def test_per_expert_load_goes_to_tensorboard_tags_only():
  from maxtrain.monitor.metrics import scalar_tags, table_tags

  metrics = {"loss": np.float32(2.0), "moe/max_load": np.asarray([1.5]), "moe/expert_load": np.asarray([[3.0, 5.0]])}
  assert scalar_tags(metrics) == {"train/loss": 2.0, "train/moe/max_load/layer_0": 1.5}  # the gauges' share
  assert table_tags(metrics) == {"train/moe/expert_load/layer_0/expert_0": 3.0, "train/moe/expert_load/layer_0/expert_1": 5.0}


def test_balanced_ragged_dot_is_ragged_dot_on_equal_groups_in_less_memory():
  """The memory stand-in of `lax.ragged_dot` (maxtrain.compile for a GPU target on XLA:CPU): on equal groups it
  is ragged_dot (values and both gradients), and its compiled forward + backward holds a fraction of what
  XLA:CPU's dense lowering of ragged_dot holds (every row times every group)."""
  E, N, Di, Fo = 8, 64, 16, 24
  kx, kw = jax.random.split(jax.random.key(0))
  x_ND, w_EDF = jax.random.normal(kx, (N, Di)), jax.random.normal(kw, (E, Di, Fo))
  sizes_E = jnp.full((E,), N // E, jnp.int32)
  results = {}
  for matmul in (jax.lax.ragged_dot, moe_dispatch.balanced_ragged_dot):
    loss = lambda x, w: jnp.sum(jnp.tanh(matmul(x, w, sizes_E)) ** 2)
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x_ND, w_EDF).compile()
    results[matmul] = compiled(x_ND, w_EDF), compiled.memory_analysis().temp_size_in_bytes
  (want, dense_bytes), (got, standin_bytes) = results.values()
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(a))))
  print(f"temporaries: ragged_dot {dense_bytes} B, stand-in {standin_bytes} B")
  assert standin_bytes * 4 < dense_bytes
  # Rows that do not divide into E groups are padded, and the output keeps the rows' count.
  assert moe_dispatch.balanced_ragged_dot(x_ND[:61], w_EDF, sizes_E).shape == (61, Fo)
