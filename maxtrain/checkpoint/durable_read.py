"""Reading a durable step (storage.py's tier): verified once per process against its manifest, or, for a step
without one, by restoring it onto the run's devices (that restore is kept for the restore that follows: read
once); restored onto the current mesh (resharding if it was saved on another); refused, naming what differs, when it
holds another model's parameters, another optimizer's state or another spike-guard window."""

from __future__ import annotations

import gc
import json
import re
import sys
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from maxtrain import config as config_lib
from maxtrain.checkpoint import manifest
from maxtrain.checkpoint.tiers import Restored, saved_step
from maxtrain.errors import UserError
from maxtrain.runtime.kv import KeyValue
from maxtrain.sharding.layout import param_name, with_shardings


def param_shapes(state) -> dict[str, list[int]]:
  return {param_name(path): list(leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)}


def opt_state_paths(state) -> list[str]:
  """The optimizer state's structure, leaf by leaf: another optimizer (or optimizer layout) differs here."""
  return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(state.opt_state)]


def processes() -> ocp.options.MultiprocessingOptions:
  """The processes that save and restore together: every process, or an RL trainer's when its rollout side
  is processes of their own that never touch a checkpoint (runtime/kv.py KeyValue.group)."""
  return ocp.options.MultiprocessingOptions(active_processes=set(range(KeyValue.group)) if KeyValue.group else None)


def _checkpointer() -> ocp.Checkpointer:
  return ocp.Checkpointer(ocp.CompositeCheckpointHandler(), multiprocessing_options=processes())


def read_meta(path: Path) -> dict:
  checkpointer = _checkpointer()
  return checkpointer.restore(path, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta


def _optimizer_mismatch(path: Path, meta: dict) -> UserError:
  saved = config_lib.saved_config(meta, f"checkpoint {path}")["optimizer"]
  return UserError(f"checkpoint {path} holds the state of another optimizer (saved with optimizer.name="
                   f"{saved['name']}, state_dtype={saved['state_dtype']}): its optimizer state does "
                   "not fit this run's. Resume with the optimizer config it was saved with "
                   f"(--config.optimizer.name={saved['name']}), or start a new run in another output_dir.")


def check_compatible(path: Path, meta: dict, abstract_state: Any) -> None:
  """UserError naming what differs. The parameters first: a model of another shape (MoE vs dense) also
  has another optimizer state, and the model is the cause."""
  saved_cfg = config_lib.saved_config(meta, f"checkpoint {path}")
  saved, current = meta.get("param_shapes", {}), param_shapes(abstract_state)
  diffs = [f"{k}: checkpoint {saved.get(k)} vs model {current.get(k)}"
           for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
  if diffs:
    raise UserError(f"checkpoint {path} does not fit this model ({len(diffs)} parameters differ; "
                    f"{'; '.join(diffs[:4])}). Restore it with the model config it was saved with "
                    f"(its config.model: {json.dumps(saved_cfg['model'])}).")
  saved_opt = meta.get("opt_state_paths")
  if saved_opt is not None and saved_opt != opt_state_paths(abstract_state):
    raise _optimizer_mismatch(path, meta)
  window = saved_cfg["guards"]["spike_window"]
  mine = int(abstract_state.guard.losses.shape[0])
  if int(window) != mine:  # the guard's loss window is part of the saved state
    raise UserError(f"guards.spike_window={mine} but checkpoint {path} was saved with guards.spike_window={window} "
                    f"(the spike guard's loss window is saved with the state): resume with "
                    f"--config.guards.spike_window={window}, or start a new run in another output_dir.")


def restore_unchecked(path: Path, abstract_state: Any, shardings: Any) -> Restored:
  checkpointer = _checkpointer()
  meta = read_meta(path)
  check_compatible(path, meta, abstract_state)
  target = with_shardings(abstract_state, shardings)
  try:
    restored = checkpointer.restore(path, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
  except ValueError as e:  # a checkpoint from before opt_state_paths were saved, another optimizer
    if "tree structure" not in str(e).lower() and "do not match" not in str(e).lower():
      raise
    raise _optimizer_mismatch(path, meta) from None
  return Restored(step=saved_step(meta, path, restored.state), state=restored.state, data_state=restored.data, meta=meta, path=str(path))


class DurableReader:
  """`verify`: checkpoint.verify. `target`: (abstract state, shardings) of the run (None for a reader without a
  run, e.g. a tool's): a step without a manifest is checked by restoring it onto them, and that restore is kept
  for `restore` (read once)."""

  def __init__(self, verify: bool, target: tuple[Any, Any] | None = None):
    self.enabled = verify
    self.target = target
    self._verified: set[Path] = set()
    self._prefetched: dict[Path, Restored] = {}

  def verify(self, path: Path) -> None:
    """Checks a step against its manifest once per process (`checkpoint.verify`): every read of a checkpoint
    (resume, rollback, the tools through interop/sources.py) goes through `manifest.check`."""
    if not self.enabled or Path(path) in self._verified:
      return
    if not manifest.check(path).verified and self.target is not None:
      self._read_unverified(Path(path))
    self._verified.add(Path(path))

  def mark_verified(self, path: Path) -> None:
    """A step checked by other means (tools/bench_checkpoint.py times the check apart from the read)."""
    self._verified.add(Path(path))

  def _read_unverified(self, path: Path) -> None:
    """A step without a manifest (saved before manifests, or its process died before writing one) has nothing
    to be checked against: it is restored now, onto this run's devices, and kept for `restore`. A step that does
    not restore is corrupt like one that fails its manifest: resume=auto moves it aside and tries an older one,
    an explicit resume of it is exit 2 naming it."""
    # Orbax's other reads of a failed restore end unawaited (each an "Exception ignored" traceback on stderr):
    # the error is reported once, below.
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
      self._prefetched[path] = restore_unchecked(path, *self.target)
    except UserError:
      raise
    except Exception as e:  # noqa: BLE001 - whatever the damage (a missing, truncated or changed file), it is corrupt
      chain, cause = [], e  # Orbax wraps TensorStore's error, which names the array that did not read
      while cause is not None and len(chain) < 8:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
      e = next((c for c in chain if re.search(r'Error reading "([^"]+)"', str(c))), e)
      text = str(e).strip()
      culprit = re.search(r'Error reading "([^"]+)"', text)
      name = f"state/{culprit.group(1)}" if culprit else "state"
      raise manifest.CorruptCheckpoint(path, name, "no manifest, and it does not restore: "
                                       f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}") from None
    finally:
      gc.collect()
      sys.unraisablehook = hook

  def forget_prefetched(self) -> None:
    """Another step is restored instead (the local tier's): its device memory is released."""
    self._prefetched.clear()

  def restore(self, path: Path, abstract_state: Any, shardings: Any) -> Restored:
    """Verifies (once), then restores onto the current mesh (resharding if it was saved on another)."""
    self.verify(path)
    prefetched = self._prefetched.pop(Path(path), None)
    return prefetched if prefetched is not None else restore_unchecked(path, abstract_state, shardings)
