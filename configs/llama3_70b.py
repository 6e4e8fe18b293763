"""LLaMA 3 70B (Meta's published shapes: 80 layers, d_model 8192, 64 query / 8 key-value heads,
SwiGLU 28672, vocabulary 128256, RoPE theta 500000), for a real tokenizer and token store.

70B with fp32 parameters and Adam moments is ~1.1 TB of state: it needs FSDP across nodes
(`mesh.dcn_fsdp`, filled with the node count). Check it fits, e.g. on 8 nodes of 8 H100s:

  python -m maxtrain.compile --config=configs/llama3_70b.py --config.hardware=h100x8 --devices 64 \
      --device-memory-gb 80

`HARDWARE` refines the generic presets of maxtrain/hardware.py for this model (per node).
"""

from maxtrain.config import base_config


def get_config():
  c = base_config()
  c.output_dir = "runs/llama3_70b"
  m = c.model
  m.num_layers, m.d_model, m.num_heads, m.num_kv_heads = 80, 8192, 64, 8
  m.d_ff, m.vocab_size, m.max_seq_len, m.rope_theta = 28672, 128256, 8192, 500000.0
  m.scan_layers, m.remat = True, "full"
  m.compute_dtype = "bfloat16"
  c.data.corpus = ""  # needs a real token store: set data.path
  c.data.seq_len, c.data.batch_size = 8192, 256
  o = c.optimizer
  o.lr, o.adam_lr, o.warmup_steps, o.min_lr_ratio, o.weight_decay = 1.5e-4, 1.5e-4, 2000, 0.1, 0.1
  c.steps = 100_000
  c.checkpoint.every_steps = 250
  c.eval.every_steps, c.eval.batches = 1000, 16
  c.log_every = 10
  c.hardware = "cpu"
  return c


_ACROSS_NODES = {"mesh.dcn_data": 1, "mesh.dcn_fsdp": -1}  # parameters and optimizer state sharded over all nodes
HARDWARE = {
    "h100x8": {**_ACROSS_NODES},
    "h200x8": {**_ACROSS_NODES},
    "trn2.48xlarge": {**_ACROSS_NODES},
    "cpu": {"data.batch_size": 8},
}
