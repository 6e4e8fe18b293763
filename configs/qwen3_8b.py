"""Qwen3 8B (Qwen's published shapes: 36 layers, d_model 4096, 32 query / 8 key-value heads of head_dim
128, per-head qk-norm, SwiGLU 12288, vocabulary 151936, RoPE theta 1e6), on LLaMA 3 8B's training recipe
(configs/llama3_8b.py). Continue a published checkpoint with `python -m maxtrain.convert from-hf`, whose
config.py has these keys; check the fit first:

  python -m maxtrain.compile --config=configs/qwen3_8b.py --config.hardware=h100x8 --devices 8 \
      --device-memory-gb 80
"""

from pathlib import Path

from maxtrain.config import load_file

_BASE = Path(__file__).with_name("llama3_8b.py")


def get_config():
  c, _ = load_file(_BASE)
  c.output_dir = "runs/qwen3_8b"
  m = c.model
  m.family = "qwen3"  # qk-norm on
  m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim = 36, 4096, 32, 8, 128
  m.d_ff, m.vocab_size, m.rope_theta, m.norm_eps = 12288, 151936, 1_000_000.0, 1e-6
  return c


HARDWARE = load_file(_BASE)[1]  # the 8B's per-node batch and microbatch sizes
