"""The device mesh: named axes `data`, `fsdp`, `tensor`, all `AxisType.Auto` (GSPMD propagation)."""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from maxtrain.errors import UserError

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def resolve_mesh_shape(sizes: dict[str, int], num_devices: int) -> tuple[int, ...]:
  """Fills at most one -1 axis with the remaining devices; checks the product."""
  shape = [int(sizes[a]) for a in AXES]
  described = " x ".join(f"{a}({s})" for a, s in zip(AXES, shape))
  for a, s in zip(AXES, shape):
    if s == 0 or s < -1:
      raise UserError(f"mesh.{a}={s}: each mesh axis must be a positive size or -1 (fill the rest)")
  if shape.count(-1) > 1:
    raise UserError(f"mesh: at most one axis may be -1, got {described}")
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    if num_devices % known:
      raise UserError(
          f"mesh: {described} cannot fill {num_devices} devices: {num_devices} is not divisible by "
          f"{known}. Set the mesh.* sizes so their product is {num_devices}."
      )
    shape[shape.index(-1)] = num_devices // known
  if math.prod(shape) != num_devices:
    raise UserError(
        f"mesh: {described} = {math.prod(shape)} devices, but {num_devices} are available. "
        f"Set mesh.data/fsdp/tensor so the product is {num_devices} (one of them may be -1)."
    )
  return tuple(shape)


def make_mesh(sizes: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(sizes, len(devices))
  if devices == list(jax.devices()):
    # Lets jax pick a topology-aware device order (ICI rings on GPU/TPU).
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES))
  return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))
