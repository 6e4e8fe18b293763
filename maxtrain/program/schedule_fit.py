"""`pipeline.schedule=auto`: the pipeline schedule chosen ahead of time from what each one costs.

`choose_schedule` compiles the train step once per candidate schedule for the run's mesh (gpipe, 1f1b and zb
with pipeline.repeats=1; gpipe and interleaved_1f1b with repeats > 1), reads each one's device peak
(`Compiled.memory_analysis`), and picks the fastest by the cost model below whose peak fits the target's
memory with `fit.headroom` to spare. The table (bubble, microbatches held, peak, bytes per stage boundary,
estimated step time) is logged before training and printed by `maxtrain.compile`.

Cost model (to rank the candidates, not a measurement): the stages run in lockstep ticks (each ends with
the ppermutes), so a tick lasts as long as the costliest op any stage runs in it, and a step takes
  ticks x (the costliest op, in stage forwards of one microbatch's layer group) x its FLOPs / peak FLOP/s.
With u = 1 + the model's own remat recompute (fit.recompute_flops_per_token / the layers' forward FLOPs):
gpipe runs R M + S - 1 forward iterations (1) and as many backward ones (2 + u - 1, + 1 with stage_remat);
1f1b and interleaved_1f1b 2 (R M + S - 1) ticks of F (1) or BW (1 + u + 1: the stage recomputed from its
input, then both gradients); zb 3 M + S - 1 ticks of F (1), B (u + 1) or W (u + 1). Branchless (Neuron) ticks
run every op of the table. The embedding, head and optimizer are the same for every schedule and left out.

Whether to pipeline at all: the table has a row `no pipeline`, the same config with the pipeline axis folded into
fsdp at its level (`unpipelined`: mesh.pipeline into mesh.fsdp, mesh.dcn_pipeline into mesh.dcn_fsdp), compiled the
same way, its layers' work (2 + u) forwards with no bubble. Every row also pays its fsdp collectives and stage sends
(`step_times`, the target's network figures in program/fit.py TARGETS):
  step = max(layer work, fsdp collectives) + stage-boundary sends
- fsdp collectives, each moving a layer group's weights (the device's tensor shard, at model.param_dtype), where
  XLA:CPU's compiled steps put them (70B widths, pipeline=4 x fsdp=2): the schedules' ops gather inside their
  loops (F and H 1, B, W and BW 2: the recomputed forward's and the backward's); gpipe gathers the forward's once
  (hoisted out of its loop) and the backward's every iteration; without a pipeline, each accumulation step gathers
  all the layers for the forward and again for the backward; every row reduces the gradient once per accumulation
  step (counted as one more collective). One collective over an fsdp axis of n_ici devices
  in a node x n_dcn nodes: across nodes first (each device fetches its 1/n_ici part of what the other nodes hold,
  bytes (n_dcn-1)/(n_dcn n_ici), over its share of the node's NICs: network bandwidth / devices per node), then
  inside the node (bytes (n_ici-1)/n_ici over the device's link). Overlapped with compute (XLA's scheduler gathers
  the next layer during this one): the step takes the longer of the two. An optimistic model for fsdp.
- stage-boundary sends (the ppermutes, both directions at once): not overlapped (the next tick waits for them),
  over the network when the pipeline crosses nodes (mesh.dcn_pipeline > 1, each device its NIC share), else the link.
Data-parallel gradient reductions move the same bytes in every row and are left out.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Sequence

from maxtrain.config import schema
import numpy as np

from maxtrain.errors import UserError
from maxtrain.program import fit
from maxtrain.sharding import mesh as mesh_lib
from maxtrain.sharding import pipeline as pipeline_lib
from maxtrain.sharding import schedules
from maxtrain.sharding.layout import named_leaves
from maxtrain.models import registry
from maxtrain.program.plan import validate

log = logging.getLogger("maxtrain")
GiB = 2**30
NO_PIPELINE = "no pipeline"  # the row of the same devices as fsdp, the pipeline axis folded into it (`unpipelined`)
# fsdp all-gathers of a layer group's weights per op of a table (module docstring)
COLLECTIVES = {schedules.F: 1, schedules.H: 1, schedules.B: 2, schedules.W: 2, schedules.BW: 2}


def candidates(repeats: int, microbatches: int, stages: int) -> list[str]:
  """The schedules a config can run as it is (1f1b and zb run one layer group per stage)."""
  if repeats == 1:
    return ["gpipe", "1f1b", "zb"]
  return ["gpipe"] + (["interleaved_1f1b"] if microbatches % stages == 0 else [])


def tick_units(schedule: pipeline_lib.Schedule, recompute: float) -> float:
  """The step's layer work in the lockstep cost model (module docstring), in forwards of one microbatch's
  layer group on one stage; `recompute` is the model's own remat recompute as a share of the forward."""
  u = 1.0 + recompute
  iterations = schedule.iterations
  if schedule.kind == "gpipe":
    return iterations * (1.0 + (1.0 + u + (1.0 if schedule.stage_remat else 0.0)))
  cost = {schedules.F: 1.0, schedules.H: 1.0, schedules.B: u + 1.0, schedules.W: u + 1.0, schedules.BW: 1.0 + u + 1.0}
  ops = {int(o) for o in set(schedules.table(schedule)[:, :, 0].ravel())} - {schedules.IDLE}
  per_tick = sum(cost[o] for o in ops) if schedule.branchless else max(cost[o] for o in ops)
  return iterations * per_tick


def collective_units(schedule: pipeline_lib.Schedule) -> int:
  """fsdp collectives of one layer group per accumulation step on the busiest stage: the gathers (COLLECTIVES;
  gpipe: the forward's once, the backward's per iteration) and the gradient's reduction (module docstring)."""
  if schedule.kind == "gpipe":
    return 1 + schedule.iterations + 1
  ops = schedules.table(schedule)[:, :, 0]
  if schedule.branchless:  # every op of the table runs every tick
    return schedule.iterations * sum(COLLECTIVES[int(o)] for o in set(ops.ravel().tolist()) - {schedules.IDLE}) + 1
  per_op = np.vectorize(lambda o: COLLECTIVES.get(int(o), 0))(ops)
  return int(per_op.sum(axis=0).max()) + 1


def collective_seconds(nbytes: float, fsdp_ici: int, fsdp_dcn: int, devices_per_node: int, target: fit.Target) -> float:
  """One all-gather (or reduce-scatter) of `nbytes` (the gathered size on one device) over an fsdp axis of
  `fsdp_ici` devices in a node x `fsdp_dcn` nodes: across nodes, then inside the node (module docstring)."""
  seconds = 0.0
  if fsdp_dcn > 1:
    seconds += nbytes * (fsdp_dcn - 1) / (fsdp_dcn * fsdp_ici) / (target.network_bandwidth / devices_per_node)
  if fsdp_ici > 1:
    seconds += nbytes * (fsdp_ici - 1) / fsdp_ici / target.link_bandwidth
  return seconds


@dataclasses.dataclass(frozen=True)
class Times:
  compute: float  # the layers' work, bubble included
  fsdp: float  # the fsdp collectives of the layers' weights (overlapped with compute)
  boundary: float  # the stage-boundary sends (not overlapped)

  @property
  def step(self) -> float:
    return max(self.compute, self.fsdp) + self.boundary


def step_times(schedule: pipeline_lib.Schedule | None, mesh: Any, *, forward_seconds: float, recompute: float,
               layer_bytes: float, accumulation: int, boundary_bytes: float, target: fit.Target) -> Times:
  """The cost model's times of one step (module docstring). `schedule`: None for no pipeline; `mesh`: the row's
  MeshLayout; `forward_seconds`: one forward of all the step's tokens through all layers, per device (FLOPs /
  peak); `recompute`: the model's own remat recompute as a share of that forward; `layer_bytes`: the weights of
  the layers a device runs, gathered over fsdp (its tensor shard); `accumulation`: gradient accumulation steps;
  `boundary_bytes`: what a device sends to its neighbour stages per step, both directions."""
  (fsdp_ici, fsdp_dcn), per_node = mesh.fsdp_levels, math.prod(mesh.ici)
  if schedule is None:
    collectives = 3 * accumulation * collective_seconds(layer_bytes, fsdp_ici, fsdp_dcn, per_node, target)
    return Times(forward_seconds * (3.0 + recompute), collectives, 0.0)
  groups = schedule.repeats * schedule.microbatches  # a unit: one microbatch through one layer group
  compute = tick_units(schedule, recompute) * forward_seconds / groups
  unit_bytes = layer_bytes / schedule.repeats
  collectives = accumulation * collective_units(schedule) * collective_seconds(unit_bytes, fsdp_ici, fsdp_dcn,
                                                                                per_node, target)
  # Where some stage boundaries cross nodes, the lockstep ticks wait for the slowest.
  bandwidth = target.network_bandwidth / per_node if mesh.pipeline_across_granules else target.link_bandwidth
  return Times(compute, collectives, boundary_bytes / 2 / bandwidth)


def unpipelined(cfg: schema.Config, num_devices: int) -> schema.Config:
  """`cfg` without the pipeline: its stages' devices hold fsdp shards instead (mesh.pipeline folded into mesh.fsdp,
  mesh.dcn_pipeline into mesh.dcn_fsdp: a pipeline across nodes becomes fsdp across them), gradient accumulation
  over microbatches of the pipeline's microbatch rows per device (optimizer.microbatch_size): the activations of
  one microbatch at a time, as a stage holds them."""
  plan = validate(cfg, num_devices, require_data=False)
  changes: dict[str, Any] = {**mesh_lib.fold_pipeline_into_fsdp(cfg.mesh), "pipeline.schedule": "gpipe",
                             "pipeline.microbatches": 1, "pipeline.repeats": 1, "pipeline.stage_remat": False}
  if plan.pipeline is not None:
    changes["optimizer.microbatch_size"] = max(plan.batch.per_microbatch // plan.pipeline.microbatches, 1)
  return schema.with_values(schema.Config.of(cfg), changes)


@dataclasses.dataclass(frozen=True)
class Row:
  schedule: str  # or NO_PIPELINE
  bubble: float
  held: int  # the most microbatches (passes) a stage holds
  device_peak: int
  temporaries: int
  boundary_bytes: int  # per device to the next stage per step, both directions
  step_seconds: float
  fits: bool
  times: Times | None = None
  note: str = ""  # why the row cannot run (no pipeline: its config does not validate)


def choose_schedule(cfg: schema.Config, devices: Sequence[Any],
                    compile_fn: Callable[[schema.Config], tuple[Any, Any]]) -> tuple[str, str, list[Row]]:
  """(the schedule or NO_PIPELINE, the table, its rows) for `cfg` (pipeline.schedule=auto) on `devices`.
  `compile_fn(cfg)` returns (the compiled train step of cfg, its plan). UserError when none fits."""
  headroom, target = cfg.fit.headroom, fit.target_for(cfg, devices)
  limit = target.memory_bytes * (1 - headroom)
  m = registry.model_config(cfg.model)
  seq = cfg.data.seq_len
  layers_forward = (registry.flops_per_token(m, seq) - 6.0 * m.d_model * m.vocab_size) / 3  # per token, all layers
  recompute = fit.recompute_flops_per_token(m, cfg.model.remat if cfg.model.remat != "auto" else "full", seq)
  stack = _stack_leaves(m)
  rows = []
  trials = [(kind, _with_schedule(cfg, kind)) for kind in candidates(cfg.pipeline.repeats, cfg.pipeline.microbatches,
                                                                      _stages(cfg, devices))]
  for kind, trial in trials + [(NO_PIPELINE, unpipelined(cfg, len(devices)))]:
    try:
      compiled, plan = compile_fn(trial)
    except UserError as e:  # the config without its pipeline may not divide the same way: a row that cannot run
      if kind != NO_PIPELINE:
        raise
      rows.append(Row(kind, 0.0, 0, 0, 0, 0, float("inf"), False, note=str(e).splitlines()[0]))
      continue
    mem, schedule = fit.Memory.of(compiled), plan.pipeline
    forward_seconds = plan.batch.tokens / len(devices) * layers_forward / target.flops
    times = step_times(schedule, plan.mesh, forward_seconds=forward_seconds, recompute=recompute / layers_forward,
                       layer_bytes=_layer_bytes(stack, plan, m), accumulation=plan.batch.num_microbatches,
                       boundary_bytes=_boundary_bytes(trial, plan) if schedule else 0, target=target)
    held = int(max(schedules.held(schedules.table(schedule)))) if schedule else 1
    rows.append(Row(kind, schedule.bubble if schedule else 0.0, held, mem.peak, mem.temporaries,
                    _boundary_bytes(trial, plan) if schedule else 0, times.step, mem.peak <= limit, times))
  fitting = [r for r in rows if r.fits]
  chosen = min(fitting, key=lambda r: r.step_seconds) if fitting else None
  unit_name, size = ("GiB", GiB) if max(r.device_peak for r in rows) >= GiB else ("MiB", 2**20)
  lines = [f"pipeline.schedule=auto for {len(devices)} x {target.name} ({target.memory_bytes / GiB:.1f} GiB, "
           f"fit.headroom {headroom:g}: peak <= {limit / GiB:.2f} GiB; network {target.network_bandwidth / 1e9:g} GB/s "
           f"per node, link {target.link_bandwidth / 1e9:g} GB/s per device; cost model: program/schedule_fit.py):",
           f"  {'schedule':<17} {'bubble':>7} {'held':>5} {'device peak':>12} {'temporaries':>12} "
           f"{'boundary/step':>14} {'layers':>10} {'fsdp':>10} {'sends':>10} {'est. step':>10}"]
  ms = lambda seconds: f"{seconds * 1e3:7.3f} ms"
  for r in rows:
    if r.times is None:
      lines.append(f"  {r.schedule:<17} cannot run: {r.note}")
      continue
    mark = "  <- chosen" if r is chosen else ("" if r.fits else "  (does not fit)")
    lines.append(f"  {r.schedule:<17} {r.bubble:7.4f} {r.held:5d} {r.device_peak / size:8.3f} {unit_name} "
                 f"{r.temporaries / size:8.3f} {unit_name} {r.boundary_bytes / 2**20:10.2f} MiB "
                 f"{ms(r.times.compute)} {ms(r.times.fsdp)} {ms(r.times.boundary)} {ms(r.step_seconds)}{mark}")
  table = "\n".join(lines)
  if chosen is None:
    raise UserError(f"pipeline.schedule=auto: no schedule fits the device.\n{table}\nUse more microbatches "
                    "(pipeline.microbatches), model.remat=full, more devices, a shorter data.seq_len or a smaller fit.headroom.")
  return chosen.schedule, table, rows


def resolved(cfg: schema.Config, kind: str, num_devices: int) -> schema.Config:
  """`cfg` (pipeline.schedule=auto) as `choose_schedule`'s choice `kind` runs it on `num_devices`."""
  return unpipelined(cfg, num_devices) if kind == NO_PIPELINE else _with_schedule(cfg, kind)


def _with_schedule(cfg: schema.Config, kind: str) -> schema.Config:
  return schema.with_values(schema.Config.of(cfg), {"pipeline.schedule": kind})


def _stack_leaves(m: Any) -> list[tuple[tuple[int, ...], tuple, int]]:
  """(shape, logical axes, itemsize) of each parameter of the layer stacks (the weights fsdp gathers per layer)."""
  _, params = registry.abstract(m)
  return [(tuple(leaf.shape), logical, np.dtype(leaf.dtype).itemsize) for name, leaf, logical in named_leaves(params)
          if name.split("/", 1)[0] in ("blocks", "moe_blocks")]


def _layer_bytes(stack: list[tuple[tuple[int, ...], tuple, int]], plan: Any, m: Any) -> float:
  """The layer weights one device runs, gathered over fsdp: its block of each stack parameter x the fsdp size."""
  return float(sum(math.prod(plan.layout.local_shape(shape, logical)) * itemsize for shape, logical, itemsize in stack)
               * math.prod(plan.mesh.fsdp_levels))


def _boundary_bytes(cfg: schema.Config, plan: Any) -> int:
  """Bytes one device sends to its neighbour stages per step: each iteration (gpipe: its forward and its backward;
  the others: each tick, both ways) one microbatch's [b/M, T, D] (aot/estimate.boundary_bytes, the same count)."""
  import jax.numpy as jnp

  schedule = plan.pipeline
  rows = plan.batch.per_shard // schedule.microbatches
  seq_local = cfg.data.seq_len // plan.layout.shards("act_length")
  return 2 * schedule.iterations * rows * seq_local * cfg.model.d_model * jnp.dtype(cfg.model.compute_dtype).itemsize


def _stages(cfg: schema.Config, devices: Sequence[Any]) -> int:
  plan = validate(cfg, len(devices), require_data=False)
  return plan.pipeline.stages if plan.pipeline else 1
