"""The default run as a mixture of experts at equal active parameters: every layer's SwiGLU MLP
(d_ff 768) becomes 8 routed experts of width 384, 2 per token (the active width is the dense 768;
4x the feed-forward parameters in all), softmax router, capacity 1.25 per expert per sequence.
It trains on this CPU like the default (eval losses vs the dense default in BENCHMARKS.md).

  python -m maxtrain.train --config=configs/moe.py
"""

from maxtrain.config import base_config


def get_config():
  c = base_config()
  c.output_dir = "runs/moe"
  e = c.model.moe
  e.num_experts, e.experts_per_token, e.expert_d_ff = 8, 2, 384
  e.router, e.dispatch, e.capacity_factor = "softmax", "capacity", 1.25
  e.aux_loss_weight, e.router_z_loss_weight = 0.01, 0.001
  return c
