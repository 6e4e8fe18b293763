"""Pipeline schedules as host-side tables, run op by op in the one SPMD program.

A schedule is a table int [ticks, S, 2]: per tick and stage, the op the stage runs (IDLE, F forward, H forward
and the loss head on the last virtual stage, B input gradient, W weight gradient, BW both) and on which pass
(p = r M + i: layer group r of microbatch i). Under `shard_map` over `pipeline` each device runs its own
program, so a stage runs its tick's op by the table entry of `axis_index` (a while loop of 0 or 1 trips per op,
which updates the gradient accumulators in place where `lax.switch` copied them): only that op's work is paid
(an idle slot costs nothing but the tick's two `ppermute`s, which stay outside the ops). A
stage keeps the inputs and the incoming gradients of the passes in flight in slot buffers assigned on the
host (`program`); F/H read the input, B/W/BW recompute the stage from it (these schedules imply stage remat).

With `Schedule.branchless` (runtime.platform=neuron: neuronx-cc rejects conditionals) every op the table uses
runs every tick and its results are masked: the same values, the cost of all ops per tick (lockstep).

The tables come from per-stage op orders (`_orders`), each op placed at the first tick its inputs exist:
- `1f1b`: S - s - 1 warm-up forwards on stage s, then F and BW alternate; 2(M + S - 1) ticks, bubble
  (S-1)/(M+S-1), stage s holds S - s microbatches (the classic 1F1B: PipeDream-Flush / Megatron).
- `zb` (ZB-H1, Qi et al. 2023): the backward split into B (on the critical path) and W (deferred by s on
  stage s, filling the drain); with F, B, W one tick each: 3M + S - 1 ticks, bubble (S-1)/(3M+S-1), every
  stage holds S microbatches (1F1B's peak on stage 0).
- `interleaved_1f1b` (Megatron's interleaved 1F1B): stage s holds the R layer groups s, S + s, ...; forwards
  by groups of S microbatches, (S - s - 1) 2 + (R - 1) S warm-up forwards; 2(R M + S - 1) ticks of a layer
  group each, bubble (S-1)/(R M+S-1).
- `gpipe` (sharding/pipeline.py runs it with autodiff): its forward loop then its backward loop.
The bubble counted from a table (idle stage-ticks / all) equals these formulas (tests/test_pipeline_schedules.py).
Ticks are lockstep (each tick ends with the two ppermutes), so with a BW costing about 3 F's (recompute + 2
matmuls per F matmul) a 1f1b tick on a real device lasts as long as its slowest stage's op.

Everything the model computes outside its layer stack (embedding, final norm, head, loss) runs unchanged:
the model is traced with a stack hook (`pipeline.StackHook`, the objective's third argument) capturing the
stack's input (the part before the stack, its gradient by `jax.vjp`) and, per microbatch on the last stage,
returning the stage output (the part after).
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

IDLE, F, H, B, W, BW = range(6)
OPS = ("idle", "F", "H", "B", "W", "BW")
# (params, batch, stack hook) -> (the objective summed over the batch's loss tokens, its parts: sums over rows); the
# hook runs in place of the model's pipelined layer stack (models/stack.py Pipelined), never None here
Objective = Callable[[Any, dict[str, jax.Array], pipeline_lib.StackHook], tuple[jax.Array, dict[str, jax.Array]]]


def _orders(schedule: Schedule) -> list[list[tuple[int, int]]]:
  """Per stage, its ops (op, pass) in the order it runs them (the module docstring gives each schedule's)."""
  s_, m_, r_, kind = schedule.stages, schedule.microbatches, schedule.repeats, schedule.kind
  head = lambda s, p: H if (p // m_) * s_ + s == r_ * s_ - 1 else F  # the last virtual stage runs the head
  out = []
  for s in range(s_):
    if kind == "zb":
      order = [(head(s, i), i) for i in range(min(s_ - s, m_))]
      done_f, done_w = len(order), 0
      for k in range(m_):
        order.append((B, k))
        if k >= s:  # W deferred by s on stage s: the drain's idle ticks run the deferred W's
          order.append((W, done_w))
          done_w += 1
        if done_f < m_:
          order.append((head(s, done_f), done_f))
          done_f += 1
      order += [(W, i) for i in range(done_w, m_)]
    else:  # 1f1b (R = 1) and interleaved_1f1b: warm-up forwards, then one forward and one backward in turn
      passes = [(r, i) for r in range(r_) for i in range(m_)]
      fwd = [r * m_ + i for r, i in sorted(passes, key=lambda ri: (ri[1] // s_, ri[0], ri[1] % s_))]
      bwd = [r * m_ + i for r, i in sorted(passes, key=lambda ri: (ri[1] // s_, r_ - 1 - ri[0], ri[1] % s_))]
      warm = min(s_ - s - 1 if kind == "1f1b" else 2 * (s_ - s - 1) + (r_ - 1) * s_, r_ * m_)
      order = [(head(s, p), p) for p in fwd[:warm]]
      for k in range(r_ * m_):
        if warm + k < r_ * m_:
          order.append((head(s, fwd[warm + k]), fwd[warm + k]))
        order.append((BW, bwd[k]))
    out.append(order)
  return out


def table(schedule: Schedule) -> np.ndarray:
  """The schedule's ops, int [ticks, S, 2] of (op, pass): each stage's next op at the first tick whose
  inputs were sent at an earlier tick. gpipe: the forward loop (pass k on stage s at iteration k + s), then
  autodiff's backward loop in reverse."""
  s_, m_, r_ = schedule.stages, schedule.microbatches, schedule.repeats
  if schedule.kind == "gpipe":
    its = r_ * m_ + s_ - 1
    out = np.zeros((2 * its, s_, 2), np.int32)
    for t in range(its):
      for s in range(s_):
        if 0 <= t - s < r_ * m_:
          out[t, s] = (F, t - s)
          out[2 * its - 1 - t, s] = (BW, t - s)
    return out
  orders, v_last = _orders(schedule), r_ * s_ - 1
  done: dict[tuple[int, int, int], int] = {}  # (kind F/B/W, virtual stage, microbatch) -> tick
  position, rows, t = [0] * s_, [], 0
  while any(position[s] < len(orders[s]) for s in range(s_)):
    row = np.zeros((s_, 2), np.int32)
    ran = []
    for s in range(s_):
      if position[s] == len(orders[s]):
        continue
      op, p = orders[s][position[s]]
      v, i = (p // m_) * s_ + s, p % m_
      before = lambda key: done.get(key, t) < t
      ready = {F: v == 0 or before((F, v - 1, i)), H: v == 0 or before((F, v - 1, i)),
               B: before((F, v, i)) and (v == v_last or before((B, v + 1, i))), W: before((B, v, i))}
      if ready[B if op == BW else op]:
        row[s] = (op, p)
        ran.append((s, op, v, i))
    for s, op, v, i in ran:
      position[s] += 1
      for kind in {F: (F,), H: (F,), B: (B,), W: (W,), BW: (B, W)}[op]:
        done[(kind, v, i)] = t
    rows.append(row)
    t += 1
    assert t <= 4 * s_ * r_ * m_ + 4 * s_, f"schedule {schedule.kind} does not finish"  # an order bug, not input
  return np.stack(rows)


def bubble(tab: np.ndarray) -> float:
  """The share of the table's stage-ticks that are idle."""
  return float(np.mean(tab[:, :, 0] == IDLE))


def held(tab: np.ndarray) -> np.ndarray:
  """Per stage, the most passes whose forward ran and whose weight gradient has not (after a tick's forward,
  before its backward): the stage inputs a schedule keeps. gpipe: all of them (R M)."""
  op = tab[:, :, 0]
  fwd, bwd = np.cumsum((op == F) | (op == H), axis=0), np.cumsum((op == W) | (op == BW), axis=0)
  return np.max(fwd - np.concatenate([np.zeros_like(bwd[:1]), bwd[:-1]]), axis=0)


@dataclasses.dataclass(frozen=True)
class Program:
  """A table with its buffers: per tick and stage (op, pass, x slot, g slot, slot the received activation goes
  to, slot the received gradient goes to; -1: none), and the number of slots of each buffer."""
  rows: np.ndarray  # int [ticks, S, 6]
  x_slots: int
  g_slots: int


def program(schedule: Schedule) -> Program:
  """Slots for the inputs (x) and incoming gradients (g) of the passes in flight on each stage: a pass's x
  arrives after the tick its previous virtual stage ran F (stage 0's first group reads the batch), its g after
  the tick the next ran B/BW (the last virtual stage's: H writes it); both are freed by the pass's W/BW. A slot
  read in a tick can take a new arrival at the end of that tick."""
  tab = table(schedule)
  s_, m_, r_ = schedule.stages, schedule.microbatches, schedule.repeats
  ticks, v_last = tab.shape[0], r_ * s_ - 1
  rows = np.full((ticks, s_, 6), -1, np.int32)
  rows[:, :, :2] = tab
  rows[:, :, 2:4] = 0
  arrive: dict[tuple[str, int, int], int] = {}  # (buffer, stage, pass) -> tick at whose end it is stored
  last: dict[tuple[str, int, int], int] = {}  # ... -> the tick of its last read
  for t in range(ticks):
    for s in range(s_):
      op, p = tab[t, s]
      r, i = p // m_, p % m_
      v = r * s_ + s
      if op in (F,) and v < v_last:  # sent down: the next virtual stage's input
        nxt = v + 1
        arrive[("x", nxt % s_, (nxt // s_) * m_ + i)] = t
      if op == H:
        arrive[("g", s, p)] = t
      if op in (B, BW) and v > 0:  # sent up: the previous virtual stage's incoming gradient
        prv = v - 1
        arrive[("g", prv % s_, (prv // s_) * m_ + i)] = t
      if op in (W, BW):
        last[("x", s, p)] = last[("g", s, p)] = t
  slots: dict[tuple[str, int, int], int] = {}
  counts = {"x": 1, "g": 1}
  for buf in ("x", "g"):
    for s in range(s_):
      free_at: list[int] = []  # per slot, the tick from whose end on it is free
      for key in sorted((k for k in arrive if k[0] == buf and k[1] == s), key=lambda k: arrive[k]):
        k = next((j for j, f in enumerate(free_at) if f <= arrive[key]), None)
        if k is None:
          free_at.append(0)
          k = len(free_at) - 1
        slots[key], free_at[k] = k, last[key]
      counts[buf] = max(counts[buf], len(free_at))
  for t in range(ticks):
    for s in range(s_):
      op, p = tab[t, s]
      rows[t, s, 2] = slots.get(("x", s, p), 0)
      rows[t, s, 3] = slots.get(("g", s, p), 0)
      for col, buf, src, ops, step in ((4, "x", (s - 1) % s_, (F,), 1), (5, "g", (s + 1) % s_, (B, BW), -1)):
        op_src, p_src = tab[t, src]
        v_dst = (p_src // m_) * s_ + src + step
        if op_src in ops and 0 <= v_dst <= v_last:
          rows[t, s, col] = slots[(buf, s, (v_dst // s_) * m_ + p_src % m_)]
  return Program(rows, counts["x"], counts["g"])


def slots(schedule: Schedule) -> int:
  """Stage inputs the schedule keeps in its buffer of slots (1f1b: S; zb: S)."""
  return program(schedule).x_slots


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
      return x_BTD, {}
    objective(p, batch, capture)
    assert box, "pipeline.schedule: the model ran no layer stack through the pipeline"
    # Which parameter leaves the stack is made of: the same traced arrays (nnx.split does not copy).
    where = {id(w): i for i, w in enumerate(jax.tree.leaves(p))}
    box["stack_index"] = [where[id(w)] for w in jax.tree.leaves(box["stacked"])]
    found.append(box)
    return box["x"], box["ids"]

  x_BTD, pull, (segment_ids_BT, positions_BT) = jax.vjp(before, params, has_aux=True)
  assert len(found) == 1, f"a schedule pipelines one layer stack; the model ran {len(found)} under it"
  box, (leaves, treedef) = found[0], jax.tree.flatten(params)
  rest_index = [i for i in range(len(leaves)) if i not in set(box["stack_index"])]
  split = _Split(box["layers"], jax.tree.structure(box["stacked"]), box["stack_index"], rest_index, treedef)
  return x_BTD, pull, segment_ids_BT, positions_BT, split


def _ops(forward: Callable, after: Callable, stack: list, rest: list, m_: int, r_: int,
         stats_ct: dict[str, jax.Array]) -> tuple[Callable, ...]:
  """The ops by code (IDLE, F, H, B, W, BW): (x, g, p, accumulators) -> (y sent down, dx sent up, dy of the loss
  head, accumulators (layer gradients, the rest's gradients, the objective's parts, the layers' statistics)).
  The statistics (pipeline.LayersFn) are summed by the forward ops; the backward ops pull `stats_ct` [L/(R S), R]
  (the objective's constant gradient with respect to a layer's summed statistic, per layer of this stage) back
  through them with the pass's output gradient."""
  zeros = lambda t: jax.tree.map(jnp.zeros_like, t)
  plus = lambda a, b: jax.tree.map(jnp.add, a, b)
  group = lambda p: 0 if r_ == 1 else p // m_

  def values(w, x, p):  # the pass's output (and its statistics' part of the objective, linear in them)
    y, stats = forward(w, x, p)
    if not stats_ct:
      return y
    return y, sum(jnp.sum(stats[k] * ct[:, group(p)].reshape((-1,) + (1,) * (stats[k].ndim - 1)))
                  for k, ct in stats_ct.items())

  def pullback(pull, g):
    return pull((g, _varying(jnp.ones((), jnp.float32))) if stats_ct else g)

  def idle(x, g, p, acc):
    return zeros(x), zeros(x), zeros(x), acc

  def f(x, g, p, acc):
    y, stats_i = forward(stack, x, p)
    d_stack, d_rest, parts, stats = acc
    return y, zeros(x), zeros(x), (d_stack, d_rest, parts, pipeline_lib.stats_add(stats, stats_i, group(p)))

  def h(x, g, p, acc):
    y, stats_i = forward(stack, x, p)
    _, pull_after, parts_i = jax.vjp(lambda r, y: after(r, y, p % m_), rest, y, has_aux=True)
    d_rest_i, dy = pull_after(_varying(jnp.ones((), jnp.float32)))
    d_stack, d_rest, parts, stats = acc
    return zeros(x), zeros(x), dy.astype(x.dtype), (d_stack, plus(d_rest, d_rest_i), plus(parts, parts_i),
                                                    pipeline_lib.stats_add(stats, stats_i, group(p)))

  def b(x, g, p, acc):  # the input gradient only: the critical path
    _, pull = jax.vjp(lambda x: values(stack, x, p), x)
    return zeros(x), pullback(pull, g)[0], zeros(x), acc

  def w(x, g, p, acc):  # the weight gradient only
    _, pull = jax.vjp(lambda w: values(w, x, p), stack)
    d_stack, d_rest, parts, stats = acc
    return zeros(x), zeros(x), zeros(x), (plus(d_stack, pullback(pull, g)[0]), d_rest, parts, stats)

  def bw(x, g, p, acc):
    _, pull = jax.vjp(lambda w, x: values(w, x, p), stack, x)
    d_stack_i, dx = pullback(pull, g)
    d_stack, d_rest, parts, stats = acc
    return zeros(x), dx, zeros(x), (plus(d_stack, d_stack_i), d_rest, parts, stats)

  return idle, f, h, b, w, bw


def _stage(model: _Split, objective: Objective, schedule: Schedule, prog: Program, parts_shape: Any, stack: list,
           rest: list, xs: jax.Array, segs: jax.Array, poss: jax.Array, rows: dict[str, jax.Array],
           tab: jax.Array, stats_ct: dict[str, jax.Array]) -> tuple:
  """One stage's program (under shard_map over `pipeline`): per tick, the op of its row of `tab` (`run_op`), then
  one ppermute each way. Returns this stage's layer gradients [R, 1, L/(R S), ...], the rest's (and the
  objective's parts) summed over stages, and stage 0's input gradients."""
  s_, m_, r_ = schedule.stages, schedule.microbatches, schedule.repeats
  s = jax.lax.axis_index(AXIS)
  # Differentiate varying copies: the cotangent of a stage-invariant input would be psum'd every tick.
  rest, xs = _varying(rest), _varying(xs)
  stack = [jnp.swapaxes(w[:, 0], 0, 1) for w in stack]  # this stage's [L/(R S), R, ...]

  def forward_on(segs, poss):
    def forward(stack, x, p):  # layer group p // M of this stage on microbatch p % M
      stage = jax.tree.unflatten(model.stack_def, stack)
      return model.layers(stage, 0 if r_ == 1 else p // m_, x, segs[p % m_], poss[p % m_])
    return forward

  def ops_on(stack, rest, segs, poss, rows, stats_ct):  # the ops (`_ops`) over these values
    def after(rest, y, i):  # the model after the stack on microbatch i (the last stage's loss head)
      return objective(model.rebuild(stack, rest), jax.tree.map(lambda a: a[i], rows), lambda *_: (y, {}))
    return _ops(forward_on(segs, poss), after, stack, rest, m_, r_, stats_ct)

  stats_ct = {k: jnp.swapaxes(c[:, 0], 0, 1) for k, c in stats_ct.items()}  # [R, 1, L/(R S)] -> [L/(R S), R]
  branches = ops_on(stack, rest, segs, poss, rows, stats_ct)
  present = sorted(set(int(o) for o in np.unique(prog.rows[:, :, 0])) - {IDLE})

  def run_op(op, *operands):
    out = branches[IDLE](*operands)
    if schedule.branchless:  # no conditionals (Neuron rejects them): every op the table uses runs, results masked
      for code in present:
        out = jax.tree.map(lambda cur, new, code=code: jnp.where(op == code, new, cur), out, branches[code](*operands))
      return out
    # Only the op this stage runs this tick is computed: a while loop of 0 or 1 trips per op, not lax.switch. A
    # conditional's operands and results are separate buffers, so the accumulators passing through a switch (the
    # stage's f32 weight gradient) were copied every tick (+1.5 GiB per device at 70B widths, BENCHMARKS.md); a while
    # loop updates its carry in place. Everything an op reads passes an optimization barrier with the trip counter,
    # so no collective of the op is hoisted out of its loop: hoisted, every op's fsdp-gathered weights were alive at
    # once, and a collective beside the loop (the loss head's token count) is one that XLA:CPU's runtime may order
    # before the loop on one device and after it on another: a deadlock (aot/hlo_lint.py
    # unordered_collective_loops).
    x, g, p, _ = operands
    for code in present:
      def body(carry, code=code):
        trip, (_, _, _, acc) = carry
        (stack_t, rest_t, segs_t, poss_t, rows_t, ct_t, x_t, g_t, p_t), _ = jax.lax.optimization_barrier(
            ((stack, rest, segs, poss, rows, stats_ct, x, g, p), trip))
        return trip + 1, ops_on(stack_t, rest_t, segs_t, poss_t, rows_t, ct_t)[code](x_t, g_t, p_t, acc)
      trips = (op == code).astype(jnp.int32)
      _, out = jax.lax.while_loop(lambda carry, trips=trips: carry[0] < trips, body, (jnp.int32(0), out))
    return out

  def tick(carry, tab_t):
    xbuf, gbuf, acc, dxs = carry
    op, p, xk, gk, rx, rg = (tab_t[s, c] for c in range(6))
    i = p % m_
    x = jnp.where((s == 0) & (p < m_), xs[i], xbuf[xk])  # stage 0's first layer group reads the batch
    y, dx, dy, acc = run_op(op, x, gbuf[gk], p, acc)
    gbuf = gbuf.at[gk].set(jnp.where(op == H, dy, gbuf[gk]))
    dxs = dxs.at[i].set(jnp.where(((op == B) | (op == BW)) & (s == 0) & (p < m_), dx, dxs[i]))
    recv_x, recv_g = jax.lax.ppermute(y, AXIS, _ring(s_, 1)), jax.lax.ppermute(dx, AXIS, _ring(s_, -1))
    rx_, rg_ = jnp.maximum(rx, 0), jnp.maximum(rg, 0)
    xbuf = xbuf.at[rx_].set(jnp.where(rx >= 0, recv_x, xbuf[rx_]))
    gbuf = gbuf.at[rg_].set(jnp.where(rg >= 0, recv_g, gbuf[rg_]))
    return (xbuf, gbuf, acc, dxs), None

  zeros = lambda t: jax.tree.map(jnp.zeros_like, t)
  buffer = lambda k: zeros(jnp.broadcast_to(xs[:1], (k,) + xs.shape[1:]))
  stats_shape = jax.eval_shape(forward_on(segs, poss), stack, xs[0], 0)[1]
  acc = (zeros(stack), zeros(rest), _varying(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), parts_shape)),
         pipeline_lib.stats_init(stats_shape, r_))
  init = (buffer(prog.x_slots), buffer(prog.g_slots), acc, zeros(xs))
  (_, _, (d_stack, d_rest, parts, stats), dxs), _ = jax.lax.scan(tick, init, tab)
  # Only the last stage ran the head: the sums over stages are its values (in fp32: see pipeline.run).
  total = lambda t: jax.tree.map(lambda a: jax.lax.psum(a.astype(jnp.float32), AXIS).astype(a.dtype), t)
  d_stack = [jnp.swapaxes(d, 0, 1)[:, None] for d in d_stack]  # back to [R, 1, L/(R S), ...]
  return d_stack, total(d_rest), total(parts), dxs[None], jax.tree.map(lambda a: a[None], stats)


def _varying(tree: Any) -> Any:
  return jax.tree.map(lambda a: jax.lax.pcast(a, AXIS, to="varying"), tree)


def _ring(stages: int, step: int) -> list[tuple[int, int]]:
  return [(i, (i + step) % stages) for i in range(stages)]


def value_and_grad(objective: Objective, params: Any, batch: dict[str, jax.Array], schedule: Schedule,
                   stats_cotangent: dict[str, jax.Array] | None = None,
                   ) -> tuple[dict[str, jax.Array], Any, dict[str, jax.Array]]:
  """(parts, gradient of the objective) as `jax.value_and_grad(objective, has_aux=True)` gives them, with the
  model's layer stack run by `schedule`'s table over `schedule.stages` stages and `schedule.microbatches`
  microbatches of the batch's rows, and the stack's statistics [L, ...] summed over the microbatches (as
  `pipeline.run` returns them). The objective here sees none of them, so its parts have no terms of them: the
  caller adds those from the sums, and hands their gradient with respect to each layer's summed statistic as
  `stats_cotangent` ({name: [L]}; it must be a constant, known before the first backward: a term linear in the
  sums, such as the router z-loss). The objective must be a sum over rows (microbatches add up)."""
  x_BTD, pull_before, segment_ids_BT, positions_BT, model = _before_the_stack(objective, params, batch)
  split = lambda a: pipeline_lib._split(a, schedule.microbatches)
  rows = jax.tree.map(split, batch)
  identity = lambda _layers, _stacked, x_BTD, *_: (x_BTD, {})
  parts_shape = jax.eval_shape(lambda p, r: objective(p, r, identity)[1], params,  # the parts' shapes
                               jax.tree.map(lambda a: a[0], rows))
  stack, rest = model.parts(params)
  s_, r_ = schedule.stages, schedule.repeats
  # Stage s's layer groups s, S + s, ...: the stored [L, ...] stack viewed [R, S, L/(R S), ...] (with R = 1 the
  # stored contiguous blocks; with R > 1 an all-to-all of the weights each step, as gpipe's circular order).
  grouped = [w.reshape((r_, s_, -1) + w.shape[1:]) for w in stack]
  prog = program(schedule)
  body = functools.partial(_stage, model, objective, schedule, prog, parts_shape)
  stats_ct = {k: c.reshape(r_, s_, -1) for k, c in (stats_cotangent or {}).items()}  # viewed like the stack
  fn = jax.shard_map(body, in_specs=([P(None, AXIS)] * len(stack), [P()] * len(rest), P(), P(), P(), P(), P(),
                                     P(None, AXIS)),
                     out_specs=([P(None, AXIS)] * len(stack), [P()] * len(rest), P(), P(AXIS), P(AXIS)),
                     axis_names={AXIS})
  d_grouped, d_rest, parts, dxs, stats = fn(grouped, rest, split(x_BTD), split(segment_ids_BT), split(positions_BT), rows,
                                     jnp.asarray(prog.rows), stats_ct)
  d_stack = [d.reshape(w.shape) for d, w in zip(d_grouped, stack)]
  (d_before,) = pull_before(pipeline_lib._merge(dxs[0]).astype(x_BTD.dtype))
  return parts, jax.tree.map(jnp.add, d_before, model.rebuild(d_stack, d_rest)), pipeline_lib.stats_layers(stats)
