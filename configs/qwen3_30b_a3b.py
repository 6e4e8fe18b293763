"""Qwen3-30B-A3B-shaped mixture of experts (Qwen's published shapes: 48 layers, d_model 2048, 32 query / 4
key-value heads of head_dim 128, per-head qk-norm, 128 SwiGLU experts of 768 with 8 per token in every layer,
softmax router renormalised over the top 8, vocabulary 151936, RoPE theta 1e6): about 30.5B parameters, 3.3B
active per token. Routed without drops (`model.moe.dispatch=dropless`, as transformers does); the experts
are not split over devices here (FSDP only); `--config.mesh.expert=N` splits them with dropless expert
parallelism (a ragged all-to-all, docs/moe.md). For a real tokenizer and token store;
continue the published checkpoint with `python -m maxtrain.convert from-hf` (its config.py has these keys).
Check the fit first, e.g. on 2 nodes of 8 H100s (48.9 GiB per device, the memory stand-in of its dropless
experts: docs/fitting.md):

  python -m maxtrain.compile --config=configs/qwen3_30b_a3b.py --config.hardware=h100x8 --devices 16 \
      --device-memory-gb 80
"""

from maxtrain.config import base_config


def get_config():
  c = base_config()
  c.output_dir = "runs/qwen3_30b_a3b"
  m = c.model
  m.family = "qwen3_moe"  # qk-norm on, every layer a MoE
  m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim = 48, 2048, 32, 4, 128
  m.d_ff, m.vocab_size, m.max_seq_len, m.rope_theta, m.norm_eps = 6144, 151936, 40960, 1e6, 1e-6
  m.scan_layers, m.remat, m.compute_dtype = True, "full", "bfloat16"
  e = m.moe
  e.num_experts, e.experts_per_token, e.expert_d_ff, e.norm_topk_prob = 128, 8, 768, True
  e.router, e.dispatch, e.aux_loss_weight, e.router_z_loss_weight = "softmax", "dropless", 0.001, 0.0
  c.data.corpus = ""  # needs a real token store: set data.path
  c.data.seq_len, c.data.batch_size = 4096, 256
  o = c.optimizer
  o.lr, o.adam_lr, o.warmup_steps, o.min_lr_ratio, o.weight_decay = 3e-4, 3e-4, 2000, 0.1, 0.1
  c.steps = 100_000
  c.checkpoint.every_steps = 250
  c.eval.every_steps, c.eval.batches = 1000, 16
  return c


HARDWARE = {
    "h100x8": {"mesh.fsdp": 8, "mesh.dcn_data": 1, "mesh.dcn_fsdp": -1, "optimizer.microbatch_size": 1},
    "cpu": {"data.batch_size": 8},
}
