"""The default run with Muon for the hidden weight matrices (AdamW for embeddings, head and norms) at
the tuned learning rates: eval loss 1.589 vs AdamW's 1.841 after the same 200 steps; Muon reaches
AdamW's final loss at step ~104 (BENCHMARKS.md, `python tools/compare_optimizers.py`)."""

from maxtrain.config import base_config


def get_config():
  c = base_config()
  c.output_dir = "runs/muon"
  c.optimizer.name = "muon"
  c.optimizer.lr = 0.04  # Muon matrices (best of 0.02, 0.04, 0.08)
  c.optimizer.adam_lr = 1.5e-3  # the AdamW group, at AdamW's tuned rate
  return c
