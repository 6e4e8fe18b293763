"""`optimizer.offload=host`: the optimizer state lives in host memory between steps.

The state's shardings carry the `pinned_host` memory kind (`program/state.py`), so the jitted step takes
the moments from host memory and returns them there; `streamed` wraps the optimizer so that the moments
are moved to the device only for the update (`jax.device_put` to `jax.memory.Space.Device` just before
it, and back to `Space.Host` just after), where XLA's host-offload passes schedule the copies (and may
overlap them with the rest of the update). The device holds weights, gradients and activations; the
moments (2 of the 3 fp32 words per parameter with Adam) cost host memory and a host <-> device copy each
way per step.

XLA:CPU has the `pinned_host` memory space (host and device are the same RAM there): the step compiles
with the moments in memory space S(5) at its entry and exit and runs bitwise as without offload, but its
`memory_analysis` counts those buffers with the device's, and its lowering of `device_put` inside a jit
is the identity. `aot/compile.py` therefore reads the host bytes from the compiled entry layout.

Checkpoints hold values, not placements: a state saved with offload on restores with it off and back.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import optax

from maxtrain.errors import UserError, choice

OFFLOADS = ("none", "host")
HOST_MEMORY = "pinned_host"


def validate(o: Any) -> None:
  choice("optimizer.offload", o.offload, OFFLOADS)


def enabled(opt_cfg: Any) -> bool:
  return opt_cfg.get("offload", "none") == "host"


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


def streamed(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """`tx` whose state arrives in host memory and leaves in it: moved to the device for the update only.
  The values are untouched (a copy), so the update is bitwise the same."""
  def update(updates, state, params=None, **extra_args):
    state = jax.device_put(state, jax.memory.Space.Device)
    updates, state = tx.update(updates, state, params, **extra_args)
    return updates, jax.device_put(state, jax.memory.Space.Host)

  return optax.GradientTransformationExtraArgs(tx.init, update)


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
