"""Mesh equivalence (same numbers on every mesh) and parameter placement per the rules."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from maxtrain.program import batch as batch_lib
from maxtrain import config as config_lib
from maxtrain.optim import optimizer as optim
from maxtrain.program import state as state_lib
from maxtrain.program import step as step_lib
from maxtrain.errors import UserError
from maxtrain.models.llama import Llama, ModelConfig
from maxtrain.sharding.layout import param_name
from maxtrain.sharding.mesh import make_mesh
from maxtrain.sharding.rules import DEFAULT_RULES, logical_to_mesh

MODEL = ModelConfig(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, vocab_size=128,
                    max_seq_len=16)
MESHES = {  # name: (mesh sizes, number of devices)
    "1 device": ({"data": 1, "fsdp": 1, "tensor": 1}, 1),
    "data=8": ({"data": 8, "fsdp": 1, "tensor": 1}, 8),
    "fsdp=8": ({"data": 1, "fsdp": 8, "tensor": 1}, 8),
    "data=2 x fsdp=2 x tensor=2": ({"data": 2, "fsdp": 2, "tensor": 2}, 8),
    # Two granules of 4 devices (as two nodes would be): data across them, fsdp x tensor inside.
    "dcn_data=2 x fsdp=2 x tensor=2": ({"data": 1, "fsdp": 2, "tensor": 2, "dcn_data": 2}, 8),
    # The sequence split 4 ways (context attention under shard_map), tokens in the loader's order.
    "fsdp=2 x context=4": ({"data": 1, "fsdp": 2, "context": 4, "tensor": 1}, 8),
}


def batches(n=3, b=8, t=16, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    inputs = rng.integers(0, MODEL.vocab_size, (b, t)).astype(np.int32)
    segs = np.where(np.arange(t) < 6, 1, 2).astype(np.int32)[None].repeat(b, 0)
    pos = np.where(np.arange(t) < 6, np.arange(t), np.arange(t) - 6).astype(np.int32)[None].repeat(b, 0)
    mask = np.ones((b, t), np.float32)
    mask[:, 5] = 0.0  # the target of the last token of document 1 lies in document 2
    out.append({"inputs": inputs, "targets": rng.integers(0, MODEL.vocab_size, (b, t)).astype(np.int32),
                "segment_ids": segs, "positions": pos, "loss_mask": mask})
  return out


def opt_config():
  """AdamW with eps=1e-2, so that the parameters compare at the bound the gradients imply.

  Adam's first update is g / (|g| + eps): its slope in g is eps / (|g| + eps)^2, up to 1/eps. At the default
  eps=1e-8 a gradient entry near 1e-8 turns fp32 reduction-order noise (which differs between meshes) into an
  O(1) change of its update: after 3 steps one of 16384 entries of mlp.up differed by 1.3e-6 on an Intel Xeon.
  With eps=1e-2 the slope is at most 100: the meshes' gradients differ by dg <= 2e-8 (printed below), which moves
  a parameter by at most steps * lr * 2 * 100 * dg = 3 * 1e-2 * 4e-6 = 1.2e-7 (the 2: the second moment's share),
  inside the parameter tolerance; the sharded optimizer state is exercised the same way."""
  cfg = config_lib.base_config().optimizer
  cfg.lr, cfg.warmup_steps, cfg.eps = 1e-2, 1, 1e-2
  return cfg


def run_on_mesh(sizes, num_devices):
  mesh = make_mesh(sizes, jax.devices()[:num_devices])
  optimizer = optim.make(opt_config(), total_steps=10)
  graphdef, state, shardings = state_lib.create(MODEL, optimizer.tx, mesh, seed=0)
  batch_sharding = NamedSharding(mesh, P(("data", "fsdp"), "context"))
  context = sizes.get("context", 1)
  data = [jax.device_put(batch_lib.context_order(b, context), batch_sharding) for b in batches()]
  with jax.set_mesh(mesh):
    def loss_and_grads(p, b):  # the graphdef's model is laid out by the rules state_lib built it with
      return step_lib.loss_and_grads(graphdef, p, b)

    grad_fn = jax.jit(loss_and_grads, in_shardings=(shardings.params, batch_sharding))
    metrics0, grads0 = jax.device_get(grad_fn(state.params, data[0]))
    loss0 = metrics0["loss"]
    train_step = jax.jit(step_lib.make_train_step(graphdef, optimizer), in_shardings=(shardings, batch_sharding),
                         out_shardings=(shardings, state_lib.replicated(mesh)), donate_argnums=0)
    for batch in data:
      state, _ = train_step(state, batch)
  return loss0, grads0, jax.device_get(state.params)


@pytest.fixture(scope="module")
def results():
  return {name: run_on_mesh(*spec) for name, spec in MESHES.items()}


@pytest.mark.parametrize("name", [n for n in MESHES if n != "1 device"])
def test_mesh_equivalence(results, name):
  ref_loss, ref_grads, ref_params = results["1 device"]
  loss, grads, params = results[name]
  diff = lambda x, y: max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)))
  print(f"{name}: max |grad - ref| {diff(grads, ref_grads):.2e}, max |param - ref| {diff(params, ref_params):.2e}")
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7, err_msg=f"grad {jax.tree_util.keystr(path)}")
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=f"param {jax.tree_util.keystr(path)}")


# The layout the default rules must produce on a data x fsdp x context x tensor mesh (scanned layers:
# the leading dim is `layers`, never sharded). A change here is a deliberate change of strategy.
FSDP = ("fsdp", "context", "expert")  # parameters are FSDP-sharded over the context and expert axes too
EXPECTED_PARAM_SPECS = {
    "embed": P("tensor", FSDP),
    "head": P(FSDP, "tensor"),
    "final_norm/scale": P(None),
    "blocks/attn_norm/scale": P(None, None),
    "blocks/mlp_norm/scale": P(None, None),
    "blocks/attn/wq": P(None, FSDP, "tensor", None),
    "blocks/attn/wk": P(None, FSDP, "tensor", None),
    "blocks/attn/wv": P(None, FSDP, "tensor", None),
    "blocks/attn/wo": P(None, "tensor", None, FSDP),
    "blocks/mlp/gate": P(None, FSDP, "tensor"),
    "blocks/mlp/up": P(None, FSDP, "tensor"),
    "blocks/mlp/down": P(None, "tensor", FSDP),
}


def test_every_parameter_is_sharded_as_the_rules_say():
  mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  _, state, _ = state_lib.create(MODEL, optim.make(opt_config(), total_steps=10).tx, mesh, seed=0)
  abstract = nnx.eval_shape(lambda: Llama(MODEL, rngs=nnx.Rngs(0)))
  logical = dict(jax.tree_util.tree_leaves_with_path(nnx.get_partition_spec(nnx.state(abstract)),
                                                     is_leaf=lambda x: isinstance(x, P)))
  seen = set()
  for path, leaf in jax.tree_util.tree_leaves_with_path(state.params):
    name = param_name(path)
    seen.add(name)
    expected = NamedSharding(mesh, EXPECTED_PARAM_SPECS[name])
    assert leaf.sharding.is_equivalent_to(expected, leaf.ndim), (name, leaf.sharding.spec)
    from_rules = NamedSharding(mesh, logical_to_mesh(logical[path], DEFAULT_RULES))
    assert leaf.sharding.is_equivalent_to(from_rules, leaf.ndim), (name, leaf.sharding.spec)
  assert seen == set(EXPECTED_PARAM_SPECS)
  # Adam moments follow their parameters.
  mu = state.opt_state[1].inner_states["adam"].inner_state[0].mu
  for (path, m), p in zip(jax.tree_util.tree_leaves_with_path(mu), jax.tree.leaves(state.params)):
    assert m.sharding.is_equivalent_to(p.sharding, p.ndim), jax.tree_util.keystr(path)


def test_replicated_parameters_are_refused():
  mesh = make_mesh({"data": 1, "fsdp": 8, "tensor": 1})
  tx = optim.make(opt_config(), total_steps=10).tx
  no_fsdp = {**DEFAULT_RULES, "embed": None}
  with pytest.raises(UserError, match=r"100% of parameter bytes would be replicated .* largest: blocks/mlp/down"):
    state_lib.create(MODEL, tx, mesh, seed=0, rules=no_fsdp)


def test_the_layout_reaches_the_model_at_construction():
  """The builder's rules are the model's own (sharding/rules.py Parallel, a static attribute of its graphdef): the
  same forward, traced under the same mesh with nothing activated, constrains its activations only when the model
  was built with them; the state spec's graphdef carries the rules it laid the state out by."""
  from maxtrain.models import registry
  from maxtrain.sharding.rules import NONE, Parallel

  mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  tokens = jax.ShapeDtypeStruct((8, 16), np.int32)
  constraints = {}
  for name, parallel in (("none", NONE), ("rules", Parallel.of(DEFAULT_RULES))):
    graphdef, params = registry.abstract(MODEL, parallel=parallel)
    with jax.set_mesh(mesh):
      jaxpr = jax.make_jaxpr(lambda p, t: nnx.merge(graphdef, p)(t, t, t))(params, tokens)
    constraints[name] = str(jaxpr).count("sharding_constraint")
  assert constraints["none"] == 0 and constraints["rules"] >= 2 * MODEL.num_layers, constraints
  spec = state_lib.spec(MODEL, optim.make(opt_config(), total_steps=10).tx, mesh, seed=0)
  assert nnx.merge(spec.graphdef, spec.abstract.params).parallel == Parallel.of(DEFAULT_RULES)
