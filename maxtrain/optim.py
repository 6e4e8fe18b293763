"""Optimizer and learning-rate schedule (optax)."""

from __future__ import annotations

import jax
import ml_collections
import optax


def schedule(opt_cfg: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
  """Linear warmup 0 -> lr, then cosine decay to lr * min_lr_ratio at `total_steps`."""
  warmup = min(opt_cfg.warmup_steps, total_steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=opt_cfg.lr,
      warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1),
      end_value=opt_cfg.lr * opt_cfg.min_lr_ratio,
  )


def decay_mask(params):
  """Weight decay on matrices only: not on norm scales (1-D) nor on the embedding table."""

  def label(path, leaf) -> bool:
    name = str(getattr(path[-1], "key", path[-1])) if path else ""
    return leaf.ndim >= 2 and name != "embed"

  return jax.tree_util.tree_map_with_path(label, params)


def make(opt_cfg: ml_collections.ConfigDict, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  lr = schedule(opt_cfg, total_steps)
  parts = []
  if opt_cfg.clip_norm > 0:
    parts.append(optax.clip_by_global_norm(opt_cfg.clip_norm))
  parts.append(optax.adamw(lr, b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps,
                           weight_decay=opt_cfg.weight_decay, mask=decay_mask))
  return optax.chain(*parts), lr
