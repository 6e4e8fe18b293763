"""Muon's costs, measured: `python tools/bench_muon.py collectives|accuracy [--config.key=value ...]`.

collectives  AOT-compiles the config's train step on fake CPU devices (`maxtrain.compile`'s builder)
             and prints the per-device peak and the collectives of the partitioned HLO, by kind:
             count and bytes of their results as written in the HLO text (a loop body, e.g. the
             scanned layers, is counted once, so compare builds of one config, not absolute sizes).
             Options: --devices N (default 8).
accuracy     Trains the config a few dozen steps (--steps, default 40), then for every hidden matrix
             takes the Muon input (the Nesterov momentum, bias-corrected, as the optimizer builds
             it) of each layer and compares Newton-Schulz in bfloat16 with float32: relative
             Frobenius error of the result, and the singular-value spread (min / max over the
             matrix's singular values) of both, per matrix kind.
"""

from __future__ import annotations

import argparse
import collections
import sys

import numpy as np


def collectives(rest: list[str], devices: int, top: int = 12) -> None:
  from maxtrain import config as config_lib
  from maxtrain.aot import collectives as hlo_collectives
  from maxtrain.aot.compile import GiB, compile_train_step

  report = compile_train_step(config_lib.load(rest), devices)
  print(report.describe())
  print("collectives in the compiled step (per device, loop bodies once):")
  text = report.compiled.as_text()
  for kind, (count, size) in hlo_collectives.totals(text).items():
    print(f"  {kind:18s} {count:5d} ops {size / GiB:10.3f} GiB")
  by_shape = collections.Counter()
  for kind, shape, size in hlo_collectives.ops(text):
    by_shape[(kind, shape, size)] += 1
  print("largest (kind, result, count):")
  for (kind, shape, size), count in sorted(by_shape.items(), key=lambda kv: -kv[0][2] * kv[1])[:top]:
    print(f"  {kind:18s} {shape[:60]:60s} x{count:<3d} {size * count / GiB:8.3f} GiB")


def accuracy(rest: list[str], steps: int) -> None:
  import jax
  import numpy as np

  from maxtrain import config as config_lib
  from maxtrain.loop.data import Data
  from maxtrain.optim import optimizer as optim
  from maxtrain.optim import muon as muon_lib
  from maxtrain.optim.muon import nesterov_input, newton_schulz
  from maxtrain.program import build as program_lib, state as state_lib, step as step_lib
  from maxtrain.sharding.layout import param_name

  cfg = config_lib.load(rest)
  o = cfg.optimizer
  if o.name != "muon":
    sys.exit("bench_muon.py accuracy: needs optimizer.name=muon (--config=configs/muon.py)")
  program = program_lib.program_for(cfg, jax.devices())
  state = state_lib.initialize(program.state, program.mesh)
  data = Data(cfg, program.batch_shardings)
  with jax.set_mesh(program.mesh):
    for _ in range(steps):
      state, metrics = program.train_step(state, data.next_batch()[0])
    batch = data.next_batch()[0]
    _, grads = jax.jit(lambda p, b: step_lib.loss_and_grads(program.state.graphdef, p, b))(state.params, batch)
  print(f"after {steps} steps: train loss {float(metrics['loss']):.3f}")
  muon_state = state.opt_state[-1].inner_states["muon"].inner_state[0]
  coeffs, beta = optim.parse_ns_coeffs(o.muon_ns_coeffs), o.muon_momentum
  mu = {param_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(muon_state.mu)}
  g = {param_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(grads) if param_name(p) in mu}
  # Muon's input at the next step: the momentum updated with a fresh gradient, Nesterov, bias-corrected.
  inputs = nesterov_input({k: beta * mu[k] + (1 - beta) * g[k] for k in mu}, g, beta, muon_state.count + 1)
  print(f"Newton-Schulz bfloat16 vs float32 on Muon's input at step {steps + 1} ({cfg.model.num_layers} layers; "
        f"{o.muon_ns_steps} iterations, coefficients {o.muon_ns_coeffs}); per matrix kind, mean (max) over layers:")
  print("| matrix | fan_in x fan_out | rel. Frobenius error bf16 vs fp32 | fp32 vs exact U V^T | "
        "singular values fp32: min-max | bf16: min-max |")
  print("| --- | --- | --- | --- | --- | --- |")
  axes = muon_lib.logical_names(program.state.abstract.params)
  for name in sorted(inputs):
    dims = optim.matrix_dimension_numbers(axes[name])
    ortho = {dt: np.asarray(jax.jit(lambda x, dt=dt: newton_schulz(x, dims, coeffs, o.muon_ns_steps, dt))(inputs[name]),
                            np.float64) for dt in ("float32", "bfloat16")}
    fan_in = _fan_in(inputs[name].shape, dims)
    errors, polar_errors, spreads = [], [], {"float32": [], "bfloat16": []}
    for layer in range(inputs[name].shape[0]):  # stacked layers (model.scan_layers)
      exact, low = (_as_matrix(ortho[dt][layer], inputs[name].shape[1:], dims) for dt in ("float32", "bfloat16"))
      errors.append(np.linalg.norm(low - exact) / np.linalg.norm(exact))
      u, _, vt = np.linalg.svd(_as_matrix(np.asarray(inputs[name][layer], np.float64), inputs[name].shape[1:], dims),
                               full_matrices=False)
      polar_errors.append(np.linalg.norm(exact - u @ vt) / np.linalg.norm(u @ vt))  # what NS approximates
      for dt, m in (("float32", exact), ("bfloat16", low)):
        sv = np.linalg.svd(m, compute_uv=False)
        spreads[dt].append((sv.min(), sv.max()))
    fan_out = int(np.prod(inputs[name].shape[1:])) // fan_in
    sv = {dt: f"{min(a for a, _ in v):.3f}-{max(b for _, b in v):.3f}" for dt, v in spreads.items()}
    print(f"| {'/'.join(name.split('/')[-2:])} | {fan_in} x {fan_out} | {np.mean(errors):.4f} ({np.max(errors):.4f}) | "
          f"{np.mean(polar_errors):.3f} ({np.max(polar_errors):.3f}) | {sv['float32']} | {sv['bfloat16']} |")


def _fan_in(stacked_shape, dims) -> int:
  """fan_in of one layer's matrix of a stacked weight (dims count from the end)."""
  axes = (dims.reduction_axis,) if isinstance(dims.reduction_axis, int) else dims.reduction_axis
  return int(np.prod([stacked_shape[a] for a in axes]))


def _as_matrix(layer, layer_shape, dims):
  """One layer's slice as [fan_in, fan_out] (reduction dims come first in every HIDDEN_MATRICES entry)."""
  fan_in = _fan_in((1, *layer_shape), dims)
  return layer.reshape(fan_in, -1)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("what", choices=("collectives", "accuracy"))
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--steps", type=int, default=40)
  args, rest = parser.parse_known_args()
  if args.what == "collectives":
    collectives(rest, args.devices)
  else:
    accuracy(rest, args.steps)


if __name__ == "__main__":
  main()
