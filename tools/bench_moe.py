"""MoE feed-forward layer on one CPU device: capacity-based vs dropless dispatch, against the dense
SwiGLU of the same active width.

  python tools/bench_moe.py [--batch=16] [--length=256] [--d-model=256] [--experts=8] [--top-k=2]
                            [--expert-d-ff=384] [--capacity-factor=1.25] [--runs=5]

Jitted forward + backward (gradients of the sum of squares of the output w.r.t. input and weights) of
one layer, fp32, random inputs, on one device; median of --runs after compile and a warm-up, the
variants interleaved (`tools/harness.py`). Defaults are configs/moe.py's shapes (the default run's batch):
  dense      the SwiGLU MLP of width experts_per_token x expert_d_ff (the dense layer of equal active size)
  capacity   models/moe.py with model.moe.dispatch=capacity (slots per expert and sequence, gather/scatter)
  dropless   models/moe.py with model.moe.dispatch=dropless (tokens sorted by expert, lax.ragged_dot;
             XLA:CPU lowers ragged_dot densely: every expert's weights against every row)
"""

from __future__ import annotations

import argparse
import platform

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import harness
from maxtrain.models.layers import MLP
from maxtrain.models.moe import MoE, MoEConfig


def _layer(args, name: str):
  common = dict(init_std=0.02, out_std=0.02, param_dtype=jnp.float32, compute_dtype=jnp.float32,
                rngs=nnx.Rngs(params=0))
  with nnx.use_eager_sharding(False):
    if name == "dense":
      return MLP(args.d_model, args.top_k * args.expert_d_ff, **common)
    cfg = MoEConfig(num_experts=args.experts, experts_per_token=args.top_k, expert_d_ff=args.expert_d_ff,
                    dispatch=name, capacity_factor=args.capacity_factor)
    return MoE(args.d_model, cfg, **common)


def _step(layer):
  graphdef, params = nnx.split(layer)

  def loss(p, x):
    y = nnx.merge(graphdef, p)(x)
    y = y[0] if isinstance(y, tuple) else y
    return jnp.sum(jnp.square(y))

  return jax.jit(jax.grad(loss, argnums=(0, 1))), params


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  for flag, default in (("batch", 16), ("length", 256), ("d-model", 256), ("experts", 8), ("top-k", 2),
                        ("expert-d-ff", 384), ("runs", 5)):
    parser.add_argument(f"--{flag}", type=int, default=default)
  parser.add_argument("--capacity-factor", type=float, default=1.25)
  args = parser.parse_args()
  x = jnp.asarray(np.random.default_rng(0).standard_normal((args.batch, args.length, args.d_model)), jnp.float32)
  steps = {name: _step(_layer(args, name)) for name in ("dense", "capacity", "dropless")}
  # Two untimed calls each: the compile, then a warm-up.
  times = harness.interleaved({name: lambda fn=fn, p=params: fn(p, x) for name, (fn, params) in steps.items()},
                             args.runs, warmup=2)
  print(f"{platform.processor() or platform.machine()}, jax {jax.__version__}, {jax.devices()[0].device_kind}; "
        f"B={args.batch} T={args.length} D={args.d_model} E={args.experts} K={args.top_k} F={args.expert_d_ff} "
        f"capacity_factor={args.capacity_factor}; fwd+bwd, median of {args.runs}")
  dense = times["dense"].wall
  for name, t in times.items():
    print(f"  {name:<9s} {t.wall * 1e3:8.1f} ms  ({t.wall / dense:.2f}x dense)  CPU {t.cpu * 1e3:8.1f} ms")


if __name__ == "__main__":
  main()
