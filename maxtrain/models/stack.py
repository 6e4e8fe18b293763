"""A model's stacks of layers and how they run: scanned (`Scan`), a Python list (`Unrolled`), or a circular
pipeline over the mesh's `pipeline` axis (`Pipelined`, with its `Schedule`: sharding/pipeline.py).

The builder picks one (`for_model`: from `model.scan_layers` and the plan's schedule) and hands it to the model
at construction (`Decoder(cfg, rngs=..., stack=...)`), which keeps it as a static attribute (frozen, hashable:
part of the graphdef) and calls `run` on each of its stacks. Nothing here is ambient state: the one outside
seam, sharding/schedules.py running the stack's layers by its own table, is an argument of `run` (`hook`). A
combination a stack cannot run is its own UserError (`for_model`), raised while the program is built, before
anything compiles.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.errors import require
from maxtrain.sharding import pipeline as pipeline_lib

# (rngs, the model's index of the layer; 0 for a scanned stack's one traced layer) -> a Block
MakeBlock = Callable[[nnx.Rngs, int], nnx.Module]
# The stack's output, its layers' statistics stacked: each [layers, ...], and its KV cache updated (None without one)
StackOut = tuple[jax.Array, dict[str, jax.Array], Any]

# Under the pipeline without remat: keep every activation, but recompute slices and reshapes, so that a layer's
# weights picked from its stage's repeats are not kept per loop iteration (sharding/pipeline.py). Casts are
# kept: recomputing them would keep an fp32 source in place of its bf16 cast.
_LAYOUT_OPS = frozenset({"dynamic_slice", "slice", "squeeze", "reshape", "expand_dims", "broadcast_in_dim",
                         "transpose"})


def _save_all_but_layout_ops(prim: Any, *_, **__) -> bool:
  return prim.name not in _LAYOUT_OPS


def _apply_block(segment_ids_BT: jax.Array, positions_BT: jax.Array, write: Any) -> Callable:
  """(x, a layer's state, its graphdef, its cache) -> (x, (stats, cache))."""
  def apply_block(x_BTD, block_state, graphdef, kv):
    x_BTD, stats, kv = nnx.merge(graphdef, block_state)(x_BTD, segment_ids_BT, positions_BT, kv, write)
    return x_BTD, (stats, kv)
  return apply_block


def _remat(apply_block: Callable, policy: Any, kv: Any) -> Callable:
  """`apply_block` under `policy`'s remat when training (decoding, with a cache, differentiates nothing)."""
  if policy is not None and kv is None:
    return jax.checkpoint(apply_block, policy=policy, static_argnums=(2,))
  return apply_block


@dataclasses.dataclass(frozen=True)
class Unrolled:
  """A list of Blocks, each traced on its own (model.scan_layers=False): compile time grows with depth."""
  scanned = False

  def build(self, make_block: MakeBlock, rngs: nnx.Rngs, num: int, first: int) -> nnx.Module:
    """`num` Blocks, the first being the model's layer `first`."""
    return nnx.List([make_block(rngs, first + i) for i in range(num)])

  def run(self, blocks: nnx.Module, x_BTD: jax.Array, segment_ids_BT: jax.Array, positions_BT: jax.Array,
          kv: Any, write: Any, policy: Any, hook: pipeline_lib.StackHook | None = None) -> StackOut:
    """`hook`: only a pipelined stack takes one (sharding/schedules.py); the others run their layers."""
    apply_block = _remat(_apply_block(segment_ids_BT, positions_BT, write), policy, kv)
    stats, new_kv = [], []
    for i, block in enumerate(blocks):
      graphdef, state = nnx.split(block)
      x_BTD, (layer_stats, layer_kv) = apply_block(x_BTD, state, graphdef, None if kv is None else kv[i])
      stats.append(layer_stats)
      new_kv.append(layer_kv)
    stacked_stats = jax.tree.map(lambda *s: jnp.stack(s), *stats) if stats[0] else {}
    return x_BTD, stacked_stats, None if kv is None else new_kv


@dataclasses.dataclass(frozen=True)
class Scan:
  """One stacked Block whose parameters have a leading `layers` dim: the step compiles one layer body and scans
  it (`unroll`: model.scan_unroll), so compile time stays independent of depth."""
  unroll: int = 1
  scanned = True

  def build(self, make_block: MakeBlock, rngs: nnx.Rngs, num: int, first: int) -> nnx.Module:
    del first  # every layer of a scanned stack is traced as one: a per-layer piece cannot differ within it

    @nnx.split_rngs(splits=num)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=num, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_blocks(rngs: nnx.Rngs) -> nnx.Module:
      return make_block(rngs, 0)

    return make_blocks(rngs)

  def run(self, blocks: nnx.Module, x_BTD: jax.Array, segment_ids_BT: jax.Array, positions_BT: jax.Array,
          kv: Any, write: Any, policy: Any, hook: pipeline_lib.StackHook | None = None) -> StackOut:
    """`hook`: only a pipelined stack takes one (sharding/schedules.py); the others run their layers."""
    apply_block = _remat(_apply_block(segment_ids_BT, positions_BT, write), policy, kv)
    graphdef, stacked = nnx.split(blocks)
    length = jax.tree.leaves(stacked)[0].shape[0]
    x_BTD, (stats, kv) = jax.lax.scan(lambda x, xs: apply_block(x, xs[0], graphdef, xs[1]), x_BTD, (stacked, kv),
                                      unroll=min(self.unroll, length))
    return x_BTD, stats, kv


@dataclasses.dataclass(frozen=True)
class Pipelined:
  """A scanned stack whose training and evaluation run through the circular pipeline of `schedule`
  (sharding/pipeline.py; the other schedules' backward: sharding/schedules.py through `hook`); decoding (with a
  cache) runs it as a plain scan."""
  schedule: pipeline_lib.Schedule
  unroll: int = 1
  scanned = True

  def build(self, make_block: MakeBlock, rngs: nnx.Rngs, num: int, first: int) -> nnx.Module:
    return Scan(self.unroll).build(make_block, rngs, num, first)

  def run(self, blocks: nnx.Module, x_BTD: jax.Array, segment_ids_BT: jax.Array, positions_BT: jax.Array,
          kv: Any, write: Any, policy: Any, hook: pipeline_lib.StackHook | None = None) -> StackOut:
    """`hook` (sharding/schedules.py, while it traces the model): run in place of the pipeline, with this
    stack's layer function and weights."""
    if kv is not None:
      return Scan(self.unroll).run(blocks, x_BTD, segment_ids_BT, positions_BT, kv, write, policy)
    graphdef, stacked = nnx.split(blocks)

    def group(stage, r, x_BTD, segment_ids_BT, positions_BT):  # a stage's layers [n, R, ...] of repeat r, scanned
      def body(x, layer_repeats):  # the repeat picked inside the remat: pipeline.run says why
        layer_state = jax.tree.map(lambda w: w[r], layer_repeats)
        return nnx.merge(graphdef, layer_state)(x, segment_ids_BT, positions_BT)[0], None
      body = jax.checkpoint(body, policy=policy or _save_all_but_layout_ops)
      return jax.lax.scan(body, x_BTD, stage)[0]

    if hook is not None:
      return hook(group, stacked, x_BTD, segment_ids_BT, positions_BT), {}, None
    return pipeline_lib.run(group, stacked, x_BTD, segment_ids_BT, positions_BT, self.schedule), {}, None


Stack = Unrolled | Scan | Pipelined


def for_model(cfg: Any, schedule: pipeline_lib.Schedule | None = None) -> Stack:
  """The stack of `cfg` (a ModelConfig: `scan_layers`, `scan_unroll`) under `schedule` (the plan's pipeline;
  None or one stage: none). UserError for what the pipeline cannot run."""
  if schedule is not None and schedule.stages > 1:
    require(cfg.scan_layers, f"config.model.scan_layers=False with a pipeline of {schedule.stages} stages: the "
            "pipeline splits the stacked layers; set model.scan_layers=True (or mesh.pipeline=1)")
    return Pipelined(schedule, unroll=cfg.scan_unroll)
  return Scan(cfg.scan_unroll) if cfg.scan_layers else Unrolled()
