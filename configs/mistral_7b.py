"""Mistral 7B v0.1 (Mistral's published shapes: 32 layers, d_model 4096, 32 query / 8 key-value heads,
SwiGLU 14336, vocabulary 32000, a 4096-token sliding window on every layer), on LLaMA 3 8B's training
recipe (configs/llama3_8b.py) at 8192 tokens per sequence, so the window is shorter than the sequence
and flash skips the key blocks outside it. Check the fit first:

  python -m maxtrain.compile --config=configs/mistral_7b.py --config.hardware=h100x8 --devices 8 \
      --device-memory-gb 80
"""

from pathlib import Path

from maxtrain.config import load_file

_BASE = Path(__file__).with_name("llama3_8b.py")


def get_config():
  c, _ = load_file(_BASE)
  c.output_dir = "runs/mistral_7b"
  m = c.model
  m.family, m.sliding_window = "mistral", 4096
  m.d_ff, m.vocab_size, m.rope_theta = 14336, 32000, 10000.0
  m.attention = "flash"  # blocked would keep T x T probabilities; flash's work grows with the window
  return c


HARDWARE = load_file(_BASE)[1]  # the 8B's per-node batch and microbatch sizes
