"""Does the accelerator's XLA, like XLA:CPU, copy an accumulator that passes through `lax.switch`, and update it in
place in a 0/1-trip `while_loop`? And what does each cost per tick? The pipeline schedules run one op per stage
per tick (sharding/schedules.py `run_op`): they moved from the switch to the loops because XLA:CPU copied the
stage's f32 weight-gradient accumulator at every op (+1.5 GiB per device at 70B widths, BENCHMARKS.md).

  python3 tools/gpu_pipeline_ops_check.py [--d 16384] [--ticks 24]    # one GPU, ~1 minute

A tick loop (lax.scan over an op table, like the schedules') whose ops are idle, F (x @ w) and BW (a backward-like
matmul and acc += x^T g, acc the size of w: [d, d] f32, 1 GiB at d 16384), each tick by (a) `lax.switch` or
(b) a 0/1-trip while loop per op with w through an optimization barrier (as run_op). Prints each one's compiled
temporaries (memory_analysis) and its time per step (median of 5, after a warm-up). Expected where the backend
behaves like XLA:CPU: (a) about one accumulator (d*d*4 bytes) more temporaries than (b); the same time.
On XLA:CPU (the 2-core VM, --d 1024 --ticks 12, acc 4 MiB): temporaries (a) 9.00 MiB, (b) 5.00 MiB (both hold
the tick's increment); 63.5 vs 69.2 ms per step (one run, noisy).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def program(kind: str, d: int, rows: int):
  def step(w, acc, x, table):
    def ops(w):
      return [lambda h, acc: (h, acc),  # idle
              lambda h, acc: (jnp.tanh(h @ w), acc),  # F
              lambda h, acc: (lambda g: (g, acc + h.T @ g))(jnp.tanh(h @ w.T))]  # BW: dx and the weight gradient

    def tick(carry, op):
      h, acc = carry
      if kind == "switch":
        return jax.lax.switch(op, ops(w), h, acc), None
      out = (h, acc)
      for code in (1, 2):
        def body(c, code=code):
          trip, (h, acc) = c
          w_t, _ = jax.lax.optimization_barrier((w, trip))  # keeps the op's work inside its loop
          return trip + 1, ops(w_t)[code](h, acc)
        _, out = jax.lax.while_loop(lambda c, code=code: c[0] < (op == code).astype(jnp.int32), body,
                                    (jnp.int32(0), out))
      return out, None

    (h, acc), _ = jax.lax.scan(tick, (x, acc), table)
    return acc, h
  return jax.jit(step, donate_argnums=1)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--d", type=int, default=16384)
  parser.add_argument("--rows", type=int, default=256)
  parser.add_argument("--ticks", type=int, default=24)
  args = parser.parse_args()
  d, rows = args.d, args.rows
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind} ({jax.devices()[0].platform}); d {d}, rows {rows}, "
        f"accumulator {d * d * 4 / 2**20:.1f} MiB")
  table = jnp.asarray(np.resize([1, 2, 0], args.ticks), jnp.int32)  # F, BW, idle, ...
  key = jax.random.key(0)
  w = jax.random.normal(key, (d, d), jnp.float32) / d**0.5
  x = jax.random.normal(key, (rows, d), jnp.float32)
  results = {}
  for kind in ("switch", "while"):
    fn = program(kind, d, rows)
    compiled = fn.lower(w, jnp.zeros((d, d), jnp.float32), x, table).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    times = []
    acc = jnp.zeros((d, d), jnp.float32)
    for i in range(6):
      start = time.perf_counter()
      acc, h = compiled(w, acc, x, table)
      jax.block_until_ready((acc, h))
      if i:
        times.append(time.perf_counter() - start)
    results[kind] = np.asarray(acc)
    print(f"  ({'a' if kind == 'switch' else 'b'}) {kind:7} temporaries {temp / 2**20:10.2f} MiB   "
          f"step {statistics.median(times) * 1e3:9.2f} ms", flush=True)
  same = np.allclose(results["switch"], results["while"], rtol=1e-5, atol=1e-5 * np.abs(results["switch"]).max())
  print(f"  same accumulator after 6 steps: {same}")


if __name__ == "__main__":
  main()
