"""Chunked cross-entropy against the plain reference: values, gradients, sharding, memory.

Shape legend: B batch, T length, D model, V vocab.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from maxtrain.program import loss
from maxtrain.sharding import rules as sharding_rules

B, T, D, V = 4, 37, 32, 200  # T prime: no chunk size below T divides it


def _inputs(B=B, T=T, D=D, V=V, seed=0):
  kx, kh, kt, km = jax.random.split(jax.random.key(seed), 4)
  x_BTD = jax.random.normal(kx, (B, T, D), jnp.float32)
  head_DV = 3.0 * jax.random.normal(kh, (D, V), jnp.float32) / np.sqrt(D)  # logits of std ~3
  targets_BT = jax.random.randint(kt, (B, T), 0, V)
  targets_BT = targets_BT.at[0, :3].set(0).at[1, :3].set(V - 1)  # the vocab edges
  mask_BT = jax.random.bernoulli(km, 0.7, (B, T)).astype(jnp.float32)
  return x_BTD, head_DV, targets_BT, mask_BT


def _objective(losses_fn, z_loss, targets_BT, mask_BT):
  """The step's objective: sum over loss tokens of ce + z_loss * log_z^2, as a function of (x, head)."""
  def f(x_BTD, head_DV):
    ce_BT, log_z_BT = losses_fn(x_BTD, head_DV, targets_BT)
    return jnp.sum(ce_BT * mask_BT) + z_loss * jnp.sum(jnp.square(log_z_BT) * mask_BT)
  return f


def _values_and_grads(losses_fn, z_loss, x_BTD, head_DV, targets_BT, mask_BT):
  f = _objective(losses_fn, z_loss, targets_BT, mask_BT)
  return jax.jit(lambda x, h: (losses_fn(x, h, targets_BT), jax.grad(f, (0, 1))(x, h)))(x_BTD, head_DV)


def _assert_close(actual, desired, rtol):
  # atol only as a floor for entries near 0, scaled to the array (gradient rows of masked tokens are 0).
  for a, d in zip(jax.tree.leaves(actual), jax.tree.leaves(desired)):
    a, d = np.asarray(a, np.float32), np.asarray(d, np.float32)
    np.testing.assert_allclose(a, d, rtol=rtol, atol=rtol * 1e-1 * np.max(np.abs(d)))


def _chunked(chunk_tokens, compute_dtype=jnp.float32):
  return lambda x, h, t: loss.chunked_token_losses(x, h, t, chunk_tokens=chunk_tokens, compute_dtype=compute_dtype)


def _reference(compute_dtype=jnp.float32):
  return lambda x, h, t: loss.reference_head_losses(x, h, t, compute_dtype=compute_dtype)


def test_reference_is_step_math():
  x_BTD, head_DV, targets_BT, _ = _inputs()
  logits_BTV = np.einsum("btd,dv->btv", np.float64(x_BTD), np.float64(head_DV))
  log_z_BT = np.log(np.sum(np.exp(logits_BTV), axis=-1))
  ce_BT = log_z_BT - np.take_along_axis(logits_BTV, np.asarray(targets_BT)[..., None], axis=-1)[..., 0]
  _assert_close(loss.reference_head_losses(x_BTD, head_DV, targets_BT), (ce_BT, log_z_BT), rtol=1e-5)


# 24 -> 6 positions x 7 chunks (T padded 37 -> 42); 1000 > B*T -> one chunk; 2 < B -> one position a chunk.
@pytest.mark.parametrize("chunk_tokens, z_loss", [(24, 1e-4), (24, 0.0), (1000, 1e-4), (2, 1e-4)])
def test_chunked_equals_reference_fp32(chunk_tokens, z_loss):
  x_BTD, head_DV, targets_BT, mask_BT = _inputs()
  want = _values_and_grads(_reference(), z_loss, x_BTD, head_DV, targets_BT, mask_BT)
  got = _values_and_grads(_chunked(chunk_tokens), z_loss, x_BTD, head_DV, targets_BT, mask_BT)
  _assert_close(got, want, rtol=1e-5)


def test_z_loss_gradient_flows_through_log_z():
  # A cotangent on log_z alone: catches a backward that ignores the second output.
  x_BTD, head_DV, targets_BT, mask_BT = _inputs()
  def only_z(fn):
    return jax.grad(lambda x, h: jnp.sum(jnp.square(fn(x, h, targets_BT)[1]) * mask_BT), (0, 1))(x_BTD, head_DV)
  _assert_close(only_z(_chunked(24)), only_z(_reference()), rtol=1e-5)


def test_chunked_bf16_matches_reference_bf16():
  """bf16 operands: both paths round x and head to bf16 and accumulate in fp32.

  The forward values are the same computation (tolerance: fp32 summation order). The gradients differ
  by where bf16 rounding happens (the chunked path rounds d logits, the plain path rounds d head), so
  each is held to a bf16-level error against the fp32 reference on the same bf16-rounded inputs, and
  the chunked error must be no worse than about the plain one.
  """
  x_BTD, head_DV, targets_BT, mask_BT = _inputs()
  x_BTD, head_DV = x_BTD.astype(jnp.bfloat16), head_DV.astype(jnp.bfloat16).astype(jnp.float32)
  z_loss = 1e-4
  (got_v, got_g) = _values_and_grads(_chunked(24, jnp.bfloat16), z_loss, x_BTD, head_DV, targets_BT, mask_BT)
  (ref_v, ref_g) = _values_and_grads(_reference(jnp.bfloat16), z_loss, x_BTD, head_DV, targets_BT, mask_BT)
  _assert_close(got_v, ref_v, rtol=1e-5)
  (_, exact_g) = _values_and_grads(_reference(), z_loss, x_BTD.astype(jnp.float32), head_DV, targets_BT, mask_BT)
  for got, ref, exact in zip(got_g, ref_g, exact_g):
    scale = np.max(np.abs(np.float32(exact)))
    got_err = np.max(np.abs(np.float32(got) - exact)) / scale
    ref_err = np.max(np.abs(np.float32(ref) - exact)) / scale
    assert got.dtype == ref.dtype
    assert got_err < 2.0 ** -7 and got_err < 2 * ref_err + 2.0 ** -10, (got_err, ref_err)


def _mesh():
  return jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)


def _sharded_objective_and_args(mesh, fn, B_, V_):
  """jit-able value and grads of the objective, with inputs sharded as the rules shard them."""
  x_BTD, head_DV, targets_BT, mask_BT = _inputs(B=B_, V=V_)
  batch = ("data", "fsdp")
  shard = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  args = (shard(x_BTD, P(batch, None, None)), shard(head_DV, P("fsdp", "tensor")))
  targets_s, mask_s = shard(targets_BT, P(batch, None)), shard(mask_BT, P(batch, None))
  f = _objective(fn, 1e-4, targets_s, mask_s)
  return jax.jit(lambda x, h: (fn(x, h, targets_s), jax.grad(f, (0, 1))(x, h))), args


def test_sharded_equals_one_device():
  Bs, Vs = 8, 256  # divisible by the (data x fsdp) = 4 batch shards and the 2 vocab shards
  fn = lambda x, h, t: loss.chunked_token_losses(x, h, t, chunk_tokens=16, batch_shards=4)  # 8 positions x 5
  step, args = _sharded_objective_and_args(_mesh(), fn, Bs, Vs)
  got = step(*args)
  x_BTD, head_DV, targets_BT, mask_BT = _inputs(B=Bs, V=Vs)
  one_device = lambda a: jax.device_put(a, jax.devices()[0])
  want = _values_and_grads(fn, 1e-4, *map(one_device, (x_BTD, head_DV, targets_BT, mask_BT)))
  _assert_close(got, want, rtol=1e-5)


def _all_reduces_of(hlo: str, shape: str) -> dict[str, int]:
  """{computation name: number of all-reduces that produce `shape`} in compiled HLO text."""
  counts, computation = {}, None
  for line in hlo.splitlines():
    if line and not line.startswith(" ") and line.rstrip().endswith("{"):
      computation = "ENTRY" if line.startswith("ENTRY") else line.split()[0]
    elif " all-reduce(" in line and shape in line.split(" all-reduce(")[0]:
      counts[computation] = counts.get(computation, 0) + 1
  return counts


@pytest.mark.parametrize("batch_shards", [1, 4])
def test_head_gradient_reduced_across_devices_once(batch_shards):
  """With one partial sum per batch shard, the [D, V_local] all-reduce leaves the chunk loop."""
  Bs, Vs = 8, 256
  fn = lambda x, h, t: loss.chunked_token_losses(x, h, t, chunk_tokens=8 * Bs // batch_shards,
                                                 batch_shards=batch_shards)  # 8 positions x 5
  step, args = _sharded_objective_and_args(_mesh(), fn, Bs, Vs)
  counts = _all_reduces_of(step.lower(*args).compile().as_text(), f"{D},{Vs // 2}]")
  if batch_shards == 4:
    assert counts == {"ENTRY": 1}, counts
  else:  # documents why batch_shards exists: GSPMD reduces inside the loop, once per chunk
    assert set(counts) != {"ENTRY"}, counts


def test_head_gradient_reduce_scattered_under_the_rules():
  """With the run's rules active, d head reaches the parameter's layout (embed over fsdp, vocab over
  tensor) by an all-to-all and a local sum: no all-reduce of the whole [D, V_local] fp32 gradient, and
  the same values and gradients as one device."""
  Bs, Vs = 8, 256
  mesh = jax.make_mesh((2, 2, 1, 1, 2), ("data", "fsdp", "expert", "context", "tensor"), axis_types=(AxisType.Auto,) * 5)
  fn = lambda x, h, t: loss.chunked_token_losses(x, h, t, chunk_tokens=16, batch_shards=4,
                                                 parallel=sharding_rules.Parallel.of(sharding_rules.get("default")))
  step, args = _sharded_objective_and_args(mesh, fn, Bs, Vs)
  with jax.set_mesh(mesh):
    compiled = step.lower(*args).compile()
  hlo = compiled.as_text()
  assert _all_reduces_of(hlo, f"{D},{Vs // 2}]") == {}, _all_reduces_of(hlo, f"{D},{Vs // 2}]")
  assert " all-to-all(" in hlo
  got = compiled(*args)
  assert got[1][1].sharding.spec == P("fsdp", "tensor")
  x_BTD, head_DV, targets_BT, mask_BT = _inputs(B=Bs, V=Vs)
  one_device = lambda a: jax.device_put(a, jax.devices()[0])
  _assert_close(got, _values_and_grads(fn, 1e-4, *map(one_device, (x_BTD, head_DV, targets_BT, mask_BT))), rtol=1e-5)


def _temp_bytes(losses_fn, B, T, D, V):
  x = jax.ShapeDtypeStruct((B, T, D), jnp.float32)
  head = jax.ShapeDtypeStruct((D, V), jnp.float32)
  targets = jax.ShapeDtypeStruct((B, T), jnp.int32)
  mask = jax.ShapeDtypeStruct((B, T), jnp.float32)
  def value_and_grads(x, head, targets, mask):
    return jax.value_and_grad(_objective(losses_fn, 1e-4, targets, mask), (0, 1))(x, head)
  return jax.jit(value_and_grads).lower(x, head, targets, mask).compile().memory_analysis().temp_size_in_bytes


def test_chunked_never_holds_full_logits():
  B_, T_, D_, V_ = 4, 1024, 256, 32768
  logits_bytes = B_ * T_ * V_ * 4  # 512 MiB
  chunked = _temp_bytes(_chunked(256), B_, T_, D_, V_)
  plain = _temp_bytes(_reference(), B_, T_, D_, V_)
  # The chunked budget: a few [256, V] fp32 buffers (32 MiB each) and the [D, V] fp32 d head (32 MiB).
  assert chunked < logits_bytes / 4, (chunked, plain)
  assert plain > logits_bytes, (chunked, plain)


def test_head_losses_dispatch_and_default_rule():
  assert loss.default_chunk_tokens(384) == 0
  assert loss.default_chunk_tokens(128256) == loss.DEFAULT_CHUNK_TOKENS
  x_BTD, head_DV, targets_BT, _ = _inputs()
  _assert_close(loss.head_losses(x_BTD, head_DV, targets_BT, chunk_tokens=0),
                loss.reference_head_losses(x_BTD, head_DV, targets_BT), rtol=0)
  with pytest.raises(ValueError, match="chunk_tokens"):
    loss.chunked_token_losses(x_BTD, head_DV, targets_BT, chunk_tokens=0)


def test_final_logit_softcap_chunked_equals_capped_reference():
  """Gemma 2's final-logit soft-capping (cap 2 on logits of std ~3: tanh far from linear): the reference equals
  NumPy's capped cross-entropy, and the chunked path (its own backward through d tanh) equals the reference in
  values and gradients, z-loss included."""
  x_BTD, head_DV, targets_BT, mask_BT = _inputs()
  cap = 2.0
  logits_BTV = cap * np.tanh(np.einsum("btd,dv->btv", np.float64(x_BTD), np.float64(head_DV)) / cap)
  log_z_BT = np.log(np.sum(np.exp(logits_BTV), axis=-1))
  ce_BT = log_z_BT - np.take_along_axis(logits_BTV, np.asarray(targets_BT)[..., None], axis=-1)[..., 0]
  reference = lambda x, h, t: loss.reference_head_losses(x, h, t, logit_cap=cap)
  _assert_close(reference(x_BTD, head_DV, targets_BT), (ce_BT, log_z_BT), rtol=1e-5)
  chunked = lambda x, h, t: loss.chunked_token_losses(x, h, t, chunk_tokens=24, logit_cap=cap)
  want = _values_and_grads(reference, 1e-4, x_BTD, head_DV, targets_BT, mask_BT)
  _assert_close(_values_and_grads(chunked, 1e-4, x_BTD, head_DV, targets_BT, mask_BT), want, rtol=1e-5)
  uncapped = _values_and_grads(_reference(), 1e-4, x_BTD, head_DV, targets_BT, mask_BT)
  assert np.abs(np.asarray(uncapped[1][1]) - np.asarray(want[1][1])).max() > 0.1 * np.abs(np.asarray(want[1][1])).max()
