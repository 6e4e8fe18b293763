"""Qwen3 32B (Qwen's published shapes: 64 layers, d_model 5120, 64 query / 8 key-value heads of head_dim 128,
per-head qk-norm, SwiGLU 25600, vocabulary 151936, RoPE theta 1e6), on LLaMA 3 70B's training recipe
(configs/llama3_70b.py: FSDP across nodes, tensor parallelism over a node's 8 GPUs). Continue a published
checkpoint with `python -m maxtrain.convert from-hf`, whose config.py has these keys; check the fit first,
e.g. on 2 nodes of 8 H100s:

  python -m maxtrain.compile --config=configs/qwen3_32b.py --config.hardware=h100x8 --devices 16 \
      --device-memory-gb 80
"""

from pathlib import Path

from maxtrain.config import load_file

_BASE = Path(__file__).with_name("llama3_70b.py")


def get_config():
  c, _ = load_file(_BASE)
  c.output_dir = "runs/qwen3_32b"
  m = c.model
  m.family = "qwen3"  # qk-norm on
  m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim = 64, 5120, 64, 8, 128
  m.d_ff, m.vocab_size, m.rope_theta, m.norm_eps = 25600, 151936, 1_000_000.0, 1e-6
  c.optimizer.lr = c.optimizer.adam_lr = 3e-4 / 2  # between the 8B's and the 70B's
  return c


HARDWARE = load_file(_BASE)[1]  # the 70B's per-node layout: tensor=8 inside a node, FSDP across nodes
