"""In-graph guards: skip updates whose loss, gradients, update or new parameters are non-finite, and
detect loss spikes.

Everything is `jnp.where` masking inside the jitted step (no `lax.cond`, no host callbacks), so it
compiles on every backend. A skipped step leaves parameters and optimizer state bit-for-bit
unchanged; the step counter still advances (its batch was consumed). The host reads the flags one
step late (so dispatch never waits) and decides rollbacks and aborts (`maxtrain.trainer`).

Spike: after `warmup` recorded losses, a finite loss above mean + zscore * std of the last `window`
recorded losses. Spikes and non-finite losses are not recorded, so they cannot mask the next one.
A spike's update is skipped in-graph whatever `guards.spike_action` says, so a checkpoint written
before the host reacts never holds a spiked state.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from maxtrain.errors import choice, require

SPIKE_ACTIONS = ("skip", "rollback", "abort")


def validate(g: Any) -> None:
  """UserError naming the key for bad `config.guards`."""
  choice("guards.spike_action", g.spike_action, SPIKE_ACTIONS)
  for key in ("max_consecutive_bad", "spike_window"):
    require(g[key] >= 1, f"config.guards.{key}={g[key]}: must be >= 1")
  for key in ("spike_warmup", "max_rollbacks"):
    require(g[key] >= 0, f"config.guards.{key}={g[key]}: must be >= 0")
  require(g.spike_zscore > 0, f"config.guards.spike_zscore={g.spike_zscore}: must be > 0")


@struct.dataclass
class GuardState:
  losses: jax.Array  # f32[window] ring buffer of recorded (finite, non-spike) losses
  recorded: jax.Array  # i32: losses recorded so far (the ring's write position is recorded % window)
  consecutive_bad: jax.Array  # i32: non-finite steps in a row
  skipped: jax.Array  # i32: updates skipped so far (non-finite or spike)


def init(window: int) -> GuardState:
  zero = jnp.zeros((), jnp.int32)
  return GuardState(losses=jnp.zeros((window,), jnp.float32), recorded=zero, consecutive_bad=zero, skipped=zero)


def check(guard: GuardState, loss: jax.Array, grad_norm: jax.Array, *, zscore: float, warmup: int,
          signal: jax.Array | None = None) -> tuple[GuardState, jax.Array, dict[str, jax.Array]]:
  """Returns (new guard state, skip this update?, metrics). `signal`: the value watched for spikes in
  place of the loss (RL: the gradient norm, `posttrain/rl_step.py`); a signal of exactly 0 (an update
  that learns nothing) is neither recorded nor a spike, so a run of them cannot shrink the window's
  spread to nothing."""
  window = guard.losses.shape[0]
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  watched = finite if signal is None else finite & (signal > 0)
  loss = loss if signal is None else signal
  n = jnp.minimum(guard.recorded, window)
  valid = jnp.arange(window) < n
  mean = jnp.sum(jnp.where(valid, guard.losses, 0.0)) / jnp.maximum(n, 1)
  var = jnp.sum(jnp.where(valid, jnp.square(guard.losses - mean), 0.0)) / jnp.maximum(n, 1)
  z = (loss - mean) / jnp.maximum(jnp.sqrt(var), 1e-6 * jnp.maximum(jnp.abs(mean), 1.0))
  spike = watched & (guard.recorded >= warmup) & (z > zscore)
  skip = ~finite | spike
  record = watched & ~spike
  losses = jnp.where(record, guard.losses.at[guard.recorded % window].set(loss.astype(jnp.float32)), guard.losses)
  new = GuardState(losses=losses, recorded=guard.recorded + record.astype(jnp.int32),
                   consecutive_bad=jnp.where(finite, 0, guard.consecutive_bad + 1),
                   skipped=guard.skipped + skip.astype(jnp.int32))
  metrics = {"nonfinite": (~finite).astype(jnp.int32), "spike": spike.astype(jnp.int32),
             "loss_zscore": jnp.where(finite, z, 0.0), "consecutive_bad": new.consecutive_bad,
             "skipped_steps": new.skipped}
  return new, skip, metrics


def reject_update(before: GuardState, after: GuardState, skip: jax.Array, update_finite: jax.Array,
                  metrics: dict[str, jax.Array]) -> tuple[GuardState, jax.Array, dict[str, jax.Array]]:
  """The update or the new parameters were not finite although loss and gradients were (an overflowing
  learning rate, a parameter past the dtype's range): that step counts as a non-finite one too (skipped,
  `nonfinite`, `consecutive_bad` + 1, its loss not recorded). Returns (guard state, skip, metrics)."""
  bad = ~skip & ~update_finite
  rejected = GuardState(losses=before.losses, recorded=before.recorded, consecutive_bad=before.consecutive_bad + 1,
                        skipped=before.skipped + 1)
  guard = jax.tree.map(lambda r, a: jnp.where(bad, r, a), rejected, after)
  metrics = {**metrics, "nonfinite": metrics["nonfinite"] | bad.astype(jnp.int32),
             "consecutive_bad": guard.consecutive_bad, "skipped_steps": guard.skipped,
             "nonfinite_update": bad.astype(jnp.int32)}
  return guard, skip | bad, metrics
