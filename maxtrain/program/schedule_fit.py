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
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import ml_collections

from maxtrain.errors import UserError
from maxtrain.program import fit
from maxtrain.sharding import pipeline as pipeline_lib
from maxtrain.sharding import schedules
from maxtrain.models import registry
from maxtrain.program.plan import validate

log = logging.getLogger("maxtrain")
GiB = 2**30


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


@dataclasses.dataclass(frozen=True)
class Row:
  schedule: str
  bubble: float
  held: int  # the most microbatches (passes) a stage holds
  device_peak: int
  temporaries: int
  boundary_bytes: int  # per device to the next stage per step, both directions
  step_seconds: float
  fits: bool


def choose_schedule(cfg: ml_collections.ConfigDict, devices: Sequence[Any],
                    compile_fn: Callable[[ml_collections.ConfigDict], tuple[Any, Any]]) -> tuple[str, str, list[Row]]:
  """(the schedule, the table, its rows) for `cfg` (pipeline.schedule=auto) on `devices`. `compile_fn(cfg)` returns
  (the compiled train step of cfg, its plan). UserError when none fits."""
  headroom, target = cfg.fit.headroom, fit.target_for(cfg, devices)
  limit = target.memory_bytes * (1 - headroom)
  m = registry.model_config(cfg.model)
  seq = cfg.data.seq_len
  layers_forward = (registry.flops_per_token(m, seq) - 6.0 * m.d_model * m.vocab_size) / 3  # per token, all layers
  recompute = fit.recompute_flops_per_token(m, cfg.model.remat if cfg.model.remat != "auto" else "full", seq)
  rows = []
  for kind in candidates(cfg.pipeline.repeats, cfg.pipeline.microbatches, _stages(cfg, devices)):
    trial = cfg.copy_and_resolve_references()
    trial.pipeline.schedule = kind
    compiled, plan = compile_fn(trial)
    mem, schedule = fit.Memory.of(compiled), plan.pipeline
    # One stage's forward of one microbatch's layer group, per device: its share of the step's layer FLOPs.
    unit = plan.batch.tokens / len(devices) * layers_forward / (schedule.repeats * schedule.microbatches)
    seconds = tick_units(schedule, recompute / layers_forward) * unit / target.flops
    rows.append(Row(kind, schedule.bubble, int(max(schedules.held(schedules.table(schedule)))), mem.peak,
                    mem.temporaries, _boundary_bytes(trial, plan), seconds, mem.peak <= limit))
  fitting = [r for r in rows if r.fits]
  chosen = min(fitting, key=lambda r: r.step_seconds) if fitting else None
  unit_name, size = ("GiB", GiB) if max(r.device_peak for r in rows) >= GiB else ("MiB", 2**20)
  lines = [f"pipeline.schedule=auto for {len(devices)} x {target.name} ({target.memory_bytes / GiB:.1f} GiB, "
           f"fit.headroom {headroom:g}: peak <= {limit / GiB:.2f} GiB; lockstep tick cost model, "
           "program/schedule_fit.py):",
           f"  {'schedule':<17} {'bubble':>7} {'held':>5} {'device peak':>12} {'temporaries':>12} "
           f"{'boundary/step':>14} {'est. step':>10}"]
  for r in rows:
    mark = "  <- chosen" if r is chosen else ("" if r.fits else "  (does not fit)")
    lines.append(f"  {r.schedule:<17} {r.bubble:7.4f} {r.held:5d} {r.device_peak / size:8.3f} {unit_name} "
                 f"{r.temporaries / size:8.3f} {unit_name} {r.boundary_bytes / 2**20:10.2f} MiB "
                 f"{r.step_seconds * 1e3:7.3f} ms{mark}")
  table = "\n".join(lines)
  if chosen is None:
    raise UserError(f"pipeline.schedule=auto: no schedule fits the device.\n{table}\nUse more microbatches "
                    "(pipeline.microbatches), model.remat=full, more devices, a shorter data.seq_len or a smaller fit.headroom.")
  return chosen.schedule, table, rows


def _boundary_bytes(cfg: ml_collections.ConfigDict, plan: Any) -> int:
  """Bytes one device sends to its neighbour stages per step: each iteration (gpipe: its forward and its backward;
  the others: each tick, both ways) one microbatch's [b/M, T, D] (aot/estimate.boundary_bytes, the same count)."""
  import jax.numpy as jnp

  schedule = plan.pipeline
  rows = plan.batch.per_shard // schedule.microbatches
  seq_local = cfg.data.seq_len // plan.layout.shards("act_length")
  return 2 * schedule.iterations * rows * seq_local * cfg.model.d_model * jnp.dtype(cfg.model.compute_dtype).itemsize


def _stages(cfg: ml_collections.ConfigDict, devices: Sequence[Any]) -> int:
  plan = validate(cfg, len(devices), require_data=False)
  return plan.pipeline.stages if plan.pipeline else 1
