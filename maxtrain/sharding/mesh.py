"""The device mesh: named axes `pipeline` (stages of a circular pipeline, `sharding/pipeline.py`), `data`, `fsdp`, `expert`, `context`, `tensor` (AXES), all `AxisType.Auto`
(GSPMD propagation). `expert` splits the routed experts of MoE layers (tokens reach them by all-to-all,
`sharding/expert_dispatch.py`) and is a data-parallel axis for everything else; `context` splits the
sequence (context parallelism, `sharding/context_attention.py`);
`tensor` is the innermost, fastest-varying axis, so a tensor group is consecutive devices (trn2's
tensor groups must be consecutive cores; on GPUs, one NVLink island).

A mesh has two levels. `mesh.data/fsdp/expert/context/tensor` lay out the devices of one granule (a node, or a
slice: devices joined by the fast interconnect, ICI/NVLink/NeuronLink); `mesh.dcn_pipeline/dcn_data/dcn_fsdp/
dcn_expert` lay out the granules (across the slower data-centre network). Each mesh axis is the product of its
two levels, with the granule index varying slowest, so tensor parallelism never leaves a node and
only pipeline, data, FSDP and (with `dcn_expert`) the MoE all-to-all collectives cross the network.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from maxtrain.errors import UserError

# `pipeline` is the outermost, slowest-varying axis: a stage is a block of consecutive devices (whole nodes
# when the pipeline crosses them), so only the activations at stage boundaries leave it.
AXES = ("pipeline", "data", "fsdp", "expert", "context", "tensor")
# Across granules; tensor and context parallelism stay inside one (context attention all-gathers keys and
# values in every layer, which wants the fast interconnect). `dcn_expert` spreads the experts of a model too
# large for one node's memory over nodes: its all-to-alls cross the network (DeepSeek-V3 does so over
# InfiniBand); its granule-major order keeps the ici part of `expert` within a node.
DCN_AXES = ("dcn_pipeline", "dcn_data", "dcn_fsdp", "dcn_expert")
OPTIONAL = ("pipeline", "expert", "context") + DCN_AXES  # left out of descriptions when 1


@dataclasses.dataclass(frozen=True)
class MeshLayout:
  ici: tuple[int, ...]  # size of each of AXES within a granule
  dcn: tuple[int, ...]  # size of each of AXES across granules (1 for an axis without a dcn_ key)

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(i * d for i, d in zip(self.ici, self.dcn))

  @property
  def sizes(self) -> dict[str, int]:
    """Mesh axis name -> size (both levels)."""
    return dict(zip(AXES, self.shape))

  @property
  def granules(self) -> int:
    return math.prod(self.dcn)

  @property
  def fsdp_levels(self) -> tuple[int, int]:
    """(fsdp devices inside a granule, granules along fsdp): the two levels an fsdp collective crosses."""
    i = AXES.index("fsdp")
    return self.ici[i], self.dcn[i]

  @property
  def pipeline_across_granules(self) -> bool:
    """Some stage boundaries cross the network (mesh.dcn_pipeline > 1)."""
    return self.dcn[AXES.index("pipeline")] > 1

  def describe(self) -> str:
    text = " x ".join(f"{a}={s}" for a, s in zip(AXES, self.shape) if a not in OPTIONAL or s != 1)
    if self.granules > 1:
      text += (f" (per granule {' x '.join(map(str, self.ici))}, across {self.granules} granules "
               f"{' x '.join(map(str, self.dcn))})")
    return text


def resolve_layout(sizes: Mapping[str, int], num_devices: int) -> MeshLayout:
  """Fills at most one -1 axis (of all ten) with the remaining devices and checks the product.
  `sizes` holds `data`, `fsdp`, `tensor` and optionally `pipeline`, `expert`, `context`, `dcn_pipeline`, `dcn_data`,
  `dcn_fsdp`, `dcn_expert` (default 1)."""
  names = AXES + DCN_AXES
  values = [int(sizes.get(a, 1)) for a in names]
  described = " x ".join(f"{a}({s})" for a, s in zip(names, values) if a not in OPTIONAL or s != 1)
  for a, s in zip(names, values):
    if s == 0 or s < -1:
      raise UserError(f"mesh.{a}={s}: each mesh axis must be a positive size or -1 (fill the rest)")
  if values.count(-1) > 1:
    raise UserError(f"mesh: at most one of mesh.{', mesh.'.join(names)} may be -1, got {described}")
  if -1 in values:
    known = math.prod(s for s in values if s != -1)
    if num_devices % known:
      raise UserError(
          f"mesh: {described} cannot fill {num_devices} devices: {num_devices} is not divisible by "
          f"{known}. Set the mesh.* sizes so their product is {num_devices}."
      )
    values[values.index(-1)] = num_devices // known
  if math.prod(values) != num_devices:
    raise UserError(
        f"mesh: {described} = {math.prod(values)} devices, but {num_devices} are available. "
        f"Set mesh.pipeline/data/fsdp/expert/context/tensor (x mesh.dcn_pipeline/dcn_data/dcn_fsdp/dcn_expert) so the product is {num_devices} (one may be -1)."
    )
  given = dict(zip(names, values))
  return MeshLayout(ici=tuple(given[a] for a in AXES), dcn=tuple(given.get(f"dcn_{a}", 1) for a in AXES))


def granule_devices(devices: Sequence[jax.Device], per_granule: int) -> list[list[jax.Device]]:
  """Consecutive processes' devices form a granule: one process per node (8 GPUs each) or one per
  device (launchers number ranks node by node) both give whole nodes. A process's devices must not
  be split unevenly between granules."""
  ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
  local = sum(1 for d in ordered if d.process_index == ordered[0].process_index)
  if jax.process_count() > 1 and per_granule % local and local % per_granule:
    raise UserError(f"mesh: a granule of {per_granule} devices (mesh.pipeline x data x fsdp x expert x context x tensor) neither holds whole "
                    f"processes nor divides a process's {local} devices; choose per-node mesh sizes that match "
                    "the devices per node")
  return [ordered[i:i + per_granule] for i in range(0, len(ordered), per_granule)]


def from_config(mesh_cfg: Mapping[str, int], num_devices: int) -> MeshLayout:
  """The layout of the config's `mesh.*` sizes on `num_devices` devices."""
  return resolve_layout({a: mesh_cfg[a] for a in AXES + DCN_AXES if a in mesh_cfg}, num_devices)


def fully_sharded(mesh_cfg: Any) -> dict[str, int]:
  """The `config.mesh` sizes (dotted keys) of one FSDP axis over every device (the RL rollout side's own mesh)."""
  return {**{f"mesh.{axis}": 1 for axis in AXES + DCN_AXES if axis in mesh_cfg}, "mesh.fsdp": -1}


def fold_pipeline_into_fsdp(mesh_cfg: Any) -> dict[str, int]:
  """The `config.mesh` sizes (dotted keys) of the same devices without a pipeline: mesh.pipeline folded into
  mesh.fsdp and mesh.dcn_pipeline into mesh.dcn_fsdp (a pipeline across nodes becomes fsdp across them)."""
  sizes = {}
  for stages, fsdp in (("pipeline", "fsdp"), ("dcn_pipeline", "dcn_fsdp")):
    if mesh_cfg[fsdp] != -1:  # -1 fills the remaining devices: it takes the stages' share by itself
      sizes[f"mesh.{fsdp}"] = mesh_cfg[fsdp] * mesh_cfg[stages]
    sizes[f"mesh.{stages}"] = 1
  return sizes


def make_mesh(layout: MeshLayout | Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  if not isinstance(layout, MeshLayout):
    layout = resolve_layout(layout, len(devices))
  axis_types = (AxisType.Auto,) * len(AXES)
  if layout.granules == 1:
    if devices == list(jax.devices()):
      # Lets jax pick a topology-aware device order (ICI rings on GPU/TPU).
      return jax.make_mesh(layout.shape, AXES, axis_types=axis_types)
    return Mesh(np.asarray(devices).reshape(layout.shape), AXES, axis_types=axis_types)
  per_granule = [mesh_utils.create_device_mesh(layout.ici, g, allow_split_physical_axes=True)
                 for g in granule_devices(devices, math.prod(layout.ici))]
  # (dcn axes..., ici axes...) -> interleave so each axis is (dcn, ici), dcn slowest.
  n = len(AXES)
  grid = np.stack(per_granule).reshape(layout.dcn + layout.ici)
  grid = grid.transpose([i for a in range(n) for i in (a, n + a)])
  return Mesh(grid.reshape(layout.shape), AXES, axis_types=axis_types)
