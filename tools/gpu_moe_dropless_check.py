"""Dropless expert parallelism's `lax.ragged_all_to_all` on an accelerator: `python tools/gpu_moe_dropless_check.py`.

XLA:CPU cannot compile `ragged_all_to_all`, so the tests run the padded transport and only lower the ragged
one (sharding/ragged_dispatch.py). This compiles and runs both transports on every visible device (the
expert axis over all of them; with one device the exchange is still the real op, with one participant),
forward and backward, against the single-program dropless layer (models/moe_dispatch.dropless) in fp32
at the highest matmul precision, and times one layer's forward + backward for each (median of 5 after a
warm-up). Prints each error and PASS or FAIL; exit 1 on a failure. Takes well under a minute on one GPU.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain import config as config_lib
from maxtrain.models import moe as moe_lib
from maxtrain.models import moe_dispatch
from maxtrain.program.plan import validate
from maxtrain.sharding import ragged_dispatch
from maxtrain.sharding.mesh import make_mesh


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  for flag, default in (("length", 1024), ("d-model", 1024), ("expert-d-ff", 512)):
    parser.add_argument(f"--{flag}", type=int, default=default)
  args = parser.parse_args()
  assert jax.default_backend() != "cpu", "needs an accelerator (XLA:CPU has no ragged-all-to-all)"
  n = jax.device_count()
  # 8 local experts and 4 sequences per device
  E, K, B, T, D, F = 8 * n, 2, 4 * n, args.length, args.d_model, args.expert_d_ff
  cfg = config_lib.load([f"--config.model.moe.num_experts={E}", "--config.model.moe.dispatch=dropless",
                         "--config.mesh.fsdp=1", f"--config.mesh.expert={n}", "--config.data.batch_size=" + str(B)])
  plan = validate(cfg, n, require_data=False)
  mesh = make_mesh(plan.mesh)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
  experts, weights, _ = moe_lib.route(x, jnp.asarray(rng.standard_normal((D, E)), jnp.float32), jnp.zeros(E),
                                      moe_lib.MoEConfig(num_experts=E, experts_per_token=K))
  gate, up = (jnp.asarray(rng.standard_normal((E, D, F)) / np.sqrt(D), jnp.float32) for _ in range(2))
  down = jnp.asarray(rng.standard_normal((E, F, D)) / np.sqrt(F), jnp.float32)
  cotangent = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

  def value_and_grads(fn):
    loss = lambda x, w, g, u, d: jnp.sum(fn(x, w, g, u, d) * cotangent)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))

  ok = True
  with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
    ref = jax.tree.leaves(value_and_grads(lambda x, w, *ws: moe_dispatch.dropless(x, experts, w, ws))(
        x, weights, gate, up, down))
    for transport in ("ragged", "padded"):
      parallel = ragged_dispatch.sharded(mesh, plan.layout.rules, grouped_ffn=moe_dispatch.grouped_swiglu,
                                         num_experts=E, transport=transport)
      step = value_and_grads(lambda x, w, *ws: parallel(x, experts, w, *ws)[0])
      got = jax.tree.leaves(step(x, weights, gate, up, down))
      for name, a, b in zip(("loss", "dx", "dweights", "dgate", "dup", "ddown"), got, ref):
        error = float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))
        passed = error < 1e-4
        ok &= passed
        print(f"{transport:6s} {name:8s} max |err| / max |ref| = {error:.2e}  {'PASS' if passed else 'FAIL'}")
      jax.block_until_ready(step(x, weights, gate, up, down))
      times = []
      for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(step(x, weights, gate, up, down))
        times.append(time.perf_counter() - t0)
      print(f"{transport:6s} fwd+bwd {np.median(times) * 1e3:.2f} ms (median of 5)")
  print(f"{jax.devices()[0].device_kind} x {n}, jax {jax.__version__}; B={B} T={T} D={D} E={E} K={K} F={F}: "
        f"{'PASS' if ok else 'FAIL'}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
