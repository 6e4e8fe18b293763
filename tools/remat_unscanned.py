"""Does `model.remat=full` shrink an unscanned layer stack's memory on this backend? `python tools/remat_unscanned.py`

Families whose layers differ (Gemma 2 and 3, GPT-OSS: each layer its own window or RoPE) run unscanned. On XLA:CPU
the compiled temporaries of forward + backward grow by the same amount per layer with remat full as without it:
XLA expands optimization barriers before CSE, so each layer's recomputation merges back into its forward and the
remat is undone; inside a scanned stack the backward's recomputation is in another loop and stays. This prints,
for a small bf16 decoder (d_model 512, 8 x 2048 tokens, flash), the compiled temporaries at 2 and 6 layers,
scanned and unscanned, remat none and full, and the per-layer growth. On a GPU (XLA's GPU pipeline) run it to see
whether an unscanned preset's AOT figure on CPU (docs/fitting.md) overstates the device's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain import config as config_lib
from maxtrain.models import registry

B, T, DEPTHS = 8, 2048, (2, 6)


def temporaries_mib(cfg) -> float:
  graphdef, params = registry.abstract(cfg)
  tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)

  def loss(p, t):
    x, _ = nnx.merge(graphdef, p).features(t, jnp.ones_like(t), jnp.broadcast_to(jnp.arange(T), t.shape))
    return jnp.sum(x.astype(jnp.float32) ** 2)

  compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 2**20


def main() -> None:
  m = config_lib.base_config().model
  m.update(dict(d_model=512, num_heads=4, num_kv_heads=2, d_ff=2048, vocab_size=256, max_seq_len=T, attention="flash",
                compute_dtype="bfloat16"))
  base = registry.model_config(m)
  print(f"backend {jax.default_backend()}, jax {jax.__version__}: compiled temporaries of forward + backward (MiB)")
  for scan in (True, False):
    for remat in ("none", "full"):
      mib = [temporaries_mib(dataclasses.replace(base, num_layers=n, scan_layers=scan, remat=remat)) for n in DEPTHS]
      per_layer = (mib[1] - mib[0]) / (DEPTHS[1] - DEPTHS[0])
      print(f"{'scanned' if scan else 'unscanned':9s} remat {remat:4s}: {mib[0]:8.0f} at {DEPTHS[0]} layers, "
            f"{mib[1]:8.0f} at {DEPTHS[1]}: {per_layer:7.1f} per layer", flush=True)


if __name__ == "__main__":
  main()
