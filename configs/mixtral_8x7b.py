"""Mixtral 8x7B-shaped mixture of experts (Mistral's published shapes: 32 layers, d_model 4096, 32
query / 8 key-value heads, 8 SwiGLU experts of 14336 with 2 per token in every layer, softmax
router renormalised over the top 2, vocabulary 32000, RoPE theta 1e6): 46.7B parameters, 12.9B
active per token. For a real tokenizer and token store. Check it compiles and fits, e.g. on 8 nodes
of 8 H100s:

  python -m maxtrain.compile --config=configs/mixtral_8x7b.py --config.hardware=h100x8 --devices 64 \
      --device-memory-gb 80

`HARDWARE` refines the generic presets of maxtrain/config/hardware.py for this model (per node).
"""

from maxtrain.config import base_config


def get_config():
  c = base_config()
  c.output_dir = "runs/mixtral_8x7b"
  m = c.model
  m.num_layers, m.d_model, m.num_heads, m.num_kv_heads = 32, 4096, 32, 8
  m.d_ff, m.vocab_size, m.max_seq_len, m.rope_theta = 14336, 32000, 32768, 1e6
  m.scan_layers, m.remat = True, "full"
  m.compute_dtype = "bfloat16"
  e = m.moe
  e.num_experts, e.experts_per_token, e.expert_d_ff = 8, 2, 14336
  e.router, e.dispatch, e.capacity_factor = "softmax", "capacity", 1.25
  e.aux_loss_weight, e.router_z_loss_weight = 0.01, 0.001
  c.data.corpus = ""  # needs a real token store: set data.path
  c.data.seq_len, c.data.batch_size = 4096, 256
  o = c.optimizer
  o.lr, o.adam_lr, o.warmup_steps, o.min_lr_ratio, o.weight_decay = 3e-4, 3e-4, 2000, 0.1, 0.1
  c.steps = 100_000
  c.checkpoint.every_steps = 250
  c.eval.every_steps, c.eval.batches = 1000, 16
  return c


# Each node's 8 GPUs hold one expert each (expert parallelism inside the node, where the all-to-all
# runs over NVLink); parameters and optimizer state are FSDP-sharded across the nodes; one sequence
# per batch shard at a time. `python -m maxtrain.compile ... --devices 64`: BENCHMARKS.md.
HARDWARE = {
    "h100x8": {"mesh.fsdp": 1, "mesh.expert": 8, "mesh.dcn_data": 1, "mesh.dcn_fsdp": -1,
               "optimizer.microbatch_size": 1},
    "cpu": {"data.batch_size": 8},
}
