"""Does XLA on this GPU keep `lax.ragged_dot` a grouped matmul, or expand it densely over every expert as XLA:CPU
does? The answer decides whether `maxtrain.compile`'s memory stand-in for dropless MoE (`program/fit.py`
memory_standin: `models/moe_dispatch.py` balanced_ragged_dot) is what a GPU run needs (docs/fitting.md).

  python3 tools/gpu_ragged_dot_memory.py          # on one GPU: compiles only, nothing runs; ~1 minute

One Qwen3-30B-A3B expert layer's grouped SwiGLU (128 experts of 2048 x 768, 8 per token) on 4096 tokens in bf16,
forward + backward, compiled three ways, each in a fresh process (XLA reads its flags once): (a) lax.ragged_dot
with XLA's defaults, (b) the same with --xla_gpu_experimental_use_ragged_dot_fusion=true (cuDNN's grouped GEMM,
cuDNN >= 9.22), (c) the stand-in. Prints each one's compiled temporaries and whether the optimized HLO still
holds a ragged-dot (or a cuDNN fusion).
On XLA:CPU (this script on the 2-core VM, 9 s): (a) and (b) 129.3 GiB, (c) 2.44 GiB. Expected on a GPU if XLA
expands it (its RaggedDotRewriter): (a) near XLA:CPU's; then the stand-in is the memory of a grouped-matmul kernel
maxtrain does not use on the GPU yet, and dropless presets need one (or (b), where it holds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

E, D, F, K, TOKENS = 128, 2048, 768, 8, 4096


def measure(kind: str) -> dict:
  import jax
  import jax.numpy as jnp

  from maxtrain.models import moe_dispatch

  matmul = moe_dispatch.balanced_ragged_dot if kind == "standin" else jax.lax.ragged_dot
  n = TOKENS * K
  x = jax.ShapeDtypeStruct((n, D), jnp.bfloat16)
  weights = (jax.ShapeDtypeStruct((E, D, F), jnp.bfloat16),) * 2 + (jax.ShapeDtypeStruct((E, F, D), jnp.bfloat16),)
  sizes = jax.ShapeDtypeStruct((E,), jnp.int32)

  def loss(x, weights, sizes):
    y = moe_dispatch.grouped_swiglu(x, sizes, None, weights, matmul=matmul)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, weights, sizes).compile()
  hlo = compiled.as_text()
  m = compiled.memory_analysis()
  return {"kind": kind, "device": jax.devices()[0].device_kind, "temporaries_gib": m.temp_size_in_bytes / 2**30,
          "ragged_dot_in_hlo": "ragged-dot" in hlo, "cudnn_fusion_in_hlo": "cudnn" in hlo}


def main() -> None:
  if len(sys.argv) > 1 and sys.argv[1] == "--one":
    print(json.dumps(measure(sys.argv[2])))
    return
  runs = {"ragged_dot (XLA defaults)": ("ragged", ""),
          "ragged_dot + cuDNN ragged-dot fusion": ("ragged", "--xla_gpu_experimental_use_ragged_dot_fusion=true"),
          "stand-in (balanced_ragged_dot)": ("standin", "")}
  print(f"grouped SwiGLU forward + backward: {TOKENS} tokens x {K} experts each of {E}, D {D}, F {F}, bf16")
  for name, (kind, flag) in runs.items():
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()}
    proc = subprocess.run([sys.executable, __file__, "--one", kind], env=env, capture_output=True, text=True)
    if proc.returncode:
      print(f"  {name:<40s} failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
      continue
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  {name:<40s} temporaries {r['temporaries_gib']:8.3f} GiB  ragged-dot kept: {r['ragged_dot_in_hlo']}  "
          f"cuDNN: {r['cudnn_fusion_in_hlo']}  ({r['device']})")


if __name__ == "__main__":
  main()
