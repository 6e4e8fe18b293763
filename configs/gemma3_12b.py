"""Gemma 3 12B, text (Google's published shapes: 48 layers, d_model 3840, 16 query / 8 key-value heads of
head_dim 256, (1 + w) qk-norm, GELU-tanh GLU 15360, vocabulary 262208 tied, query_pre_attn_scalar 256; five
local layers with a 1024-token window and RoPE base 1e4, then one global layer with RoPE base 1e6 scaled
linearly by 8), on LLaMA 3 8B's training recipe (configs/llama3_8b.py) at 8192 tokens per sequence, so the
local layers' window is shorter than the sequence and flash skips the key blocks outside it. Continue a
published checkpoint (`Gemma3ForCausalLM`) with `python -m maxtrain.convert from-hf`. The layers are unscanned
(each its own window and RoPE), and XLA:CPU's AOT figure for unscanned layers ignores model.remat, so the fit
is checked on a scanned stand-in with the same parameters and activations (docs/fitting.md, the flags there):

  python -m maxtrain.compile --config=configs/gemma3_12b.py --config.hardware=h100x8 --devices 8 \
      --device-memory-gb 80 --config.model.family=llama --config.model.scan_layers=True ...
"""

from pathlib import Path

from maxtrain.config import load_file

_BASE = Path(__file__).with_name("llama3_8b.py")


def get_config():
  c, _ = load_file(_BASE)
  c.output_dir = "runs/gemma3_12b"
  m = c.model
  m.family = "gemma3"  # Gemma's norms and embedding scale, qk-norm, GELU-tanh, 5 local : 1 global layers
  m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim = 48, 3840, 16, 8, 256
  m.d_ff, m.vocab_size, m.norm_eps, m.tie_embeddings = 15360, 262208, 1e-6, True
  m.query_pre_attn_scalar, m.sliding_window = 256.0, 1024
  m.rope_theta, m.rope_scaling, m.rope_scaling_factor, m.rope_local_theta = 1_000_000.0, "linear", 8.0, 10_000.0
  m.attention = "flash"  # head_dim 256: no cuDNN; flash's work on the local layers grows with the window
  return c


# The 8B's per-node layout; per GPU half the 8B's sequences at once: Gemma 3's vocabulary and d_ff are larger,
# and at 4 sequences per H100 XLA:CPU's compiled peak leaves 7% of 80 GB (docs/fitting.md has the table).
HARDWARE = {**load_file(_BASE)[1], "h100x8": {"data.batch_size": 64, "optimizer.microbatch_size": 2},
            "h200x8": {"data.batch_size": 64, "optimizer.microbatch_size": 4}}
