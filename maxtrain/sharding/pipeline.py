"""A circular pipeline over the `pipeline` mesh axis, inside the one SPMD program.

The state keeps the layer stack [L, ...] with L split into contiguous blocks over `pipeline` (rule
`layers`), so a checkpoint does not know whether it was pipelined. A step views it as [R, S, L/(R S), ...]:
virtual stage v = r S + s (layers v L/(R S) ...) runs on stage s in repeat r. Under `jax.shard_map`
over `pipeline` alone (data, fsdp and tensor stay GSPMD-partitioned inside each stage), each stage
runs its layers on the microbatch it holds and hands the result to the next stage with `ppermute`;
the last stage's output returns to stage 0 for the next repeat (a ring). M microbatches take
R M + S - 1 iterations, of which S - 1 are the fill/drain bubble: (S - 1) / (R M + S - 1) of each
stage's time. The forward runs all microbatches, then autodiff runs the backward through the same scan
(GPipe order: activations of all M microbatches are alive at the peak).

With R = 1 the [S, L/S] view is the stored layout (no weight moves); with R > 1 stage s holds the
non-adjacent groups s, S + s, ..., so each step reshuffles the stored contiguous blocks into that view
(an all-to-all of the layer weights, and back for their gradients): see docs/sharding.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

AXIS = "pipeline"
# pipeline.schedule: the order of the forward and backward passes (sharding/schedules.py runs all but gpipe).
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb", "auto")  # auto: program/schedule_fit.py picks one


@dataclasses.dataclass(frozen=True)
class Schedule:
  stages: int  # S: the pipeline axis size (both levels)
  microbatches: int  # M
  repeats: int  # R: circular repeats
  stage_remat: bool = False  # the model recomputes a stage's layers in the backward from the stage's input
  kind: str = "gpipe"  # pipeline.schedule: gpipe (this module) or 1f1b, interleaved_1f1b, zb (sharding/schedules.py)
  branchless: bool = False  # run every op of a tick masked, no per-op loops (runtime.platform=neuron: no conditionals or dynamic loops)

  @property
  def iterations(self) -> int:
    """Loop iterations: of the forward scan (gpipe; the backward runs as many), or ticks of one op per stage
    (1f1b, interleaved_1f1b: a forward and a whole backward per pass; zb: F, B and W per microbatch)."""
    s_, m_, r_ = self.stages, self.microbatches, self.repeats
    if self.kind == "zb":
      return 3 * m_ + s_ - 1
    if self.kind in ("1f1b", "interleaved_1f1b"):
      return 2 * (r_ * m_ + s_ - 1)
    return r_ * m_ + s_ - 1

  @property
  def bubble(self) -> float:
    """The share of each stage's ticks spent idle (fill and drain): what schedules.table counts (tested equal)."""
    idle = 2 * (self.stages - 1) if self.kind in ("1f1b", "interleaved_1f1b") else self.stages - 1
    return idle / self.iterations

  @property
  def formula(self) -> str:
    return {"zb": "(S-1)/(3M+S-1)", "1f1b": "(S-1)/(M+S-1)"}.get(self.kind, "(S-1)/(R*M+S-1)")

  def describe(self) -> str:
    return (f"{self.stages} stages x {self.repeats} repeat(s), {self.microbatches} microbatches"
            + ("" if self.kind == "gpipe" else f", schedule {self.kind}") + ": "
            f"{self.iterations} iterations, bubble {self.formula} = {self.bubble:.4f}"
            + ("; stage remat" if self.stage_remat or self.kind != "gpipe" else ""))

  def to_json(self) -> dict[str, Any]:
    return {"schedule": self.kind, "stages": self.stages, "microbatches": self.microbatches, "repeats": self.repeats,
            "iterations": self.iterations, "bubble_fraction": self.bubble, "stage_remat": self.stage_remat}


def _split(x_B: jax.Array, m: int) -> jax.Array:
  """[B, ...] -> [M, B/M, ...], microbatch i = rows i, i + M, ...: every batch shard keeps its rows."""
  return jnp.swapaxes(x_B.reshape(x_B.shape[0] // m, m, *x_B.shape[1:]), 0, 1)


def _merge(x_M: jax.Array) -> jax.Array:
  return jnp.swapaxes(x_M, 0, 1).reshape(-1, *x_M.shape[2:])


# (this stage's layers [L/(R S), R, ...], the repeat r (an int when R = 1), x, segment ids, positions) -> x
LayersFn = Callable[[Any, jax.Array | int, jax.Array, jax.Array, jax.Array], jax.Array]
# What sharding/schedules.py passes down the model's forward (an argument: models/stack.py `Pipelined`) to run in
# place of the pipelined stack while it traces the model: (layers, stacked, x, segment ids, positions) -> x.
StackHook = Callable[[LayersFn, Any, jax.Array, jax.Array, jax.Array], jax.Array]


def run(layers: LayersFn, stacked: Any, x_BTD: jax.Array, segment_ids_BT: jax.Array, positions_BT: jax.Array,
        schedule: Schedule) -> jax.Array:
  """`layers(stage, r, x, segment_ids, positions)` applies layer group r of a stage's layers [L/(R S), R, ...]
  (layer i of repeat r: `stage[i, r]`) in order; this applies all of `stacked` [L, ...] to `x_BTD` through the
  pipeline (the same result as applying them in order to the whole batch).

  Why the group is indexed inside `layers` (in its per-layer scan, under its remat): a weight slice taken here
  by the loop's repeat index would be a per-iteration value, and autodiff would keep a copy of the stage's
  weights for every one of the R M + S - 1 iterations; indexed inside a checkpointed layer (without remat:
  one that recomputes only slices and reshapes, models/decoder.py), the residual is the loop-invariant stage
  weights, kept once. With R = 1 the index is the constant 0 (tests: the saved residuals; compiled temp
  memory: tools/pipeline_memory.py, docs/sharding.md)."""
  s_, m_, r_ = schedule.stages, schedule.microbatches, schedule.repeats
  grouped = jax.tree.map(lambda w: w.reshape((r_, s_, -1) + w.shape[1:]), stacked)
  xs, segs, poss = (_split(a, m_) for a in (x_BTD, segment_ids_BT, positions_BT))
  ring = [(i, (i + 1) % s_) for i in range(s_)]

  # Stage remat: each iteration saves only its input (and r); the backward recomputes the stage's layers.
  # The weights are an argument, so the scan saves them once rather than a slice per iteration.
  apply = jax.checkpoint(layers, static_argnums=(1,) if r_ == 1 else ()) if schedule.stage_remat else layers

  def stage(grouped, xs, segs, poss):
    weights = jax.tree.map(lambda w: jnp.swapaxes(w[:, 0], 0, 1), grouped)  # this stage's [L/(R S), R, ...]
    s = jax.lax.axis_index(AXIS)
    varying = lambda a: jax.lax.pcast(a, AXIS, to="varying")

    def body(carry, t):
      recv, buf, out = carry
      k = t - s  # the k-th pass through this stage: microbatch k % M of repeat k // M
      valid = (k >= 0) & (k < r_ * m_)
      kc = jnp.clip(k, 0, r_ * m_ - 1)
      m, r = kc % m_, (kc // m_ if r_ > 1 else 0)
      # The input is invariant over stages: its cotangent is psum'd over them, here in f32 (jax 0.10.2's
      # XLA:CPU aborts promoting a bf16 all-reduce whose reducer shard_map wrapped: "opcode copy").
      new = varying(xs[t % m_].astype(jnp.float32)).astype(xs.dtype)
      first = jnp.where(t < m_, new, buf[t % m_])  # stage 0: a new microbatch, or one back from the ring
      x = jnp.where(s == 0, first, recv)
      y = apply(weights, r, x, segs[m], poss[m])
      done = valid & (r == r_ - 1)
      out = out.at[m].set(jnp.where(done, y, out[m]))
      recv = jax.lax.ppermute(y, AXIS, ring)
      slot = (t - s_ + 1) % m_  # stage 0 keeps what the last stage finished for its next repeat
      buf = buf.at[slot].set(jnp.where(t >= s_ - 1, recv, buf[slot]))
      return (recv, buf, out), None

    init = (varying(jnp.zeros_like(xs[0])), varying(jnp.zeros_like(xs)), varying(jnp.zeros_like(xs)))
    (_, _, out), _ = jax.lax.scan(body, init, jnp.arange(r_ * m_ + s_ - 1))  # gpipe order (also the forward-only eval of 1f1b)
    return out[None]

  fn = jax.shard_map(stage, in_specs=(P(None, AXIS), P(), P(), P()), out_specs=P(AXIS), axis_names={AXIS})
  out = fn(grouped, xs, segs, poss)[s_ - 1]  # the last stage's outputs of the last repeat
  return _merge(out)
