"""What `model.remat=auto` chooses for a preset, from compiles at two reduced depths extrapolated to the
preset's depth (a full-depth compile of every candidate takes ~12 minutes per preset on a 2-core machine):

  python tools/remat_presets.py --config=configs/llama3_8b.py --config.hardware=h200x8 --devices 8 --layers 2,4
  python tools/remat_presets.py ... --layers 2,4 --full   # also compile at full depth, to check the extrapolation

For each candidate (none, dots, offload, full; offload only where the target has host memory) it compiles the
train step at depths L1 < L2 with `program/fit.py`'s measurement (the same figures `model.remat=auto` logs),
then extrapolates each figure linearly in the depth to the preset's L: v(L) = v(L1) + (v(L2) - v(L1)) x
(L - L1) / (L2 - L1). Per device the layers' weights, optimizer state, saved activations and recompute
FLOPs grow by one layer's worth per layer and the rest (embedding, head, the loss phase, one layer's
working set) does not, so the line is exact for the state and FLOPs and close for the peak (docs/fitting.md
gives the check against full-depth compiles). The choice is then made as `auto` makes it: the fastest by
the cost model whose peak fits the target's memory less `fit.headroom`. Prints the table and one
markdown row for docs/fitting.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

GiB = 2**30


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--devices", type=int, default=8, help="fake CPU devices of the target mesh")
  parser.add_argument("--layers", default="2,4", help="the two reduced depths L1,L2")
  parser.add_argument("--full", action="store_true", help="also compile every candidate at the preset's depth")
  args, rest = parser.parse_known_args()
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices} " + os.environ.get("XLA_FLAGS", "")
  os.environ["JAX_PLATFORMS"] = "cpu"

  import jax

  from maxtrain import config as config_lib
  from maxtrain.aot.compile import standin_wanted
  from maxtrain.program import build, fit

  devices = jax.devices()[:args.devices]
  cfg = config_lib.load(rest)
  target = fit.target_for(cfg, devices)
  standin = standin_wanted(cfg)  # as maxtrain.compile: the memory stand-in for a GPU/Trainium target (fit.py)
  if standin:
    print("memory stand-in: " + "; ".join(fit.standin_changes(build.registry.model_config(cfg.model))), file=sys.stderr)
  depth = cfg.model.num_layers
  depths = [int(x) for x in args.layers.split(",")] + ([depth] if args.full else [])
  # Measure with an unbounded device, so that every candidate's figures come back; choose below for the real one.
  unbounded = dataclasses.replace(target, memory_bytes=2**62)
  fit.TARGETS[cfg.hardware] = unbounded
  measured = {}
  for layers in depths:
    trial = config_lib.load(rest + [f"--config.model.num_layers={layers}", "--config.model.remat=auto"])
    start = time.perf_counter()

    def compile_fn(c):
      program = build.program_for(c, devices, require_data=False, memory_standin=standin)
      with jax.set_mesh(program.mesh):
        return program.lower().compile(), program.plan

    _, _, candidates = fit.choose_remat(trial, devices, compile_fn, standin)
    measured[layers] = {c.remat: c for c in candidates}
    print(f"{layers} layers: {len(candidates)} candidates in {time.perf_counter() - start:.0f} s", file=sys.stderr)
  l1, l2 = depths[0], depths[1]

  def line(field: str, remat: str) -> float:
    a, b = getattr(measured[l1][remat], field), getattr(measured[l2][remat], field)
    return a + (b - a) * (depth - l1) / (l2 - l1)

  limit = target.memory_bytes * (1 - cfg.fit.headroom)
  rows = {}
  for remat in measured[l1]:
    peak, host, moved, flops = (line(f, remat) for f in ("device_peak", "host", "moved", "flops"))
    seconds = flops / target.flops + (moved / target.host_bandwidth if moved else 0.0)
    rows[remat] = (peak, host, moved, seconds, peak <= limit)
  fitting = [r for r, v in rows.items() if v[4]]
  chosen = min(fitting, key=lambda r: rows[r][3]) if fitting else None
  print(f"{cfg.hardware}: {len(devices)} x {target.name}, peak <= {limit / GiB:.1f} GiB; {depth} layers from "
        f"{l1} and {l2}:")
  for remat, (peak, host, moved, seconds, fits) in rows.items():
    full = measured.get(depth, {}).get(remat) if args.full else None
    check = f"  full-depth compile {full.device_peak / GiB:8.1f} GiB ({peak / full.device_peak - 1:+.1%})" if full else ""
    print(f"  {remat:<8} peak {peak / GiB:8.1f} GiB  host {host / GiB:6.1f} GiB  moved {moved / GiB:6.1f} GiB  "
          f"est. step {seconds:7.2f} s{'' if fits else '  (does not fit)'}{'  <- chosen' if remat == chosen else ''}{check}")
  cells = [f"{rows[r][0] / GiB:.1f}" + (f" (+{rows[r][1] / GiB:.1f} host)" if rows[r][1] >= 0.05 * GiB else "")
           + ("" if rows[r][4] else " ✗") if r in rows else "-" for r in fit.CANDIDATES]
  preset = next((a.split("=", 1)[1] for a in rest if a.startswith("--config=")), "default")
  print(f"| `{os.path.basename(preset)}` | {cfg.hardware} x {len(devices)} | "
        + " | ".join(cells) + f" | {chosen or 'none fits'} |")


if __name__ == "__main__":
  main()
