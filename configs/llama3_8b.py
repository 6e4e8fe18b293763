"""LLaMA 3 8B (Meta's published shapes: 32 layers, d_model 4096, 32 query / 8 key-value heads,
SwiGLU 14336, vocabulary 128256, RoPE theta 500000), for a real tokenizer and token store:

  python -m maxtrain.train --config=configs/llama3_8b.py --config.hardware=h100x8 \
      --config.data.path=/data/fineweb --config.data.tokenizer=/data/llama3/tokenizer.json

Check that it compiles and fits before booking the cluster:

  python -m maxtrain.compile --config=configs/llama3_8b.py --config.hardware=h100x8 --devices 8 \
      --device-memory-gb 80

`HARDWARE` refines the generic presets of maxtrain/config/hardware.py for this model (per node).
"""

from maxtrain.config import base_config


def get_config():
  c = base_config()
  c.output_dir = "runs/llama3_8b"
  m = c.model
  m.num_layers, m.d_model, m.num_heads, m.num_kv_heads = 32, 4096, 32, 8
  m.d_ff, m.vocab_size, m.max_seq_len, m.rope_theta = 14336, 128256, 8192, 500000.0
  m.scan_layers, m.remat = True, "full"
  m.compute_dtype = "bfloat16"
  c.data.corpus = ""  # needs a real token store: set data.path
  c.data.seq_len, c.data.batch_size = 8192, 64
  o = c.optimizer
  o.lr, o.adam_lr, o.warmup_steps, o.min_lr_ratio, o.weight_decay = 3e-4, 3e-4, 2000, 0.1, 0.1
  c.steps = 100_000
  c.checkpoint.every_steps = 500
  c.eval.every_steps, c.eval.batches = 1000, 16
  c.log_every = 10
  return c


# Global batch 64 x 8192 tokens = 0.5M tokens per step. With flash attention (memory linear in T) and
# the chunked loss (no [B, T, V] logits) several sequences go through at once: 4 per GPU on an H100
# (53.2 GiB of 80), the whole batch shard of 8 on an H200 (79.8 GiB of 131); `python -m
# maxtrain.compile`, BENCHMARKS.md. (With the einsum attention, one sequence per GPU was what fit.)
HARDWARE = {
    "h100x8": {"data.batch_size": 64, "optimizer.microbatch_size": 4},
    "h200x8": {"data.batch_size": 64, "optimizer.microbatch_size": 8},
    # 16 batch shards (fsdp=16 x tensor=4) of 4 sequences, one at a time.
    "trn2.48xlarge": {"data.batch_size": 64, "optimizer.microbatch_size": 1},
    # Compile/debug only: the real shapes will not train on a CPU.
    "cpu": {"data.batch_size": 8},
}
