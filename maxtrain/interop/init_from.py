"""Parameters from elsewhere onto a run's mesh: `checkpoint.init_from` (a fresh run: step 0, a new
optimizer state, these parameters) and `python -m maxtrain.generate`.

Each parameter is read on its own and placed straight onto its sharding (an Orbax source restores
only the shards each process holds), so no host holds the model.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import jax.numpy as jnp

from maxtrain.program import guards
from maxtrain.errors import UserError
from maxtrain.interop.sources import open_source
from maxtrain.sharding.layout import param_name
from maxtrain.program.state import TrainState
from maxtrain.sharding.layout import with_shardings

log = logging.getLogger("maxtrain")
# config.model keys that change the model's math without changing any parameter's shape.
MATH_KEYS = ("rope_theta", "rope_scaling", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
             "rope_original_max_len", "norm_eps", "tie_embeddings", "sliding_window", "window_pattern",
             "rope_local_theta")


def check_fits(source: Any, where: str, model_cfg: Any, targets: dict[str, jax.ShapeDtypeStruct]) -> None:
  """UserError (naming the key) when the source's model differs from the run's in shape or math."""
  diffs = [f"{n}: {list(source.info(n)[0]) if n in source.names() else None} vs model "
           f"{list(t.shape)}" for n, t in targets.items() if n not in source.names() or
           tuple(source.info(n)[0]) != tuple(t.shape)]
  diffs += [f"{n}: in the checkpoint, not in the model" for n in source.names() if n not in targets]
  if diffs:
    raise UserError(f"{where} does not fit this model ({len(diffs)} parameters differ; {'; '.join(diffs[:4])}). "
                    f"Use its config.model: {source.model}")
  for key in MATH_KEYS:
    mine, theirs = getattr(model_cfg, key), source.model.get(key, getattr(model_cfg, key))
    if mine != theirs:
      raise UserError(f"config.model.{key}={mine!r} but {where} was trained with {theirs!r}: set "
                      f"--config.model.{key}={theirs} (or use the config.py written beside a converted checkpoint)")


def load_params(path: str, model_cfg: Any, abstract_params: Any) -> Any:
  """The params tree of `abstract_params` (ShapeDtypeStructs with shardings) read from `path`."""
  t0 = time.monotonic()
  source = open_source(path)
  leaves = jax.tree_util.tree_leaves_with_path(abstract_params)
  check_fits(source, f"checkpoint.init_from={path}", model_cfg, {param_name(p): leaf for p, leaf in leaves})
  params = jax.tree_util.tree_map_with_path(lambda p, leaf: source.read_sharded(param_name(p), leaf),
                                            abstract_params)
  log.info("read %d parameters from %s in %.2fs", len(leaves), path, time.monotonic() - t0)
  return params


def initial_state(program: Any, path: str, guard_window: int) -> Any:
  """A TrainState at step 0 with `path`'s parameters and a fresh optimizer state, on the run's mesh."""
  spec = program.state
  params = load_params(path, program.model_cfg, with_shardings(spec.abstract.params, spec.shardings.params))
  tx = program.optimizer.tx

  def build(params):
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      guard=guards.init(guard_window))

  with jax.set_mesh(program.mesh):
    return jax.jit(build, out_shardings=spec.shardings, donate_argnums=0)(params)
