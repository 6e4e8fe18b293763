"""`hlo_lint.unordered_collective_loops`: a loop holding a collective next to another collective that no data path
orders against it (XLA:CPU may run the two in different orders on different devices, and the step hangs). The
pipeline schedules' programs are checked in tests/test_pipeline_parallel.py."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from maxtrain.aot.hlo_lint import unordered_collective_loops


def _compiled_hlo(ordered: bool) -> str:
  mesh = jax.make_mesh((8,), ("x",))

  def f(x, y):
    def body(c):
      k, v = c
      return k + 1, v + jax.lax.all_gather(v, "x", tiled=True)[:v.shape[0]] * 0.5
    _, b = jax.lax.while_loop(lambda c: c[0] < 3, body, (jnp.int32(0), jnp.cos(y)))
    a = jax.lax.psum(jnp.sin(b if ordered else x), "x")  # after the loop, or beside it
    return a, b

  g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x")), check_vma=False))
  x = jax.device_put(jnp.ones(8 * 64), NamedSharding(mesh, P("x")))
  return g.lower(x, x).compile().as_text()


def test_a_loop_beside_a_collective_is_found_and_an_ordered_one_is_not():
  [problem] = unordered_collective_loops(_compiled_hlo(ordered=False))
  assert problem.kind == "unordered collectives" and "while" in problem.instruction and "all-reduce" in problem.why
  assert unordered_collective_loops(_compiled_hlo(ordered=True)) == []
