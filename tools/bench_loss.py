"""Plain vs chunked head cross-entropy: `python tools/bench_loss.py [--repeats=N] [--chunks=...]`.

Prints, for the jitted forward+backward of the step's objective (sum of ce + z_loss * log_z^2 over a
random loss mask, gradients wrt x and head; see `maxtrain/program/loss.py`):
- wall time on this machine (median of `--repeats` runs after a warm-up; compile excluded) and the
  compiled temp memory, at the default model's dims and at a large vocabulary, for several chunk sizes;
- compiled temp memory only (compile, never run) at LLaMA 3 8B dims in bf16 compute, on one device
  and, with `--sharded`, on 8 fake CPU devices as the h100x8 preset shards it (fsdp=8).

Shape legend: B batch, T length, D model, V vocab.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

from maxtrain.runtime.platform import fake_cpu_devices

if "--sharded" in sys.argv:  # fake devices must be set before jax starts its backend
  fake_cpu_devices(8)  # before jax starts its backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import harness  # noqa: E402
from maxtrain import config as config_lib  # noqa: E402
from maxtrain.program import loss  # noqa: E402
from maxtrain.sharding import mesh as mesh_lib  # noqa: E402
from maxtrain.sharding import rules as rules_lib  # noqa: E402
from maxtrain.sharding.layout import BATCH_LOGICAL, Layout  # noqa: E402

Z_LOSS = 1e-4


def value_and_grads_fn(chunk_tokens: int, compute_dtype, batch_shards: int = 1):
  """jit-able (objective, (d x, d head)) of the step's objective through `loss.head_losses`."""
  def f(x_BTD, head_DV, targets_BT, mask_BT):
    def objective(x_BTD, head_DV):
      ce_BT, log_z_BT = loss.head_losses(x_BTD, head_DV, targets_BT, chunk_tokens=chunk_tokens,
                                         compute_dtype=compute_dtype, batch_shards=batch_shards)
      return jnp.sum(ce_BT * mask_BT) + Z_LOSS * jnp.sum(jnp.square(log_z_BT) * mask_BT)
    return jax.value_and_grad(objective, (0, 1))(x_BTD, head_DV)
  return f


def abstract_inputs(B, T, D, V, x_dtype, shardings=(None,) * 4):
  x, head, targets, mask = shardings
  return (jax.ShapeDtypeStruct((B, T, D), x_dtype, sharding=x), jax.ShapeDtypeStruct((D, V), jnp.float32, sharding=head),
          jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=targets),
          jax.ShapeDtypeStruct((B, T), jnp.float32, sharding=mask))


def concrete_inputs(B, T, D, V):
  kx, kh, kt, km = jax.random.split(jax.random.key(0), 4)
  return (jax.random.normal(kx, (B, T, D), jnp.float32), jax.random.normal(kh, (D, V), jnp.float32) / np.sqrt(D),
          jax.random.randint(kt, (B, T), 0, V), jax.random.bernoulli(km, 0.9, (B, T)).astype(jnp.float32))


def mib(num_bytes: float) -> str:
  return f"{num_bytes / 2**20:9.1f}"


def time_table(B, T, D, V, chunks, repeats):
  print(f"\n## fwd+bwd time, fp32, 1 device: B={B} T={T} (B*T={B * T}) D={D} V={V}; "
        f"full fp32 logits = {mib(B * T * V * 4).strip()} MiB")
  print(f"| chunk_tokens | ms (median of {repeats}) | min ms | vs plain | temp MiB |")
  print("| --- | --- | --- | --- | --- |")
  args = concrete_inputs(B, T, D, V)
  compiled = {c: jax.jit(value_and_grads_fn(c, jnp.float32)).lower(*args).compile() for c in chunks}
  times = harness.interleaved({str(c): lambda c=c: compiled[c](*args) for c in chunks}, repeats, warmup=1)
  plain = times["0"].wall if chunks[0] == 0 else None
  for c in chunks:
    med = times[str(c)].wall
    ratio = f"{med / plain:.2f}x" if plain else "-"
    print(f"| {c or 'plain'} | {1e3 * med:.1f} | {1e3 * times[str(c)].min_wall:.1f} | {ratio} | "
          f"{mib(compiled[c].memory_analysis().temp_size_in_bytes).strip()} |")


def memory_table(B, T, D, V, chunks, compute_dtype, mesh=None, layout: Layout | None = None):
  where = "1 device" if mesh is None else f"8 fake devices, mesh {dict(mesh.shape)}"
  print(f"\n## compiled fwd+bwd memory (compile only), {np.dtype(compute_dtype).name} compute, {where}: "
        f"B={B} T={T} D={D} V={V}; full fp32 logits = {mib(B * T * V * 4).strip()} MiB")
  print("| chunk_tokens | temp MiB (per device) | argument MiB | output MiB | compile s |")
  print("| --- | --- | --- | --- | --- |")
  shardings, batch_shards = (None,) * 4, 1
  if mesh is not None:  # the model's logical names: the final activations, the head, the batch's rows
    specs = (layout.spec(BATCH_LOGICAL + ("act_embed",)), layout.spec(("embed", "vocab")), layout.spec(BATCH_LOGICAL),
             layout.spec(BATCH_LOGICAL))
    shardings = tuple(NamedSharding(mesh, s) for s in specs)
    batch_shards = layout.shards("act_batch")
  args = abstract_inputs(B, T, D, V, compute_dtype, shardings)
  for c in chunks:
    out_shardings = None if mesh is None else (NamedSharding(mesh, P()), shardings[:2])
    fn = jax.jit(value_and_grads_fn(c, compute_dtype, batch_shards), out_shardings=out_shardings)
    compile_s, _, compiled = harness.once(lambda: fn.lower(*args).compile())
    m = compiled.memory_analysis()
    print(f"| {c or 'plain'} | {mib(m.temp_size_in_bytes).strip()} | {mib(m.argument_size_in_bytes).strip()} | "
          f"{mib(m.output_size_in_bytes).strip()} | {compile_s:.1f} |")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--repeats", type=int, default=5, help="timed runs per variant")
  parser.add_argument("--chunks", default="512,1024,2048,4096", help="chunk_tokens values besides plain")
  parser.add_argument("--skip-time", action="store_true", help="only the compiled-memory tables")
  parser.add_argument("--skip-8b", action="store_true", help="skip the 8B compiled-memory tables")
  parser.add_argument("--sharded", action="store_true", help="also the 8B table on 8 fake devices (fsdp=8)")
  args = parser.parse_args()
  chunks = [0] + [int(c) for c in args.chunks.split(",")]
  print(f"# bench_loss: {platform.node()} {platform.machine()}, {os.cpu_count()} cpus, "
        f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} devices, "
        f"matmul precision {jax.config.jax_default_matmul_precision or 'default'}")
  if not args.skip_time:
    time_table(16, 256, 256, 384, chunks, args.repeats)  # the default model's dims
    time_table(4, 1024, 512, 32768, chunks, args.repeats)
  if not args.skip_8b:
    memory_table(1, 8192, 4096, 128256, chunks, jnp.bfloat16)
    if args.sharded:  # the h100x8 preset's mesh and rules, as the trainer lays them out
      cfg = config_lib.load(["--config.hardware=h100x8"])
      mesh_layout = mesh_lib.from_config(cfg.mesh, 8)
      layout = Layout(mesh_layout.sizes, rules_lib.get(cfg.mesh.rules))
      mesh = mesh_lib.make_mesh(mesh_layout)
      memory_table(8, 8192, 4096, 128256, chunks, jnp.bfloat16, mesh, layout)  # chunk_tokens are per device


if __name__ == "__main__":
  main()
