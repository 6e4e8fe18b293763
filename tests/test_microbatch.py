"""Gradient accumulation: k microbatches give the un-accumulated loss and gradients, in less memory."""


import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from maxtrain.program import microbatch
from maxtrain.program import state as state_lib
from maxtrain.program import step as step_lib
from maxtrain.models.llama import Llama, ModelConfig
from maxtrain.sharding.rules import DEFAULT_RULES, Parallel
from maxtrain.sharding.mesh import make_mesh

MODEL = ModelConfig(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, vocab_size=128, max_seq_len=64)
B, T = 16, 64  # 4 batch shards (data=2 x fsdp=2) x 4 microbatches x 1 sequence


def random_batch(seed=0):
  rng = np.random.default_rng(seed)
  # Uneven loss masks: microbatches hold different numbers of loss tokens, so averaging per
  # microbatch means would differ from the global mean.
  mask = (rng.random((B, T)) < rng.uniform(0.2, 1.0, (B, 1))).astype(np.float32)
  return {"inputs": rng.integers(0, MODEL.vocab_size, (B, T)).astype(np.int32),
          "targets": rng.integers(0, MODEL.vocab_size, (B, T)).astype(np.int32),
          "segment_ids": np.ones((B, T), np.int32), "positions": np.arange(T, dtype=np.int32)[None].repeat(B, 0),
          "loss_mask": mask}


@pytest.fixture(scope="module")
def compiled():
  """Params, batch and the loss-and-gradients function compiled for k = 1 and k = 4, on a
  data=2 x fsdp=2 x tensor=2 mesh."""
  mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  graphdef = nnx.split(nnx.eval_shape(lambda: Llama(MODEL, rngs=nnx.Rngs(0), parallel=Parallel.of(DEFAULT_RULES))))[0]
  spec = state_lib.spec(MODEL, optax.identity(), mesh, seed=0)
  abstract, shardings = spec.abstract, spec.shardings
  rng = np.random.default_rng(1)  # random weights: the model's own init would cost a compile
  params = jax.device_put(jax.tree.map(lambda s: (0.05 * rng.normal(size=s.shape)).astype(s.dtype), abstract.params),
                          shardings.params)
  batch_sharding = NamedSharding(mesh, P(("data", "fsdp"), None))
  batch = jax.device_put(random_batch(), batch_sharding)
  fns = {}
  with jax.set_mesh(mesh):
    for k in (1, 4):
      def fn(p, b, k=k):
        return step_lib.loss_and_grads(graphdef, p, b, z_loss=1e-3, grad_accum_steps=k)

      fns[k] = jax.jit(fn, in_shardings=(shardings.params, batch_sharding)).lower(params, batch).compile()
  return params, batch, fns


def test_split_is_strided_so_each_shard_keeps_its_rows():
  x = np.arange(16)
  np.testing.assert_array_equal(microbatch.split(x, 4), [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]])
  # Shard s of 4 holds rows 4s..4s+3; microbatch i takes exactly one of them from every shard.
  for row in np.asarray(microbatch.split(x, 4)):
    assert sorted(row // 4) == [0, 1, 2, 3]


def test_four_microbatches_give_the_same_loss_and_gradients(compiled):
  params, batch, fns = compiled
  (m1, g1), (m4, g4) = jax.device_get(fns[1](params, batch)), jax.device_get(fns[4](params, batch))
  assert m1["loss_tokens"] == m4["loss_tokens"] == batch["loss_mask"].sum()
  np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-6)
  np.testing.assert_allclose(m4["z_loss"], m1["z_loss"], rtol=1e-6)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g4), jax.tree.leaves(g1)):
    # Summed in another order: elements that cancel differ by a few fp32 ulps of the leaf's largest terms.
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max(), err_msg=jax.tree_util.keystr(path))


def test_temporary_memory_falls_with_microbatches(compiled):
  _, _, fns = compiled
  temp = {k: fn.memory_analysis().temp_size_in_bytes for k, fn in fns.items()}
  print(f"temporary memory per device: k=1 {temp[1] / 2**20:.2f} MiB, k=4 {temp[4] / 2**20:.2f} MiB")
  # Activations scale with the microbatch; what stays (gradient accumulators, parameter gathers)
  # is small in this activation-dominated shape.
  assert temp[4] < 0.5 * temp[1], temp
