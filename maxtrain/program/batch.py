"""The train batch as the step sees it: the pipeline's fields (`data/pipeline.py` KEYS, DTYPES; a
drilled run's step adds its fault input, `program/drills.py`); its layout over processes, batch shards and
microbatches (computed once, as a value); its shardings (from the `act_batch`/`act_length` rules); and the one way host rows become
global device arrays.

Shape legend: B global batch (sequences), T sequence length.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from maxtrain.data import pipeline
from maxtrain.errors import require
from maxtrain.sharding import context_attention
from maxtrain.sharding import rules as rules_lib
from maxtrain.sharding.layout import Layout



@dataclasses.dataclass(frozen=True)
class BatchLayout:
  """How one global batch of `global_size` sequences of `seq_len` tokens is divided."""
  global_size: int
  seq_len: int
  num_processes: int
  shards: int  # batch shards: devices holding different rows (the act_batch mesh axes)
  num_microbatches: int  # gradient accumulation steps, scanned in the one step

  @property
  def per_process(self) -> int:
    return self.global_size // self.num_processes

  @property
  def per_shard(self) -> int:
    return self.global_size // self.shards

  @property
  def per_microbatch(self) -> int:
    """Sequences per batch shard (per device) in each microbatch."""
    return self.per_shard // self.num_microbatches

  @property
  def tokens(self) -> int:
    return self.global_size * self.seq_len

  @classmethod
  def plan(cls, data_cfg: Any, optimizer_cfg: Any, layout: Layout, mesh_text: str,
           num_processes: int = 1) -> "BatchLayout":
    """Checks that the batch divides over processes, shards and microbatches (UserError naming the
    keys and the arithmetic otherwise). `optimizer.microbatch_size` > 0 decides the microbatch count."""
    b, o = data_cfg.batch_size, optimizer_cfg
    context = layout.shards("act_length")
    require(context == 1 or data_cfg.seq_len % (2 * context) == 0,
            f"config.data.seq_len={data_cfg.seq_len} is not divisible by 2 x the context shards, 2 x "
            f"{layout.describe('act_length')} ({mesh_text}): each context shard holds an early and a late chunk "
            f"of every sequence (causal load balancing). Choose a seq_len that is a multiple of {2 * context}.")
    shards = layout.shards("act_batch")
    require(b % shards == 0,
            f"config.data.batch_size={b} is not divisible by the batch shards, {layout.describe('act_batch')} "
            f"({mesh_text}): each batch shard needs the same number of sequences.")
    require(b % num_processes == 0, f"config.data.batch_size={b} is not divisible by the {num_processes} processes")
    per_process, per_shard = b // num_processes, b // shards
    require(o.microbatch_size >= 0, f"config.optimizer.microbatch_size={o.microbatch_size}: must be >= 0 (0 = off)")
    require(o.grad_accum_steps >= 1, f"config.optimizer.grad_accum_steps={o.grad_accum_steps}: must be >= 1")
    k = o.grad_accum_steps
    if o.microbatch_size:
      # Activation memory per device stays the same whatever the node count.
      require(per_shard % o.microbatch_size == 0,
              f"config.optimizer.microbatch_size={o.microbatch_size} does not divide the {per_shard} sequences per "
              f"batch shard (data.batch_size={b} / {layout.describe('act_batch')}, {mesh_text})")
      k = per_shard // o.microbatch_size
    require(per_process % k == 0 and per_shard % k == 0,
            f"config.optimizer.grad_accum_steps={k} does not divide the batch: data.batch_size={b} is {per_process} "
            f"sequences per process ({num_processes} processes) and {per_shard} per batch shard "
            f"({layout.describe('act_batch')}, {mesh_text}); every shard must split into {k} equal microbatches. "
            f"Choose grad_accum_steps dividing {math.gcd(per_process, per_shard)}, or a batch_size that is a "
            f"multiple of {k} x {shards} = {k * shards}.")
    return cls(global_size=b, seq_len=data_cfg.seq_len, num_processes=num_processes, shards=shards,
               num_microbatches=k)


def shardings(mesh: Mesh, layout: Layout) -> dict[str, NamedSharding]:
  """Every field's sharding: [B, T] arrays by the batch rules."""
  rows = layout.batch_sharding(mesh)
  return {k: rows for k in pipeline.KEYS}


def abstract(batch_layout: BatchLayout, batch_shardings: dict[str, NamedSharding]) -> dict[str, jax.ShapeDtypeStruct]:
  """A train batch's shapes, dtypes and shardings, for compiling without data."""
  shape = (batch_layout.global_size, batch_layout.seq_len)
  return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_shardings[k]) for k, dtype in pipeline.DTYPES.items()}


def length_shards(sharding: NamedSharding) -> int:
  """Into how many parts a [B, T] batch sharding splits T (the context shards)."""
  spec = tuple(sharding.spec) + (None, None)
  return math.prod(sharding.mesh.shape[a] for a in rules_lib.mesh_axes(spec[1]))


def context_order(rows: dict[str, np.ndarray], shards: int) -> dict[str, np.ndarray]:
  """Every [B, T] field with its tokens in the causal load-balancing order of `shards` context shards
  (`sharding/context_attention.py` `zigzag_order`); unchanged for 1 shard. All fields move together,
  so each token keeps its target, loss mask, segment id and position."""
  if shards == 1:
    return rows
  order = context_attention.zigzag_order(next(iter(rows.values())).shape[1], shards)
  return {k: np.asarray(v)[:, order] for k, v in rows.items()}


def to_device(rows: dict[str, np.ndarray], batch_shardings: dict[str, NamedSharding]) -> dict[str, jax.Array]:
  """This process's rows -> global arrays laid out for the step, tokens in context order: every
  batch the step sees must come through here (context attention relies on the order)."""
  sharding = batch_shardings[pipeline.KEYS[0]]
  return pipeline.to_global(context_order(rows, length_shards(sharding)), sharding)


def global_to_device(rows: dict[str, np.ndarray], batch_shardings: dict[str, NamedSharding]) -> dict[str, jax.Array]:
  """The whole global batch, the same rows on every process -> global arrays laid out for the step, tokens
  in context order. Post-training builds each batch whole on every process (SFT's permutation, RL's
  rollout): each process places only the slices its devices hold. (`to_device` would take every
  process's copy for its own rows: a batch process_count times too large.)"""
  sharding = batch_shardings[pipeline.KEYS[0]]
  rows = context_order(rows, length_shards(sharding))
  return {k: jax.make_array_from_callback(np.shape(v), sharding, lambda index, v=np.asarray(v): v[index])
          for k, v in rows.items()}


def to_host(x: jax.Array) -> np.ndarray:
  """A global array whole on every process (`np.asarray` reads only arrays this process holds all of)."""
  if x.is_fully_addressable:
    return np.asarray(x)
  from jax.experimental import multihost_utils  # only multi-process runs reach here
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))

