"""LLaMA 3 70B (Meta's published shapes: 80 layers, d_model 8192, 64 query / 8 key-value heads,
SwiGLU 28672, vocabulary 128256, RoPE theta 500000), for a real tokenizer and token store.

70B with fp32 parameters and Adam moments is ~1.1 TB of state: it needs FSDP across nodes
(`mesh.dcn_fsdp`, filled with the node count). Check it fits, e.g. on 8 nodes of 8 H100s:

  python -m maxtrain.compile --config=configs/llama3_70b.py --config.hardware=h100x8 --devices 64 \
      --device-memory-gb 80

`HARDWARE` refines the generic presets of maxtrain/config/hardware.py for this model (per node).
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
  return c


_ACROSS_NODES = {"mesh.dcn_data": 1, "mesh.dcn_fsdp": -1}  # parameters and optimizer state sharded over all nodes
# On 8 GPUs per node: tensor parallelism over the node's 8 GPUs splits the 64 heads' 8192^2 attention
# scores 8 ways (one sequence with all heads on one GPU is ~52 GiB of scores alone); FSDP across nodes.
# The 256 sequences go one per batch shard at a time (`optimizer.microbatch_size=1`: on 8 nodes, 32
# microbatches). `python -m maxtrain.compile ... --devices 64`: BENCHMARKS.md.
_GPU_NODE = {**_ACROSS_NODES, "mesh.fsdp": 1, "mesh.tensor": 8, "optimizer.microbatch_size": 1}
HARDWARE = {
    "h100x8": _GPU_NODE,
    "h200x8": {**_GPU_NODE, "optimizer.microbatch_size": 2},  # 141 GB per GPU: ~87 GiB of 131 (BENCHMARKS.md)
    # 24 GiB per logical core (LNC=2). Context parallelism over the node's 16 chips (tensor=4 within
    # each) splits every sequence 16 ways (512 tokens per core; the saved layer inputs drop from 10 GiB
    # per sequence to 0.6), and the parameters are FSDP-sharded over fsdp x context. One node then
    # needs bf16 optimizer moments: 23.8 GiB peak (fp32 moments: 25.3). From two nodes on fp32 moments
    # fit (fsdp=2 x context=8 per node: 16.3 GiB); set optimizer.state_dtype=float32 there. BENCHMARKS.md.
    "trn2.48xlarge": {**_ACROSS_NODES, "mesh.fsdp": 1, "mesh.context": 16, "optimizer.microbatch_size": 1,
                      "optimizer.state_dtype": "bfloat16"},
    "cpu": {"data.batch_size": 8},
}
