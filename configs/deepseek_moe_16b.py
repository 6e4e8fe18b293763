"""DeepSeekMoE-16B-shaped mixture of experts with DeepSeek-V3's routing: 28 layers, d_model 2048, 16
heads of 128, the first layer dense (SwiGLU 10944), then 64 fine-grained routed experts of 1408, 6 per
token, plus 2 shared experts; vocabulary 102400. Routing as DeepSeek-V3: sigmoid scores, top-6 by
score + an aux-loss-free balancing bias (model.moe.bias_update_rate), weights normalised over the
chosen 6, and only a small load-balancing loss. 16.4B parameters, 2.8B active per token. Attention is
maxtrain's grouped-query attention (DeepSeek's multi-head latent attention is not implemented). Check
that it compiles and fits:

  python -m maxtrain.compile --config=configs/deepseek_moe_16b.py --config.hardware=h100x8 --devices 8 \
      --device-memory-gb 80

`HARDWARE` refines the generic presets of maxtrain/config/hardware.py for this model (per node).
"""

from maxtrain.config import base_config


def get_config():
  c = base_config()
  c.output_dir = "runs/deepseek_moe_16b"
  m = c.model
  m.num_layers, m.d_model, m.num_heads, m.num_kv_heads = 28, 2048, 16, 16
  m.d_ff, m.vocab_size, m.max_seq_len, m.rope_theta = 10944, 102400, 4096, 10000.0
  m.scan_layers, m.remat = True, "full"
  m.compute_dtype = "bfloat16"
  e = m.moe
  e.num_experts, e.experts_per_token, e.num_shared_experts, e.expert_d_ff = 64, 6, 2, 1408
  e.first_dense_layers = 1
  e.router, e.dispatch, e.capacity_factor = "sigmoid", "capacity", 1.25
  e.aux_loss_weight, e.router_z_loss_weight, e.bias_update_rate = 1e-4, 0.0, 1e-3
  c.data.corpus = ""  # needs a real token store: set data.path
  c.data.seq_len, c.data.batch_size = 4096, 256
  o = c.optimizer
  o.lr, o.adam_lr, o.warmup_steps, o.min_lr_ratio, o.weight_decay = 4.2e-4, 4.2e-4, 2000, 0.1, 0.1
  c.steps = 100_000
  c.checkpoint.every_steps = 500
  c.eval.every_steps, c.eval.batches = 1000, 16
  return c


# Expert parallelism over each node's devices (8 experts per H100, 4 per trn2 logical core), data
# parallel across nodes; one sequence per batch shard at a time. `python -m maxtrain.compile`:
# BENCHMARKS.md.
HARDWARE = {
    "h100x8": {"mesh.fsdp": 1, "mesh.expert": 8, "optimizer.microbatch_size": 1},
    "trn2.48xlarge": {"mesh.fsdp": 1, "mesh.expert": 16, "optimizer.microbatch_size": 1},
    "cpu": {"data.batch_size": 8},
}
