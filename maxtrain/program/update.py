"""The one guarded update, shared by every step that changes the parameters (pretraining and SFT in
`program/step.py`, the RL algorithms in `posttrain/rl_step.py`): given a loss and its gradients,

  (a drill's perturbation) -> gradient norm -> in-graph guards (non-finite, spike) -> optimizer update (held
  in place when skipped) -> candidate parameters (plus a MoE router-bias change) -> a non-finite
  update is rejected too -> the new state and the step's metrics.

Only the loss and gradients differ between steppers; everything that keeps a run correct (skips,
spike window, the step counter, the learning-rate metrics) is written once, here.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from maxtrain.optim import optimizer as optim
from maxtrain.optim.masking import keep_if
from maxtrain.program import guards
from maxtrain.program.state import TrainState
from maxtrain.sharding.rules import NONE, Parallel


Perturb = Callable[[jax.Array, Any], tuple[jax.Array, Any]]  # (loss, grads) -> (loss, grads)


def guarded_update(state: TrainState, loss: jax.Array, grads: Any, optimizer: optim.Optimizer, *,
                   spike_zscore: float, spike_warmup: int,
                   parallel: Parallel = NONE, spike_signal: str = "loss",
                   adjust_candidate: Callable[[Any], Any] | None = None,
                   perturb: Perturb | None = None) -> tuple[TrainState, jax.Array, dict]:
  """(new state, the loss the guards saw, metrics: grad_norm, param_norm, the guards' flags,
  the learning rates, the update norms). `spike_signal`: the value the spike check watches, "loss"
  or "grad_norm" (RL: its surrogate loss is ~0 by construction). `adjust_candidate`: a change made to
  the candidate parameters that a skipped step drops with the update (MoE aux-loss-free balancing).
  `perturb`: a drill's change to the loss and gradients (`program/drills.py`); None in a production step.
  `parallel`: the model's layout (its `parallel`: sharding/rules.py), by which Muon's Newton-Schulz lays out
  whole layers per device (maxtrain/optim/muon.py); none: GSPMD partitions it by the parameters' layout."""
  if perturb is not None:  # trace time: only a drilled step has it
    loss, grads = perturb(loss, grads)
  grad_norm = optax.tree.norm(grads)  # before clipping
  guard, skip, guard_metrics = guards.check(state.guard, loss, grad_norm, zscore=spike_zscore, warmup=spike_warmup,
                                            signal=grad_norm if spike_signal == "grad_norm" else None)
  # A skipped step keeps the optimizer state inside the optimizer (maxtrain.optim.guarded: the moments
  # are updated in place) and the parameters here.
  updates, opt_state = optimizer.tx.update(grads, state.opt_state, state.params, skip=skip, parallel=parallel)
  candidate = optax.apply_updates(state.params, updates)
  if adjust_candidate is not None:  # part of the candidate, so a skipped step keeps it too
    candidate = adjust_candidate(candidate)
  update_norms = optim.update_norms(updates, optimizer.labels(state.params))
  old_norm, new_norm = optax.tree.norm(state.params), optax.tree.norm(candidate)
  # Finite loss and gradients can still give a non-finite update (an overflowing learning rate) or
  # parameters: skip those too. The norms are reductions the step reports anyway (one more over the
  # candidate, which XLA fuses into the update). The optimizer's moments were already advanced with
  # this step's finite gradient; holding the old ones to put back would keep a second copy of them.
  update_finite = jnp.isfinite(new_norm) & jnp.all(jnp.stack([jnp.isfinite(n) for n in update_norms.values()]))
  guard, skip, guard_metrics = guards.reject_update(state.guard, guard, skip, update_finite, guard_metrics)
  params = keep_if(skip, state.params, candidate)
  metrics = {"grad_norm": grad_norm, "param_norm": jnp.where(skip, old_norm, new_norm)}  # after this step
  metrics.update(guard_metrics)
  metrics.update({name: lr(state.step) for name, lr in optimizer.learning_rates.items()})
  metrics.update(update_norms)
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state, guard=guard), loss, metrics
