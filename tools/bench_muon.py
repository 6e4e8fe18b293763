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
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "s8": 1, "u8": 1, "pred": 1, "s64": 8}
# `%x = f32[8,512,4096]{...} all-gather(...)`, or a tuple result `(f32[..], f32[..]) all-reduce(...)`.
_COLLECTIVE = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(all-gather|all-to-all|reduce-scatter|all-reduce|"
                         r"collective-permute)(?:-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def collective_bytes(hlo_text: str) -> dict[str, tuple[int, int]]:
  """{kind: (count, bytes of the results)} of the collectives in an HLO module's text."""
  totals: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
  for line in hlo_text.splitlines():
    m = _COLLECTIVE.search(line)
    if not m:
      continue
    size = 0
    for dtype, dims in _SHAPE.findall(m.group(1)):
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      size += n * _DTYPE_BYTES.get(dtype, 4)
    totals[m.group(2)][0] += 1
    totals[m.group(2)][1] += size
  return {k: (c, b) for k, (c, b) in sorted(totals.items())}


def collectives(rest: list[str], devices: int) -> None:
  from maxtrain import config as config_lib
  from maxtrain.aot.compile import GiB, compile_train_step

  report = compile_train_step(config_lib.load(rest), devices)
  print(report.describe())
  print("collectives in the compiled step (per device, loop bodies once):")
  for kind, (count, size) in collective_bytes(report.compiled.as_text()).items():
    print(f"  {kind:18s} {count:5d} ops {size / GiB:10.3f} GiB")


def accuracy(rest: list[str], steps: int) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from maxtrain import batch as batch_lib, config as config_lib, optim, program as program_lib
  from maxtrain import state as state_lib
  from maxtrain.data.loaders import Data
  from maxtrain.muon import newton_schulz, nesterov_input
  from maxtrain.sharding.layout import param_name
  from maxtrain.validate import validate

  cfg = config_lib.load(rest)
  cfg.optimizer.name = "muon"
  program = program_lib.build(cfg, validate(cfg, jax.device_count(), jax.process_count()))
  state = state_lib.initialize(program.state, program.mesh)
  data = Data(cfg, program.batch_shardings)
  with jax.set_mesh(program.mesh):
    for _ in range(steps):
      state, _ = program.train_step(state, data.next_batch(batch_lib.NO_FAULT)[0])
    batch = data.next_batch(batch_lib.NO_FAULT)[0]
    _, grads = jax.jit(lambda s, b: program_lib.step_lib.loss_and_grads(program.state.graphdef, s.params, b))(state, batch)
  muon_state = state.opt_state[-1].inner_states["muon"].inner_state[0]
  o = cfg.optimizer
  coeffs, beta = optim.parse_ns_coeffs(o.muon_ns_coeffs), o.muon_momentum
  ns = {dt: jax.jit(lambda x, dims, dt=dt: newton_schulz(x, dims, coeffs, o.muon_ns_steps, jnp.dtype(dt)),
                    static_argnums=1) for dt in ("float32", "bfloat16")}
  rows = collections.defaultdict(list)
  mu_leaves = {param_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(muon_state.mu)}
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    name = param_name(path)
    if name not in mu_leaves:
      continue
    mu = optax_moment(mu_leaves[name], g, beta)
    x = nesterov_input(mu, g, beta, muon_state.count + 1)
    dims = optim.HIDDEN_MATRICES[optim._matrix_key(name)][1]
    exact, low = (np.asarray(ns[dt](x, dims), np.float64) for dt in ("float32", "bfloat16"))
    for layer in range(exact.shape[0]):
      fan_out = np.prod(exact.shape[1:]) // _fan_in(exact.shape[1:], dims)
      e, b = exact[layer].reshape(-1, fan_out), low[layer].reshape(-1, fan_out)
      s_e, s_b = np.linalg.svd(e, compute_uv=False), np.linalg.svd(b, compute_uv=False)
      rows[optim._matrix_key(name)].append((np.linalg.norm(b - e) / np.linalg.norm(e), s_e.min(), s_e.max(),
                                            s_b.min(), s_b.max()))
  print(f"Newton-Schulz bf16 vs fp32 on the Muon inputs after {steps} steps of {cfg.model.num_layers} layers "
        f"({o.muon_ns_steps} steps, coefficients {o.muon_ns_coeffs}):")
  print("| matrix | shape (fan_in x fan_out) | rel. Frobenius error, mean (max) over layers | "
        "singular values fp32 min-max | bf16 min-max |")
  print("| --- | --- | --- | --- | --- |")
  for key, r in sorted(rows.items()):
    r = np.asarray(r)
    dims = optim.HIDDEN_MATRICES[key][1]
    shape = [x.shape for n, x in mu_leaves.items() if n.endswith(key)][0][1:]
    fan_in = _fan_in(shape, dims)
    print(f"| {key} | {fan_in} x {int(np.prod(shape)) // fan_in} | {r[:, 0].mean():.4f} ({r[:, 0].max():.4f}) | "
          f"{r[:, 1].min():.3f}-{r[:, 2].max():.3f} | {r[:, 3].min():.3f}-{r[:, 4].max():.3f} |")


def optax_moment(mu, g, beta):
  return beta * mu.astype(g.dtype) + (1 - beta) * g


def _fan_in(shape_without_layers, dims) -> int:
  axes = (dims.reduction_axis,) if isinstance(dims.reduction_axis, int) else dims.reduction_axis
  n = 1
  for a in axes:
    n *= shape_without_layers[a]
  return n


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
