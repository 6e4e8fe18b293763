"""`optimizer.offload=host`: the optimizer state lives in host memory between steps.

The state's shardings carry the `pinned_host` memory kind (`program/state.py`), so the jitted step takes
the moments from host memory and returns them there; `streamed` wraps the optimizer so that the moments
are moved to the device only for the update (`jax.device_put` to `jax.memory.Space.Device` just before
it, and back to `Space.Host` just after), where XLA's host-offload passes schedule the copies. Left alone,
XLA moves every moment in at once (an H200 held all of them on the device for the update), so the update is
streamed in groups of parameters (`optimizer.offload_groups`): each group's copies in wait, by a data
dependency, for the group before's copies out, and the device holds one group's moments at a time. The
device holds weights, gradients and activations; the moments (2 of the 3 fp32 words per parameter with Adam)
cost host memory and a host <-> device copy each way per step.

XLA:CPU has the `pinned_host` memory space (host and device are the same RAM there): the step compiles
with the moments in memory space S(5) at its entry and exit and runs bitwise as without offload, but its
`memory_analysis` counts those buffers with the device's, and its lowering of `device_put` inside a jit
is the identity. `aot/compile.py` therefore reads the host bytes from the compiled entry layout.

Checkpoints hold values, not placements: a state saved with offload on restores with it off and back.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax

from maxtrain.errors import UserError, choice

OFFLOADS = ("none", "host")
HOST_MEMORY = "pinned_host"
DEFAULT_GROUPS = 16  # optimizer.offload_groups


def validate(o: Any) -> None:
  choice("optimizer.offload", o.offload, OFFLOADS)


def enabled(opt_cfg: Any) -> bool:
  return opt_cfg.offload == "host"


def check_devices(opt_cfg: Any, devices: Sequence[Any], platform: str = "") -> None:
  """UserError, before anything compiles, for optimizer.offload=host where the devices cannot offload."""
  if enabled(opt_cfg):
    check_host_memory("optimizer.offload=host", devices, platform)


def check_host_memory(setting: str, devices: Sequence[Any], platform: str = "") -> None:
  """UserError naming `setting` where the devices have no host memory kind to offload to. Neuron is refused
  whatever it reports: its SDK documents no host memory kind, and no device check has shown a step with
  `pinned_host` buffers compile there."""
  if not devices:
    return
  device = devices[0]
  if platform == "neuron" or device.platform == "neuron":
    raise UserError(f"config.{setting} is not supported on Neuron (the Neuron SDK documents no host memory kind "
                    "for JAX arrays): offload nothing there; shard over more cores (mesh.fsdp), keep the optimizer "
                    "state in bfloat16 (optimizer.state_dtype=bfloat16) or use model.remat=full")
  kinds = {m.kind for m in device.addressable_memories()}
  if HOST_MEMORY not in kinds:
    raise UserError(f"config.{setting}: the {device.platform} devices have no {HOST_MEMORY} memory "
                    f"(they have {', '.join(sorted(kinds))}): offload nothing there")


def host_shardings(shardings: Any) -> Any:
  """The same shardings in host memory."""
  return jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), shardings)


def streamed(tx: optax.GradientTransformation,
             max_groups: int = DEFAULT_GROUPS) -> optax.GradientTransformationExtraArgs:
  """`tx` whose state arrives in host memory and leaves in it, streamed through the device in at most
  `max_groups` groups of parameters (`stream_groups`): each group's moments are moved in, updated and moved
  out before the next group's are moved in, so the device holds one group's moments at a time, not all of
  them (XLA's host-offload passes otherwise hoist every copy to the device to the start of the update).

  The order is forced by data: group g's host moments pass through an `optimization_barrier` together with
  group g-1's new host moments, so their copy to the device cannot start before g-1's copy back to the host
  is done. `tx.update` runs once per group on the whole tree, with zeros in place of the other groups' state;
  each call keeps only its group's outputs and XLA removes the rest (dead code). That is exact because every
  state leaf of an optax transform here is updated from its own leaf (and the gradients: the global-norm
  clip reads only those). The values are untouched (copies): on XLA:CPU the state is bitwise the same, and
  AdamW's updates too (Muon's can round apart: each group is its own fusion, tests/test_offload.py).
  `max_groups=1`: everything in at once."""
  def update(updates, state, params=None, **extra_args):
    leaves, treedef = jax.tree.flatten(state)
    owner = jax.tree.leaves(state_owners(state, updates))  # parameter index per state leaf, -1: none
    groups = stream_groups([math.prod(x.shape) for x in jax.tree.leaves(updates)], max_groups)
    param_group = [g for g, members in enumerate(groups) for _ in members]
    # The state of no parameter (step counters: scalars) is on the device throughout; every call reads it.
    shared = {i: jax.device_put(x, jax.memory.Space.Device) for i, x in enumerate(leaves) if owner[i] < 0}
    new_leaves: list[Any] = [None] * len(leaves)
    new_updates: list[Any] = [None] * len(param_group)
    update_def = jax.tree.structure(updates)
    previous: list[int] = []  # the state leaves of the group before, now back in host memory
    for g in range(len(groups)):
      mine = [i for i, o in enumerate(owner) if o >= 0 and param_group[o] == g]
      host = [leaves[i] for i in mine]
      if previous:  # not before the group before is back on the host (and its device copies freed)
        host, back = jax.lax.optimization_barrier((host, [new_leaves[i] for i in previous]))
        for i, x in zip(previous, back):
          new_leaves[i] = x
      on_device = dict(zip(mine, jax.device_put(host, jax.memory.Space.Device)))
      trial = [on_device[i] if i in on_device else shared[i] if i in shared else jnp.zeros(x.shape, x.dtype)
               for i, x in enumerate(leaves)]
      u, s = tx.update(updates, jax.tree.unflatten(treedef, trial), params, **extra_args)
      u_leaves, s_leaves = jax.tree.leaves(u), jax.tree.leaves(s)
      for p, pg in enumerate(param_group):
        if pg == g:
          new_updates[p] = u_leaves[p]
      for i in mine:
        new_leaves[i] = jax.device_put(s_leaves[i], jax.memory.Space.Host)
      if g == 0:
        for i in shared:
          new_leaves[i] = jax.device_put(s_leaves[i], jax.memory.Space.Host)
      previous = mine
    return jax.tree.unflatten(update_def, new_updates), jax.tree.unflatten(treedef, new_leaves)

  return optax.GradientTransformationExtraArgs(tx.init, update)


def state_owners(state: Any, params: Any) -> Any:
  """The tree of `state` with, at each leaf, the index (in `jax.tree.leaves(params)` order) of the parameter
  that leaf belongs to (Adam's mu and nu of it, Muon's momentum), or -1 (step counters). A state leaf belongs
  to the parameter whose key path ends its own (optax keeps a parameter-shaped tree per moment, partitions
  and masks included) and whose shape it has (optax.tree_map_params cannot: it fails on masked partitions)."""
  keystr = jax.tree_util.keystr
  paths = [(keystr(path), getattr(x, "shape", None)) for path, x in jax.tree_util.tree_leaves_with_path(params)]

  def owner(path, leaf) -> int:
    text = keystr(path)
    found = [i for i, (p, shape) in enumerate(paths) if text.endswith(p) and getattr(leaf, "shape", None) == shape]
    return max(found, key=lambda i: len(paths[i][0]), default=-1)

  return jax.tree_util.tree_map_with_path(owner, state)


def stream_groups(sizes: Sequence[int], max_groups: int) -> list[list[int]]:
  """The parameters' indices (leaf order; `sizes`: their element counts) cut into at most `max_groups`
  consecutive groups, each of about max(the largest parameter, total / max_groups) elements or fewer: the
  device peak of the streamed update grows with the largest group, the trace and compile time with their
  number."""
  budget = max(max(sizes, default=0), -(-sum(sizes) // max(max_groups, 1)))
  while True:
    groups: list[list[int]] = []
    total = budget + 1
    for i, n in enumerate(sizes):
      if total + n > budget:
        groups.append([])
        total = 0
      groups[-1].append(i)
      total += n
    if len(groups) <= max(max_groups, 1):
      return groups
    budget += -(-budget // 4)  # greedy cuts can leave up to 2x the groups: widen them until they fit


def sharded_bytes(abstract: Any, shardings: Any, memory_kind: str | None = None) -> int:
  """Bytes one device holds of the arrays `abstract` laid out by `shardings` (those in `memory_kind`
  only, when given): each leaf's shard shape x its itemsize."""
  total = 0
  for leaf, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings), strict=True):
    if memory_kind is None or s.memory_kind == memory_kind:
      shape = s.shard_shape(leaf.shape)
      n = 1
      for dim in shape:
        n *= dim
      total += n * leaf.dtype.itemsize
  return total
