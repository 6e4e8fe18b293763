"""cuDNN attention against the einsum reference, on a GPU: `python tools/gpu_attention_check.py`.

`model.attention=auto` runs cuDNN on a GPU in bf16 (models/attention/layer.py). This checks, on the GPU itself,
that the call masks packed documents and causality as the reference does, forward and backward, at the length
the benchmarks use: packed rows of several documents, GQA, bf16 inputs, without and with a sliding window. The reference is the einsum kernel in
fp32 on the same bf16-rounded inputs; the bound is the error the einsum kernel itself shows in bf16 (the
floor of bf16 attention), times 4. Prints each error and PASS or FAIL; exit 1 on a failure.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.models.attention import vendor as vendor_attention
from maxtrain.models.attention.flash import flash_attention
from maxtrain.models.attention.layer import dot_product_attention


def value_and_grads(attention, q, k, v, seg, dout):
  out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, seg), q, k, v)
  return [out, *vjp(dout)]


def main() -> int:
  assert jax.default_backend() == "gpu", f"needs a GPU; this backend is {jax.default_backend()!r}"
  rng = np.random.default_rng(0)
  b, t, n, kv, h = 2, 4096, 16, 4, 128
  shapes = [(b, t, n, h), (b, t, kv, h), (b, t, kv, h), (b, t, n, h)]
  q, k, v, dout = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in shapes)
  # ~6 documents per row; with the window (shorter than most documents) the window cuts the keys too.
  seg = jnp.asarray(np.sort(rng.integers(0, 6, (b, t)), axis=1) + 1, jnp.int32)
  f32 = lambda xs: [x.astype(jnp.float32) for x in xs]
  ok = True
  for window in (0, 256):
    reference_kernel = functools.partial(dot_product_attention, window=window)
    reference = jax.jit(lambda *a: value_and_grads(reference_kernel, *f32(a[:3]), a[3], f32([a[4]])[0]))(
        q, k, v, seg, dout)
    kernels = {"dot bf16 (the floor)": reference_kernel,
               "cudnn": functools.partial(vendor_attention.cudnn_attention, window=window),
               "flash bf16": functools.partial(flash_attention, block_q=128, block_kv=128, window=window)}
    errors = {}
    for name, kernel in kernels.items():
      got = jax.jit(lambda q, k, v, s, d: value_and_grads(kernel, q, k, v, s, d))(q, k, v, seg, dout)
      errors[name] = [float(jnp.abs(g.astype(jnp.float32) - r).max() / jnp.abs(r).max())
                      for g, r in zip(got, reference)]
      print(f"window {window:4d} {name:22s} max |error| / max |ref|: out {errors[name][0]:.2e}  "
            f"dq {errors[name][1]:.2e}  dk {errors[name][2]:.2e}  dv {errors[name][3]:.2e}")
    floor = errors["dot bf16 (the floor)"]
    passed = all(e <= 4 * f for e, f in zip(errors["cudnn"], floor))
    print("PASS" if passed else "FAIL", f"window {window}: cudnn within 4x the bf16 einsum's error")
    ok = ok and passed
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
