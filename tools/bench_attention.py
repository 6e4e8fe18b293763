"""One attention layer, einsum reference (`dot`) vs blockwise `flash` (and `blocked`, the short-sequence
kernel): time and compiled memory.

  python tools/bench_attention.py [--tokens=16384] [--block-q=128 --block-kv=128] [--runs=5]
                                  [--time-lengths=256,1024,4096] [--memory-lengths=4096,8192,16384,32768]
                                  [--sweep-blocks=128x128,256x256,...] [--window=W]

Time: jitted forward + backward (value and vjp with a random cotangent) at each T with the same
tokens per call (B = tokens / T), N=8, K=4, H=64, fp32, packed documents; median of --runs after
compile and a warm-up call. Memory: `memory_analysis().temp_size_in_bytes` of the compiled
forward + backward, compile only (never run), B=1, an 8B-like head config (N=32, K=8, H=128), bf16;
plus the compile time of flash at each length.

Measured on this 2-core CPU (shared with other jobs, so +-30%; jax 0.10.2, Python 3.11), defaults
(blocks 128 x 128):
  | T    | B  | dot (s) | flash (s) | dot / flash |
  | 256  | 64 | 1.648   | 1.092     | 1.51x       |
  | 1024 | 16 | 6.175   | 2.384     | 2.59x       |
  | 4096 | 4  | 64.173  | 9.949     | 6.45x       |
  | T     | dot temp (GiB) | flash temp (GiB) | flash compile (s) |
  | 4096  | 7.203          | 0.348            | 3.0               |
  | 8192  | 28.406         | 0.696            | 3.2               |
  | 16384 | 112.812        | 1.393            | 2.7               |
  | 32768 | 449.625        | 2.785            | 3.6               |
Block sweeps (--sweep-blocks) that chose the defaults are in maxtrain/models/attention/flash.py.
"""

from __future__ import annotations

import argparse
import platform

import jax
import jax.numpy as jnp
import numpy as np

import harness
from maxtrain.models.attention import flash as fa
from maxtrain.models.attention.blocked import blocked_attention
from maxtrain.models.attention.layer import dot_product_attention


def fwd_bwd(attention):
  """(q, k, v, dout, segment_ids) -> (out, dq, dk, dv), jitted."""
  def step(q_BTNH, k_BSKH, v_BSKH, dout_BTNH, segment_ids_BT):
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, segment_ids_BT), q_BTNH, k_BSKH, v_BSKH)
    return (out, *vjp(dout_BTNH))
  return jax.jit(step)


def inputs(b: int, t: int, n: int, k: int, h: int, dtype, *, abstract: bool = False):
  shapes = [(b, t, n, h), (b, t, k, h), (b, t, k, h), (b, t, n, h)]
  if abstract:
    return [jax.ShapeDtypeStruct(s, dtype) for s in shapes] + [jax.ShapeDtypeStruct((b, t), jnp.int32)]
  rng = np.random.default_rng(0)
  arrays = [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]
  # Packed documents of mean length ~T/4, differing per row.
  segment_ids_BT = jnp.asarray(np.cumsum(rng.random((b, t)) < 4 / t, axis=1), jnp.int32)
  return arrays + [segment_ids_BT]


def time_calls(fns, args, runs: int) -> list[float]:
  """Median seconds per call of each fn after compile and one warm-up, the fns interleaved."""
  compiled = [fn.lower(*args).compile() for fn in fns]
  times = harness.interleaved({str(i): lambda c=c: c(*args) for i, c in enumerate(compiled)}, runs, warmup=1)
  return [times[str(i)].wall for i in range(len(fns))]


def flash(block_q: int, block_kv: int):
  return lambda q, k, v, seg: fa.flash_attention(q, k, v, seg, block_q=block_q, block_kv=block_kv)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--tokens", type=int, default=16384, help="B * T of each timed call")
  parser.add_argument("--heads", default="8,4,64", help="N,K,H of the timed calls")
  parser.add_argument("--block-q", type=int, default=fa.DEFAULT_BLOCK_Q)
  parser.add_argument("--block-kv", type=int, default=fa.DEFAULT_BLOCK_KV)
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--time-lengths", default="256,1024,4096")
  parser.add_argument("--memory-lengths", default="4096,8192,16384,32768")
  parser.add_argument("--sweep-blocks", default="", help="QxKV,... block sizes to time flash with (no dot)")
  parser.add_argument("--window", type=int, default=0, help="W: time flash with a sliding window W against causal "
                      "flash at each --time-lengths, B=1 (no dot)")
  args = parser.parse_args()
  ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
  n, k, h = ints(args.heads)
  print(f"# {platform.node()} {platform.processor() or platform.machine()}, {jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}, python {platform.python_version()}")

  if args.sweep_blocks:
    print(f"\n## flash fwd+bwd, fp32, B*T={args.tokens}, N={n} K={k} H={h}: median of {args.runs} (s)")
    sweeps = [tuple(int(x) for x in pair.split("x")) for pair in args.sweep_blocks.split(",")]
    print("| T | " + " | ".join(f"{bq}x{bkv}" for bq, bkv in sweeps) + " |")
    print("|---" * (len(sweeps) + 1) + "|")
    for t in ints(args.time_lengths):
      x = inputs(args.tokens // t, t, n, k, h, jnp.float32)
      cells = time_calls([fwd_bwd(flash(bq, bkv)) for bq, bkv in sweeps], x, args.runs)
      print(f"| {t} | " + " | ".join(f"{c:.3f}" for c in cells) + " |", flush=True)
    return

  if args.window:
    print(f"\n## flash fwd+bwd, fp32, B=1, N={n} K={k} H={h}, blocks {args.block_q}x{args.block_kv}: a sliding window "
          f"of {args.window} vs causal; median of {args.runs} (s); pairs = key blocks visited")
    print("| T | pairs, window | pairs, causal | window (s) | causal (s) |")
    print("|---|---|---|---|---|")
    for t in ints(args.time_lengths):
      blocks = [-(-t // args.block_q), -(-t // args.block_kv), args.block_q, args.block_kv, t, True]
      pairs = [len(fa._block_pairs(*blocks, w)) for w in (args.window, 0)]
      windowed = lambda q, kk, v, seg: fa.flash_attention(q, kk, v, seg, block_q=args.block_q, block_kv=args.block_kv,
                                                          window=args.window)
      times = time_calls([fwd_bwd(windowed), fwd_bwd(flash(args.block_q, args.block_kv))],
                         inputs(1, t, n, k, h, jnp.float32), args.runs)
      print(f"| {t} | {pairs[0]} | {pairs[1]} | {times[0]:.3f} | {times[1]:.3f} |", flush=True)
    return

  if args.time_lengths:
    print(f"\n## fwd+bwd time, fp32, B*T={args.tokens}, N={n} K={k} H={h}, "
          f"flash blocks {args.block_q}x{args.block_kv}: median of {args.runs}")
    print("| T | B | dot (s) | flash (s) | blocked (s) | dot / flash | flash / blocked |")
    print("|---|---|---|---|---|---|---|")
    for t in ints(args.time_lengths):
      x = inputs(args.tokens // t, t, n, k, h, jnp.float32)
      dot_s, flash_s, blocked_s = time_calls([fwd_bwd(dot_product_attention), fwd_bwd(flash(args.block_q, args.block_kv)),
                                              fwd_bwd(blocked_attention)], x, args.runs)
      print(f"| {t} | {args.tokens // t} | {dot_s:.3f} | {flash_s:.3f} | {blocked_s:.3f} | {dot_s / flash_s:.2f}x | "
            f"{flash_s / blocked_s:.2f}x |", flush=True)

  if args.memory_lengths:
    print(f"\n## compiled fwd+bwd temporaries, bf16, B=1, N=32 K=8 H=128, flash blocks "
          f"{args.block_q}x{args.block_kv} (compile only)")
    print("| T | dot temp (GiB) | flash temp (GiB) | flash compile (s) |")
    print("|---|---|---|---|")
    for t in ints(args.memory_lengths):
      x = inputs(1, t, 32, 8, 128, jnp.bfloat16, abstract=True)
      dot_mem = fwd_bwd(dot_product_attention).lower(*x).compile().memory_analysis().temp_size_in_bytes
      compile_s, _, compiled = harness.once(lambda: fwd_bwd(flash(args.block_q, args.block_kv)).lower(*x).compile())
      flash_mem = compiled.memory_analysis().temp_size_in_bytes
      print(f"| {t} | {dot_mem / 2**30:.3f} | {flash_mem / 2**30:.3f} | {compile_s:.1f} |", flush=True)


if __name__ == "__main__":
  main()
