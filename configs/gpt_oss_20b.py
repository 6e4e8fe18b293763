"""GPT-OSS-20B-shaped mixture of experts (OpenAI's published shapes: 24 layers, d_model 2880, 64 query / 8
key-value heads of head_dim 64 with q/k/v/o biases and attention sinks, 128-token windows on the even layers,
32 experts of 2880 with 4 per token, router and expert biases, the clamped SwiGLU (alpha 1.702, limit 7),
vocabulary 201088, YaRN RoPE: theta 150000, factor 32 over 4096 positions): about 20.9B parameters, 3.6B
active per token. Its layers are unscanned (each keeps its own window). The published MXFP4 experts are
dequantised by `python -m maxtrain.convert from-hf` (interop/dequant.py). Check the fit first (62.6 GiB per
device on one node of H100s, the memory stand-in of its dropless experts and unscanned layers: docs/fitting.md):

  python -m maxtrain.compile --config=configs/gpt_oss_20b.py --config.hardware=h100x8 --devices 8 \
      --device-memory-gb 80
"""

from maxtrain.config import base_config


def get_config():
  c = base_config()
  c.output_dir = "runs/gpt_oss_20b"
  m = c.model
  m.family = "gpt_oss"  # sinks, q/k/v/o biases, alternating windows, layers unscanned
  m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim = 24, 2880, 64, 8, 64
  m.d_ff, m.vocab_size, m.max_seq_len, m.norm_eps, m.sliding_window = 2880, 201088, 131072, 1e-5, 128
  m.rope_theta, m.rope_scaling, m.rope_scaling_factor, m.rope_original_max_len = 150000.0, "yarn", 32.0, 4096
  m.rope_beta_fast, m.rope_beta_slow, m.rope_truncate = 32.0, 1.0, False
  m.remat, m.compute_dtype, m.attention = "full", "bfloat16", "flash"
  e = m.moe
  e.num_experts, e.experts_per_token, e.expert_d_ff = 32, 4, 2880
  e.router, e.dispatch, e.norm_topk_prob = "softmax", "dropless", True
  e.activation, e.expert_bias, e.swiglu_alpha, e.swiglu_limit = "clamped_swiglu", True, 1.702, 7.0
  e.aux_loss_weight, e.router_z_loss_weight = 0.001, 0.0
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
