"""The default run on an accelerator (GPU, TPU, Trainium): bf16 matmuls, fp32 parameters and optimizer
state. The CPU default keeps fp32 compute: bf16 is slower than fp32 on CPU (jax 0.12)."""

from maxtrain.config import base_config


def get_config():
  c = base_config()
  c.model.compute_dtype = "bfloat16"
  return c
