"""Context-parallel attention on fake CPU devices: what the all-gather costs, and what load balancing saves.

  python tools/bench_context.py [--context=4] [--fsdp=2] [--batch=2] [--length=4096] [--runs=3]

Jitted forward + backward (vjp with a random cotangent) of one attention layer, N=8, K=2, H=64, fp32,
packed documents, blocks 128 x 128, on a mesh of fsdp x context fake CPU devices; median of --runs
after compile and a warm-up, the variants interleaved (`tools/harness.py`):
  gathered   `sharding/context_attention.py` as the model runs it: K/V, segment ids and positions
             all-gathered over `context`, zigzag chunks, wholly masked block pairs skipped.
  no-comm    the same computation with the all-gather replaced by a local copy of the right shape
             (wrong numbers, same work): gathered - no-comm is the most a ring (ppermute overlapped
             with compute) could hide.
  unbalanced natural token order, every block pair visited (no skipping, mask from positions): what
             a context-parallel kernel without the zigzag layout computes.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform

from maxtrain.runtime.platform import fake_cpu_devices

fake_cpu_devices(8)  # before jax starts its backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import harness  # noqa: E402
from maxtrain import config as config_lib  # noqa: E402
from maxtrain.models.attention.flash import flash_attention_qkv  # noqa: E402
from maxtrain.sharding import context_attention as ca  # noqa: E402
from maxtrain.sharding import mesh as mesh_lib  # noqa: E402
from maxtrain.sharding import rules as rules_lib  # noqa: E402
from maxtrain.sharding.rules import DEFAULT_RULES  # noqa: E402

BLOCK = 128


def _local_copy(x, shards):
  return jnp.concatenate([x] * shards, axis=1)


def _variant(mesh, name: str):
  if name == "gathered":
    return ca.sharded(mesh, DEFAULT_RULES, flash_attention_qkv, block_q=BLOCK, block_kv=BLOCK)
  axes = rules_lib.mesh_axes(DEFAULT_RULES["act_length"])
  shards = mesh.shape[axes[0]]

  def body(q, k, v, seg, pos):
    if name == "no-comm":
      k_, v_, seg_, pos_ = (_local_copy(x, shards) for x in (k, v, seg, pos))
      chunk = q.shape[1] // 2
      block = ca._block_size(chunk, BLOCK)
      pairs = ca.block_pairs(jax.lax.axis_index(axes), shards, chunk, block, block)
      return flash_attention_qkv(q, k_, v_, seg, seg_, pos, pos_, block_q=block, block_kv=block, block_pairs=pairs)
    gather = functools.partial(jax.lax.all_gather, axis_name=axes, axis=1, tiled=True)
    return flash_attention_qkv(q, gather(k), gather(v), seg, gather(seg), pos, gather(pos), block_q=BLOCK,
                               block_kv=BLOCK)

  spec = lambda logical: rules_lib.logical_to_mesh(logical, DEFAULT_RULES)
  return jax.shard_map(body, mesh=mesh, in_specs=(spec(ca.Q_LOGICAL), spec(ca.KV_LOGICAL), spec(ca.KV_LOGICAL),
                                                   spec(ca.IDS_LOGICAL), spec(ca.IDS_LOGICAL)),
                       out_specs=spec(ca.Q_LOGICAL))


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--context", type=int, default=4)
  p.add_argument("--fsdp", type=int, default=2)
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--length", type=int, default=4096)
  p.add_argument("--runs", type=int, default=3)
  args = p.parse_args()
  # The mesh as the trainer lays it out from its config keys (sharding/mesh.py names the axes).
  num_devices = args.fsdp * args.context
  cfg = config_lib.load([f"--config.mesh.fsdp={args.fsdp}", f"--config.mesh.context={args.context}"])
  layout = mesh_lib.from_config(cfg.mesh, num_devices)
  mesh = mesh_lib.make_mesh(layout, jax.devices()[:num_devices])
  b, t, n, k, h = args.batch, args.length, 8, 2, 64
  rng = np.random.default_rng(0)
  q, kk, v, dout = (rng.standard_normal(s).astype(np.float32) for s in [(b, t, n, h), (b, t, k, h), (b, t, k, h),
                                                                         (b, t, n, h)])
  seg = (np.sort(rng.integers(0, 3, (b, t)), axis=1) + 1).astype(np.int32)
  starts = np.concatenate([np.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  idx = np.arange(t)[None].repeat(b, 0)
  pos = (idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=1)).astype(np.int32)
  zig = ca.zigzag_order(t, args.context)
  inputs = {"gathered": [x[:, zig] for x in (q, kk, v, seg, pos, dout)],
            "no-comm": [x[:, zig] for x in (q, kk, v, seg, pos, dout)],
            "unbalanced": [q, kk, v, seg, pos, dout]}
  fns = {}
  with jax.set_mesh(mesh):
    for name in inputs:
      attend = _variant(mesh, name)

      @jax.jit
      def run(q, k, v, seg, pos, dout, attend=attend):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, seg, pos), q, k, v)
        return out, vjp(dout)

      fns[name] = functools.partial(run, *inputs[name])
    times = harness.interleaved(fns, args.runs, warmup=1)  # the warm-up call compiles
  print(f"{platform.machine()} {os.cpu_count()} cores, jax {jax.__version__}, Python {platform.python_version()}; "
        f"mesh {layout.describe()}, B={b} T={t} N={n} K={k} H={h} fp32, fwd+bwd, median of {args.runs}")
  base = times["gathered"].wall
  for name, ts in times.items():
    print(f"  {name:<11} {ts.wall:8.3f} s  ({ts.wall / base:.2f}x gathered)  CPU {ts.cpu:8.3f} s  "
          f"runs {', '.join(f'{x:.3f}' for x in ts.walls)}")


if __name__ == "__main__":
  main()
