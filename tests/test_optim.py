"""Optimizer routing, Muon against a NumPy reference, schedules in closed form, state shardings and dtypes."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from maxtrain import config as config_lib
from maxtrain.optim import muon, optimizer as optim
from maxtrain.optim.muon import logical_names
from maxtrain.program import state as state_lib
from maxtrain.aot import collectives
from maxtrain.models.llama import Llama, ModelConfig
from maxtrain.sharding.layout import param_name
from maxtrain.sharding import rules as sharding_rules
from maxtrain.sharding.mesh import make_mesh

D, N, K, H, F, V, L = 32, 4, 2, 8, 48, 64, 2
MODEL = ModelConfig(num_layers=L, d_model=D, num_heads=N, num_kv_heads=K, d_ff=F, vocab_size=V, max_seq_len=16)


def abstract_params(**overrides):
  cfg = dataclasses.replace(MODEL, **overrides)
  return nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))[1]


def random_params(seed=0, **overrides):
  """Parameters with random values (the model's init is slow eagerly, and values do not matter here)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jnp.asarray(0.02 * rng.normal(size=s.shape), s.dtype), abstract_params(**overrides))


def named(tree) -> dict:
  return {param_name(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def opt_config(**overrides):
  cfg = config_lib.base_config().optimizer
  for key, value in overrides.items():
    cfg[key] = value
  return cfg


# Which optimizer each parameter gets under optimizer.name=muon. A change here changes the method.
MUON_ROUTING = {
    "embed": "adam", "head": "adam", "final_norm/scale": "adam",
    "blocks/attn_norm/scale": "adam", "blocks/mlp_norm/scale": "adam",
    "blocks/attn/wq": "muon", "blocks/attn/wk": "muon", "blocks/attn/wv": "muon", "blocks/attn/wo": "muon",
    "blocks/mlp/gate": "muon", "blocks/mlp/up": "muon", "blocks/mlp/down": "muon",
}


def test_routing_lists_muon_and_adam_leaves():
  scanned = named(optim.param_labels(abstract_params(), "muon"))
  assert scanned == MUON_ROUTING
  # Unscanned layers (an nnx.List): the same routing per layer; matrices are 2-D and 3-D there.
  unscanned = named(optim.param_labels(abstract_params(scan_layers=False), "muon"))
  expected = {name.replace("blocks/", f"blocks/{i}/"): label
              for name, label in MUON_ROUTING.items() for i in range(L) if name.startswith("blocks/")}
  expected.update({name: label for name, label in MUON_ROUTING.items() if not name.startswith("blocks/")})
  assert unscanned == expected
  # Tied embeddings: no head; the shared table stays on Adam.
  tied = named(optim.param_labels(abstract_params(tie_embeddings=True), "muon"))
  assert tied == {k: v for k, v in MUON_ROUTING.items() if k != "head"}
  # AdamW: everything on Adam.
  assert set(named(optim.param_labels(abstract_params(), "adamw")).values()) == {"adam"}


def test_weight_decay_mask_by_kind():
  mask = named(optim.decay_mask("embed,norm,bias")(abstract_params()))
  assert {name for name, decay in mask.items() if decay} == {n for n, g in MUON_ROUTING.items() if g == "muon"} | {"head"}
  assert all(named(optim.decay_mask("")(abstract_params())).values())


def test_an_unknown_parameter_is_an_error_not_a_silent_adam_fallback():
  """Routing reads logical axes: a parameter without them, or with an embed axis in the middle (neither
  reading nor writing the residual stream), is an error, not a silent Adam fallback."""
  with pytest.raises(ValueError, match="blocks/attn/w_new has no logical axes"):
    optim.param_labels({"blocks": {"attn": {"w_new": jnp.zeros((L, D, D))}}}, "muon")
  with nnx.use_eager_sharding(False):
    odd = nnx.Param(jnp.zeros((L, N, D, H)), out_sharding=("layers", "heads", "embed", "head_dim"))
  with pytest.raises(ValueError, match="blocks/attn/w_odd has logical axes .* route to no optimizer group"):
    optim.param_labels({"blocks": {"attn": {"w_odd": odd}}}, "muon")


def test_routing_follows_logical_axes_for_every_family_piece():
  """q/k/v biases (Qwen2) and qk-norm scales (Qwen3) stay on Adam; a head_dim of its own changes no route."""
  from maxtrain.models import registry

  cfg = dataclasses.replace(MODEL, qkv_bias=True, qk_norm=True, head_dim_setting=12)
  labels = named(optim.param_labels(registry.abstract(cfg)[1], "muon"))
  assert labels == {**MUON_ROUTING, "blocks/attn/bq": "adam", "blocks/attn/bk": "adam", "blocks/attn/bv": "adam",
                    "blocks/attn/q_norm/scale": "adam", "blocks/attn/k_norm/scale": "adam"}
  decay = named(optim.decay_mask("embed,norm,bias")(registry.abstract(cfg)[1]))
  assert not any(decay[f"blocks/attn/{n}"] for n in ("bq", "bk", "bv", "q_norm/scale", "k_norm/scale"))


def newton_schulz_np(x, coeffs, steps):
  a, b, c = coeffs
  transposed = x.shape[0] > x.shape[1]
  if transposed:
    x = x.T
  x = x / (np.linalg.norm(x) + 1e-8)
  for _ in range(steps):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if transposed else x


def muon_reference(param, grads, *, lr, wd, beta, coeffs, ns_steps, fan_in, fan_out):
  """Muon as documented in maxtrain/optim/optimizer.py, in float64: Nesterov momentum with bias correction,
  Newton-Schulz on the [fan_in, fan_out] matrix, scaling sqrt(max(1, fan_out / fan_in)),
  decoupled weight decay, learning rate. Returns the parameter after each step."""
  param, mu, out = param.astype(np.float64), np.zeros_like(param, np.float64), []
  for t, g in enumerate(grads, start=1):
    g = g.astype(np.float64)
    mu = beta * mu + (1 - beta) * g
    mu_hat = beta * mu / (1 - beta ** (t + 1)) + (1 - beta) * g / (1 - beta ** t)
    ortho = newton_schulz_np(mu_hat.reshape(fan_in, fan_out), coeffs, ns_steps).reshape(param.shape)
    param = param - lr * (math.sqrt(max(1.0, fan_out / fan_in)) * ortho + wd * param)
    out.append(param)
  return out


@pytest.mark.parametrize("scan_layers", [False, True], ids=["layer-list", "scanned"])
def test_muon_update_matches_numpy(scan_layers):
  cfg = opt_config(name="muon", lr=0.05, adam_lr=1e-3, schedule="constant", warmup_steps=0, clip_norm=0.0,
                   weight_decay=0.1, muon_momentum=0.9, muon_ns_steps=5)
  tx = optim.make(cfg, total_steps=10).tx
  params = random_params(scan_layers=scan_layers)
  initial = named(jax.device_get(params))
  grads = [random_params(seed, scan_layers=scan_layers) for seed in (1, 2, 3)]
  opt_state, history = tx.init(params), []
  update = jax.jit(tx.update)
  for g in grads:
    updates, opt_state = update(g, opt_state, params)
    params = optax.apply_updates(params, updates)
    history.append(named(jax.device_get(params)))

  grads_named = [named(jax.device_get(g)) for g in grads]
  coeffs = optim.parse_ns_coeffs(cfg.muon_ns_coeffs)
  # (parameter, index of the slice or (), fan_in, fan_out): a 2-D matrix, heads folded into a dim,
  # and one layer's slice of a stacked weight, which Muon must orthogonalise on its own.
  prefix = "blocks/" if scan_layers else "blocks/1/"
  layer = (1,) if scan_layers else ()
  cases = [(prefix + "mlp/gate", layer, D, F), (prefix + "mlp/down", layer, F, D),
           (prefix + "attn/wq", layer, D, N * H), (prefix + "attn/wo", layer, N * H, D)]
  if scan_layers:
    cases.append((prefix + "attn/wk", (0,), D, K * H))
  for name, index, fan_in, fan_out in cases:
    expected = muon_reference(initial[name][index], [g[name][index] for g in grads_named], lr=cfg.lr,
                              wd=cfg.weight_decay, beta=cfg.muon_momentum, coeffs=coeffs,
                              ns_steps=cfg.muon_ns_steps, fan_in=fan_in, fan_out=fan_out)
    for step, (got, want) in enumerate(zip(history, expected)):
      np.testing.assert_allclose(got[name][index], want, rtol=1e-4, atol=1e-6, err_msg=f"{name}{index} step {step}")


def test_newton_schulz_in_bfloat16_is_close_to_float32():
  """muon_ns_dtype=bfloat16 runs the iteration in bf16 (so it differs from fp32 by more than fp32
  rounding) and stays within 10% (relative Frobenius) of the float64 reference on a Gaussian matrix:
  5-7% measured over seeds (bf16's 2^-8 rounding, amplified by 5 iterations), as on real Muon inputs
  (BENCHMARKS.md)."""
  coeffs = optim.parse_ns_coeffs(opt_config().muon_ns_coeffs)
  x = np.random.default_rng(0).normal(size=(1, D, F)).astype(np.float32)  # one layer of mlp/gate
  want = newton_schulz_np(x[0].astype(np.float64), coeffs, 5)
  ns = jax.jit(lambda x, dtype: muon.newton_schulz(x, optim.matrix_dimension_numbers(("embed", "mlp")), coeffs, 5,
                                                   dtype), static_argnums=1)
  error = {dt: np.linalg.norm(np.asarray(ns(x, dt))[0] - want) / np.linalg.norm(want) for dt in ("float32", "bfloat16")}
  assert error["float32"] < 1e-5
  assert 1e-3 < error["bfloat16"] < 0.1, error
  assert ns(x, "bfloat16").dtype == jnp.float32  # the update keeps the input's dtype


def test_schedules_at_chosen_steps_match_closed_form():
  total, warmup, floor = 100, 10, 0.1
  base = dict(warmup_steps=warmup, min_lr_ratio=floor, decay_fraction=0.2)

  def at(steps, **overrides):
    multiplier = optim.lr_multiplier(opt_config(**base, **overrides), total)
    return [float(multiplier(s)) for s in steps]

  cos = lambda p: floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))
  # Warmup, then cosine over steps 10..100.
  np.testing.assert_allclose(at([0, 5, 10, 25, 55, 100, 150], schedule="cosine"),
                             [0.0, 0.5, 1.0, cos(15 / 90), 0.55, floor, floor], rtol=1e-6, atol=1e-7)
  # WSD: flat until step 80 = 100 - 0.2 x 100, then 20 steps of decay.
  np.testing.assert_allclose(at([5, 10, 50, 80, 85, 90, 100], schedule="wsd", wsd_decay="linear"),
                             [0.5, 1.0, 1.0, 1.0, 1 - 0.9 * 0.25, 0.55, floor], rtol=1e-6)
  np.testing.assert_allclose(at([50, 80, 85, 90, 100], schedule="wsd", wsd_decay="cosine"),
                             [1.0, 1.0, cos(0.25), 0.55, floor], rtol=1e-6)
  np.testing.assert_allclose(at([0, 5, 10, 99], schedule="constant"), [0.0, 0.5, 1.0, 1.0], rtol=1e-6)
  # The cosine schedule is optax's warmup_cosine_decay_schedule, which the trainer used before.
  reference = optax.warmup_cosine_decay_schedule(0.0, 1.0, warmup, total, end_value=floor)
  np.testing.assert_allclose(at(range(0, 120, 7), schedule="cosine"),
                             [float(reference(s)) for s in range(0, 120, 7)], rtol=1e-6, atol=1e-7)
  # Every group follows the shape from its own peak.
  opt = optim.make(opt_config(**base, name="muon", schedule="cosine", lr=0.02, adam_lr=3e-3), total)
  np.testing.assert_allclose([float(opt.learning_rates[k](55)) for k in ("lr", "adam_lr")],
                             [0.02 * 0.55, 3e-3 * 0.55], rtol=1e-6)


def test_muon_state_is_sharded_like_its_parameters():
  # The shardings state.create lays the state out with (test_sharding checks a created state for
  # AdamW; planning only keeps this test fast).
  mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  tx = optim.make(opt_config(name="muon", lr=0.02), total_steps=10).tx
  spec = state_lib.spec(MODEL, tx, mesh, seed=0)
  abstract, shardings = spec.abstract, spec.shardings
  ndim = {name: leaf.ndim for name, leaf in named(abstract.params).items()}
  params = named(shardings.params)
  for group, moment in [("muon", "mu"), ("adam", "mu"), ("adam", "nu")]:
    # Names from the abstract state: the other group's leaves are MaskedNodes there (no leaves).
    leaves = named(getattr(abstract.opt_state[1].inner_states[group].inner_state[0], moment))
    assert set(leaves) == {n for n, g in MUON_ROUTING.items() if g == group}, (group, moment)
    specs = named(getattr(shardings.opt_state[1].inner_states[group].inner_state[0], moment))
    for name in leaves:
      assert specs[name].is_equivalent_to(params[name], ndim[name]), (group, moment, name, specs[name].spec)
  assert params["blocks/attn/wq"].spec == P("pipeline", ("fsdp", "context", "expert"), "tensor", None)  # the check above is not vacuous


@pytest.mark.parametrize("param_dtype, state_dtype", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_optimizer_state_dtype_holds_across_updates(param_dtype, state_dtype):
  # Shapes and dtypes only: a step whose output dtypes differ from its inputs' breaks the donated,
  # sharded train step, and eval_shape shows that without compiling.
  params = abstract_params(param_dtype=jnp.dtype(param_dtype))
  tx = optim.make(opt_config(name="muon", state_dtype=state_dtype), total_steps=10).tx
  opt_state = jax.eval_shape(tx.init, params)
  grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), params)  # fp32 gradients
  updates, opt_state = jax.eval_shape(tx.update, grads, opt_state, params)
  params = jax.eval_shape(optax.apply_updates, params, updates)
  moments = {jax.tree_util.keystr(path): x.dtype for path, x in jax.tree_util.tree_leaves_with_path(opt_state)
             if ".mu" in jax.tree_util.keystr(path) or ".nu" in jax.tree_util.keystr(path)}
  assert len(moments) == 7 + 2 * 5  # Muon momentum per matrix; Adam mu and nu for the rest
  assert set(moments.values()) == {jnp.dtype(state_dtype)}, moments
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(param_dtype)}


def optax_muon(cfg, total_steps):
  """optim.make's Muon optimizer with optax.contrib.scale_by_muon (the transform maxtrain.muon replaced)
  in place of maxtrain.muon's: the reference for its values and its state tree."""
  def dims(tree):
    axes = logical_names(tree)
    return jax.tree_util.tree_map_with_path(lambda path, leaf: optim.matrix_dimension_numbers(axes[param_name(path)]),
                                            tree)
  multiplier = optim.lr_multiplier(cfg, total_steps)
  mask, state_dtype = optim.decay_mask(cfg.no_decay), jnp.dtype(cfg.state_dtype)
  muon = optax.chain(
      optax.contrib.scale_by_muon(ns_coeffs=optim.parse_ns_coeffs(cfg.muon_ns_coeffs), ns_steps=cfg.muon_ns_steps,
                                  beta=cfg.muon_momentum, mu_dtype=state_dtype, weight_dimension_numbers=dims),
      optim._scale_by_shape(cfg.muon_consistent_rms), optax.add_decayed_weights(cfg.weight_decay, mask),
      optax.scale_by_learning_rate(lambda step: cfg.lr * multiplier(step)))
  adam = optax.chain(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, mu_dtype=state_dtype),
                     optax.add_decayed_weights(cfg.weight_decay, mask),
                     optax.scale_by_learning_rate(lambda step: cfg.adam_lr * multiplier(step)))
  tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                   optax.partition({"muon": muon, "adam": adam}, lambda p: optim.param_labels(p, "muon")))
  return optim._init_state_in(tx, state_dtype)


@pytest.mark.parametrize("name, state_dtype", [("adamw", "float32"), ("adamw", "bfloat16"), ("muon", "float32"),
                                              ("muon", "bfloat16")])
def test_guarded_update_is_optax_and_a_skip_is_exact(name, state_dtype):
  """skip=False: the guarded transforms (maxtrain.optim.guarded, scale_by_adam_guarded, maxtrain.muon)
  give optax's updates and state, in the same state tree (skip=None runs optax's own update functions
  for Adam, and optax.contrib.scale_by_muon for Muon; the programs are compiled differently, so equal up
  to fp32 rounding: 1e-5 of each leaf's scale). skip=True: the whole state comes back bit-identical,
  whatever the gradients."""
  cfg = opt_config(name=name, lr=1e-2 if name == "adamw" else 0.02, state_dtype=state_dtype, warmup_steps=2)
  optimizer = optim.make(cfg, total_steps=10)
  reference_tx = optax_muon(cfg, total_steps=10) if name == "muon" else optimizer.tx
  params = random_params()
  update = jax.jit(lambda g, s, p, skip: optimizer.tx.update(g, s, p, skip=skip))
  reference = jax.jit(lambda g, s, p: reference_tx.update(g, s, p))
  state = optimizer.tx.init(params)
  assert jax.tree.structure(state) == jax.tree.structure(reference_tx.init(params))  # checkpoints restore
  for step in range(4):
    grads = random_params(seed=10 + step)
    ours, new_state = update(grads, state, params, jnp.bool_(False))
    theirs, their_state = reference(grads, state, params)
    for a, b in zip(jax.tree.leaves((ours, new_state)), jax.tree.leaves((theirs, their_state))):
      assert a.dtype == b.dtype
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.max(np.abs(b)))
    _, kept = update(jax.tree.map(lambda g: g * jnp.nan, grads), their_state, params, jnp.bool_(True))
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(their_state)):
      assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    state = their_state


def test_sharded_newton_schulz_orthogonalises_whole_layers_per_device():
  """Under the step's rules (maxtrain.muon.orthogonalize), a stacked weight's Newton-Schulz runs on whole
  layers per device: layers split over the 8 fsdp devices (zero-padded to 8 when fewer) by all-to-alls,
  no all-gather of any matrix. Without rules GSPMD all-gathers the whole stacked matrix. Both match the
  NumPy reference layer by layer."""
  mesh = make_mesh({"data": 1, "fsdp": 8, "tensor": 1})
  rules = sharding_rules.DEFAULT_RULES
  coeffs, steps = optim.parse_ns_coeffs(opt_config().muon_ns_coeffs), 5
  weights = {  # name: (layers, logical names of the parameter); 8 layers split evenly, 2 padded to 8
      "blocks/mlp/gate": (8, ("layers", "embed", "mlp")), "blocks/attn/wo": (2, ("layers", "heads", "head_dim", "embed"))}
  shapes = {"blocks/mlp/gate": (D, F), "blocks/attn/wo": (N, H, D)}
  rng = np.random.default_rng(0)
  x = {name: rng.normal(size=(layers, *shapes[name])).astype(np.float32) for name, (layers, _) in weights.items()}
  shardings = {name: NamedSharding(mesh, sharding_rules.logical_to_mesh(logical, rules))
               for name, (_, logical) in weights.items()}

  def lowered(active, dtype=jnp.float32):
    def run(x):
      return {name: muon.orthogonalize(v, optim.matrix_dimension_numbers(weights[name][1]), weights[name][1], coeffs, steps,
                                       dtype, sharding_rules.Parallel.of(active)) for name, v in x.items()}
    return jax.jit(run, in_shardings=(shardings,), out_shardings=shardings).lower(x)

  compiled = lambda active, dtype=jnp.float32: lowered(active, dtype).compile()

  with jax.set_mesh(mesh):
    split, plain, split_bf16 = compiled(rules), compiled(None), compiled(rules, jnp.bfloat16)
    results = [jax.device_get(f(jax.device_put(x, shardings))) for f in (split, plain)]
    low = jax.device_get(split_bf16(jax.device_put(x, shardings)))
    bf16_program = lowered(rules, jnp.bfloat16).as_text(dialect="hlo")
  for name in weights:  # bf16: the iteration's accuracy (test above), and the all-to-alls move bf16
    assert low[name].dtype == np.float32
    assert np.linalg.norm(low[name] - results[0][name]) / np.linalg.norm(results[0][name]) < 0.1
  # The reshards there and back are of bf16 arrays in the program XLA gets (XLA:CPU then runs its
  # all-to-alls in f32, as it upcasts bf16 collectives; a GPU moves half the bytes).
  resharded = [line.split("=")[1].split("[")[0].strip() for line in bf16_program.splitlines()
               if 'custom_call_target="Sharding"' in line]
  assert len(resharded) == 2 * len(weights) and set(resharded) == {"bf16"}, resharded
  for got in results:
    for name, (layers, _) in weights.items():
      for layer in range(layers):
        fan_in = D if name.endswith("gate") else N * H
        want = newton_schulz_np(x[name][layer].astype(np.float64).reshape(fan_in, -1), coeffs, steps)
        np.testing.assert_allclose(got[name][layer].reshape(fan_in, -1), want, rtol=1e-4, atol=1e-5,
                                   err_msg=f"{name} layer {layer}")
  gathered = lambda c: [s for s in collectives.array_shapes(c.as_text(), "all-gather") if math.prod(s) >= D * D]
  assert (8, D, F) in gathered(plain)  # GSPMD's own partitioning: the whole stacked matrix on every device
  assert gathered(split) == []
  assert collectives.totals(split.as_text())["all-to-all"][0] >= 2 * len(weights)  # there and back


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_dense_model_state_has_no_group_for_non_gradient_state(name):
  """The `none` group (MoE's router bias) exists only when a parameter needs it: its empty state node
  in a dense model's optimizer state changed the tree, and checkpoints saved before it failed to restore."""
  state = optim.make(opt_config(name=name), total_steps=10).tx.init(random_params())
  partition = next(s for s in state if isinstance(s, optax.PartitionState))
  assert set(partition.inner_states) == ({"adam", "muon"} if name == "muon" else {"adam"})
