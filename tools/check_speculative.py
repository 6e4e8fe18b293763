"""MTP speculative greedy decoding against plain greedy on the device at hand (one GPU: about a minute).

  python tools/check_speculative.py [--dtype=float32,bfloat16] [--new-tokens=64] [--layers=2] [--d-model=256]

A random deepseek_v3-shaped model (MLA with the latent cache, one dense layer then dropless MoE, one MTP depth) with
weights of std 0.2 (so that greedy text varies), per compute dtype: plain greedy (`inference/sampling.py`) and
speculative greedy drafted by the MTP depth (`inference/speculative.py`) on the same prompts. Prints, per dtype,
whether the texts are equal, the first position where they differ, the acceptance rate and both speeds (compile
included once: each is run twice, the second timed). Exit 1 when a text differs: a 2-token verify call whose
rounding differs from one-token decoding's can flip a near-tied argmax (in bf16 more than in fp32).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxtrain import config as config_lib
from maxtrain.inference import sampling, speculative
from maxtrain.models import registry


def model_of(dtype: str, layers: int, d_model: int, seed: int = 0) -> nnx.Module:
  m = config_lib.base_config().model
  m.update(dict(family="deepseek_v3", num_layers=layers, d_model=d_model, num_heads=8, num_kv_heads=8,
                d_ff=2 * d_model, vocab_size=512, max_seq_len=512, mtp_layers=1, attention="dot",
                compute_dtype=dtype))
  m.moe.update(dict(num_experts=8, experts_per_token=2, dispatch="dropless", router="sigmoid", first_dense_layers=1,
                    num_shared_experts=1, expert_d_ff=d_model))
  m.mla.update(dict(kv_lora_rank=64, q_lora_rank=96, rope_head_dim=16, nope_head_dim=32, v_head_dim=32,
                    latent_cache=True))
  graphdef, params = registry.abstract(registry.model_config(m))
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda a: jnp.asarray(0.2 * rng.standard_normal(a.shape), a.dtype), params)
  return nnx.merge(graphdef, params)


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--dtype", default="float32,bfloat16")
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--d-model", type=int, default=256)
  args = p.parse_args()
  print(f"{jax.devices()[0].device_kind} x{jax.device_count()}, jax {jax.__version__}, {platform.node()}")
  rng = np.random.default_rng(1)
  prompts = [list(rng.integers(0, 512, n)) for n in (9, 17, 33)]
  failed = False
  for dtype in args.dtype.split(","):
    gen = sampling.Generator(model_of(dtype, args.layers, args.d_model),
                             jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)))
    spec = speculative.SpeculativeGenerator(gen)
    for _ in range(2):  # the second run is timed without compilation
      t0 = time.monotonic()
      plain, _ = gen.generate(prompts, args.new_tokens, sampling.Sampling())
      t1 = time.monotonic()
      drafted, stats = spec.generate(prompts, args.new_tokens)
      t2 = time.monotonic()
    tokens = sum(len(o) for o in plain)
    diffs = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(plain, drafted)]
    equal = plain == drafted
    failed |= not equal
    print(f"{dtype}: equal={equal} first difference per prompt={diffs} acceptance={stats['acceptance_rate']:.3f} "
          f"verify calls={stats['verify_calls']} plain {tokens / (t1 - t0):.1f} tok/s (batched prompts) "
          f"speculative {tokens / (t2 - t1):.1f} tok/s (one prompt at a time)")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
