"""Pipeline schedules as host-side tables, and 1F1B run from its table in the one SPMD program.

A schedule table is int [ticks, S, 2]: per tick and stage, the microbatch its forward slot (column 0) and its
backward slot (column 1) run, IDLE for a slot that runs masked (the bubble), ABSENT for a slot that the
program does not have at that tick (gpipe's forward loop has no backward slot and the other way round).
The bubble is the share of present slots that are idle.

1F1B here (`pipeline.schedule=1f1b`) is the lockstep form an SPMD program can run: every tick each stage
runs one forward slot and one backward slot (masked when idle), then passes activations down and input
gradients up with one `ppermute` each. Stage s runs the forward of microbatch i at tick i + s and its
backward at tick i + 2S - 2 - s; the last stage runs the loss head and the backward of a microbatch in the
tick of its forward. A microbatch's backward starts as soon as its loss is known, so a stage holds the
inputs of at most 2S - 1 microbatches (2(S - s) - 1 on stage s), whatever M: O(S) activation memory where
gpipe order holds all M. The backward is written by hand (a `jax.vjp` of the stage per backward slot that
recomputes the stage's forward from its saved input: 1F1B implies stage remat), not autodiff of the
forward loop. M + 2S - 2 ticks: bubble (2S-2)/(M+2S-2) of the slots. The alternating 1F1B of per-stage
runtimes (bubble (S-1)/(M+S-1), S - s microbatches held) needs each stage to run either a forward or a
backward per tick, which one SPMD program can only do by computing both.

Everything the model computes outside its layer stack (embedding, final norm, head, loss) runs unchanged:
the model is traced with `pipeline.substitute` capturing the stack's input (the part before the stack, its
gradient by `jax.vjp`) and, per microbatch on the last stage, returning the stage output (the part after).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from maxtrain.sharding import pipeline as pipeline_lib
from maxtrain.sharding.pipeline import AXIS, Schedule

IDLE, ABSENT = -1, -2
# (params, batch) -> (the objective summed over the batch's loss tokens, its parts: sums over rows)
Objective = Callable[[Any, dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]


def table(schedule: Schedule) -> np.ndarray:
  """The schedule's slots, int [ticks, S, 2] (the module docstring says what they hold). gpipe: pass k (repeat
  k // M of microbatch k % M) forward at iteration k + s of the forward loop, backward at its mirror time."""
  s_, m_, r_ = schedule.stages, schedule.microbatches, schedule.repeats
  stage = np.arange(s_)
  if schedule.kind == "gpipe":
    its = r_ * m_ + s_ - 1
    out = np.full((2 * its, s_, 2), ABSENT, np.int32)
    for t in range(its):
      k = t - stage
      out[t, :, 0] = np.where((k >= 0) & (k < r_ * m_), k, IDLE)
      out[2 * its - 1 - t, :, 1] = out[t, :, 0]  # autodiff runs the forward loop's iterations in reverse
    return out
  if schedule.kind == "1f1b":
    ticks = schedule.iterations
    out = np.empty((ticks, s_, 2), np.int32)
    for t in range(ticks):
      for col, start in ((0, stage), (1, 2 * s_ - 2 - stage)):
        i = t - start
        out[t, :, col] = np.where((i >= 0) & (i < m_), i, IDLE)
    return out
  raise ValueError(f"no table for pipeline.schedule={schedule.kind}")


def bubble(tab: np.ndarray) -> float:
  """The share of the table's present slots that are idle."""
  return float(np.sum(tab == IDLE) / np.sum(tab != ABSENT))


def held(tab: np.ndarray) -> np.ndarray:
  """Per stage, the most microbatches whose forward ran and whose backward has not (after a tick's forward,
  before its backward): the stage inputs a schedule keeps. gpipe: all of them (R M)."""
  fwd, bwd = np.cumsum(tab[:, :, 0] >= 0, axis=0), np.cumsum(tab[:, :, 1] >= 0, axis=0)
  return np.max(fwd - np.concatenate([np.zeros_like(bwd[:1]), bwd[:-1]]), axis=0)


def slots(schedule: Schedule) -> int:
  """Stage inputs 1F1B keeps (a ring buffer: microbatch i in slot i % slots), at most 2S - 1."""
  return min(schedule.microbatches, 2 * schedule.stages - 1)


@dataclasses.dataclass(frozen=True)
class _Split:
  """The model as `value_and_grad` found it: its layer-stack function (pipeline.LayersFn), and which parameter
  leaves (in `jax.tree.leaves` order) are the stack's (in the stack's own leaf order) and which the rest."""
  layers: pipeline_lib.LayersFn
  stack_def: Any  # the stack's tree structure
  stack_index: list[int]
  rest_index: list[int]
  treedef: Any  # the parameters' tree structure

  def parts(self, params: Any) -> tuple[list, list]:
    leaves = jax.tree.leaves(params)
    return [leaves[i] for i in self.stack_index], [leaves[i] for i in self.rest_index]

  def rebuild(self, stack: list, rest: list) -> Any:
    out: list[Any] = [None] * (len(stack) + len(rest))
    for i, w in zip(self.stack_index + self.rest_index, stack + rest):
      out[i] = w
    return jax.tree.unflatten(self.treedef, out)


def _before_the_stack(objective: Objective, params: Any, batch: dict[str, jax.Array]) -> tuple[Any, ...]:
  """(the stack's input x [B, T, D], its pullback to the parameters, the stack's segment ids and positions,
  the _Split): the model traced with the stack replaced by the identity (what follows it is dead code here)."""
  found: list[dict[str, Any]] = []

  def before(p):
    box: dict[str, Any] = {}

    def capture(layers, stacked, x_BTD, segment_ids_BT, positions_BT):
      box.update(layers=layers, stacked=stacked, x=x_BTD, ids=(segment_ids_BT, positions_BT))
      return x_BTD
    with pipeline_lib.substitute(capture):
      objective(p, batch)
    assert box, "pipeline.schedule=1f1b: the model ran no layer stack through the pipeline"
    # Which parameter leaves the stack is made of: the same traced arrays (nnx.split does not copy).
    where = {id(w): i for i, w in enumerate(jax.tree.leaves(p))}
    box["stack_index"] = [where[id(w)] for w in jax.tree.leaves(box["stacked"])]
    found.append(box)
    return box["x"], box["ids"]

  x_BTD, pull, (segment_ids_BT, positions_BT) = jax.vjp(before, params, has_aux=True)
  assert len(found) == 1, f"1f1b pipelines one layer stack; the model ran {len(found)} under it"
  box, (leaves, treedef) = found[0], jax.tree.flatten(params)
  rest_index = [i for i in range(len(leaves)) if i not in set(box["stack_index"])]
  split = _Split(box["layers"], jax.tree.structure(box["stacked"]), box["stack_index"], rest_index, treedef)
  return x_BTD, pull, segment_ids_BT, positions_BT, split


def _stage(model: _Split, objective: Objective, schedule: Schedule, parts_shape: Any, stack: list, rest: list,
           xs: jax.Array, segs: jax.Array, poss: jax.Array, rows: dict[str, jax.Array], tab: jax.Array) -> tuple:
  """One stage's 1F1B (under shard_map over `pipeline`): the tick loop of its rows of `tab`. Returns this stage's
  layer gradients, the rest's (and the objective's parts) summed over stages, and stage 0's input gradients."""
  s_, m_, k_ = schedule.stages, schedule.microbatches, slots(schedule)
  s = jax.lax.axis_index(AXIS)
  last = s == s_ - 1
  varying = lambda t: jax.tree.map(lambda a: jax.lax.pcast(a, AXIS, to="varying"), t)
  # Differentiate varying copies: the cotangent of a stage-invariant input would be psum'd every tick.
  rest, xs = varying(rest), varying(xs)

  def forward(stack, x, i):  # this stage's layers [L/S, ...] on microbatch i
    stage = jax.tree.unflatten(model.stack_def, [w[:, None] for w in stack])  # [L/S, R = 1, ...]
    return model.layers(stage, 0, x, segs[i], poss[i])

  def after(rest, y, i):  # the model after the stack on microbatch i (the last stage's loss head)
    with pipeline_lib.substitute(lambda *_: y):
      return objective(model.rebuild(stack, rest), jax.tree.map(lambda a: a[i], rows))

  zeros = lambda t: jax.tree.map(jnp.zeros_like, t)
  add_if = lambda ok, total, new: jax.tree.map(lambda a, b: jnp.where(ok, a + b, a), total, new)

  def tick(carry, tab_t):
    recv_x, recv_g, saved, d_stack, d_rest, parts, dxs = carry
    f, b = tab_t[s, 0], tab_t[s, 1]
    fi, bi = jnp.clip(f, 0, m_ - 1), jnp.clip(b, 0, m_ - 1)
    # forward slot: a new microbatch on stage 0, the previous stage's output elsewhere; keep its input
    x = jnp.where(s == 0, xs[fi], recv_x)
    y = forward(stack, x, fi)
    saved = saved.at[fi % k_].set(jnp.where(f >= 0, x, saved[fi % k_]))
    # the loss head on the last stage, in the tick of the microbatch's forward
    _, pull_after, parts_i = jax.vjp(lambda r, y: after(r, y, fi), rest, y, has_aux=True)
    head = last & (f >= 0)
    d_rest_i, dy = pull_after(jnp.where(head, 1.0, 0.0).astype(jnp.float32))
    parts, d_rest = add_if(head, parts, parts_i), add_if(head, d_rest, d_rest_i)
    # backward slot: recompute the stage from its saved input, pull the next stage's gradient through it
    _, pull = jax.vjp(lambda w, x: forward(w, x, bi), stack, saved[bi % k_])
    d_stack_i, dx = pull(jnp.where(last, dy.astype(recv_g.dtype), recv_g))
    d_stack = add_if(b >= 0, d_stack, d_stack_i)
    dxs = dxs.at[bi].set(jnp.where((b >= 0) & (s == 0), dx, dxs[bi]))
    recv_x, recv_g = jax.lax.ppermute(y, AXIS, _ring(s_, 1)), jax.lax.ppermute(dx, AXIS, _ring(s_, -1))
    return (recv_x, recv_g, saved, d_stack, d_rest, parts, dxs), None

  init = (zeros(xs[0]), zeros(xs[0]), zeros(xs[:k_]), zeros(stack), zeros(rest),
          varying(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), parts_shape)), zeros(xs))
  (_, _, _, d_stack, d_rest, parts, dxs), _ = jax.lax.scan(tick, init, tab)
  # Only the last stage ran the head: the sums over stages are its values (in fp32: see pipeline.run).
  total = lambda t: jax.tree.map(lambda a: jax.lax.psum(a.astype(jnp.float32), AXIS).astype(a.dtype), t)
  return d_stack, total(d_rest), total(parts), dxs[None]


def _ring(stages: int, step: int) -> list[tuple[int, int]]:
  return [(i, (i + step) % stages) for i in range(stages)]


def value_and_grad(objective: Objective, params: Any, batch: dict[str, jax.Array],
                   schedule: Schedule) -> tuple[dict[str, jax.Array], Any]:
  """(parts, gradient of the objective) as `jax.value_and_grad(objective, has_aux=True)` gives them, with the
  model's layer stack run in 1F1B order over `schedule.stages` stages and `schedule.microbatches`
  microbatches of the batch's rows. The objective must be a sum over rows (microbatches add up)."""
  x_BTD, pull_before, segment_ids_BT, positions_BT, model = _before_the_stack(objective, params, batch)
  split = lambda a: pipeline_lib._split(a, schedule.microbatches)
  rows = jax.tree.map(split, batch)
  with pipeline_lib.substitute(lambda _layers, _stacked, x_BTD, *_: x_BTD):  # the parts' shapes
    parts_shape = jax.eval_shape(lambda p, r: objective(p, r)[1], params, jax.tree.map(lambda a: a[0], rows))
  stack, rest = model.parts(params)
  body = functools.partial(_stage, model, objective, schedule, parts_shape)
  # The stored [L, ...] stack is split contiguously over `pipeline`: with R = 1 each stage's block is its layers.
  fn = jax.shard_map(body, in_specs=([P(AXIS)] * len(stack), [P()] * len(rest), P(), P(), P(), P(), P()),
                     out_specs=([P(AXIS)] * len(stack), [P()] * len(rest), P(), P(AXIS)), axis_names={AXIS})
  d_stack, d_rest, parts, dxs = fn(stack, rest, split(x_BTD), split(segment_ids_BT), split(positions_BT), rows,
                                   jnp.asarray(table(schedule)))
  (d_before,) = pull_before(pipeline_lib._merge(dxs[0]).astype(x_BTD.dtype))
  return parts, jax.tree.map(jnp.add, d_before, model.rebuild(d_stack, d_rest))
