"""The one attention mask: which keys a query sees, and the one value masked scores take.

Shape legend: B batch (1 broadcasts over it), T queries, S keys.

Every kernel (the dot reference, flash, blocked, the vendor kernels' masks and biases) and the KV-cache
decode path ask `visible`; none spells its own comparison or fill value. A key is visible from a query
iff all the given tests pass:
  documents  equal segment ids (packed training sequences; a prompt's padding is segment 0);
  causality  the key's position is not after the query's (kv_position <= q_position);
  cache      the key's slot holds a token (`kv_valid`: left padding and unwritten slots do not);
  window     the key is one of the `window` latest positions up to the query's (q_position - kv_position <
             window, Hugging Face's sliding window; 0: no window).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Finite, not -inf or finfo.min: a fully masked row (a block of flash's online softmax, a padded query)
# gives exp(0) = 1 terms, never inf - inf = NaN, and m - MASK_VALUE cannot overflow.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def visible(*, q_segment_ids_BT: jax.Array | None = None, kv_segment_ids_BS: jax.Array | None = None,
            q_positions_BT: jax.Array | None = None, kv_positions_BS: jax.Array | None = None,
            kv_valid_BS: jax.Array | None = None, window: int = 0) -> jax.Array:
  """[B, T, S] boolean (B may be 1): the conjunction of the tests whose arguments are given (segments
  and positions come in pairs)."""
  if (q_segment_ids_BT is None) != (kv_segment_ids_BS is None) or (q_positions_BT is None) != (kv_positions_BS is None):
    raise ValueError("give query and key segment ids together, and query and key positions together")
  tests = []
  if q_segment_ids_BT is not None:
    tests.append(q_segment_ids_BT[:, :, None] == kv_segment_ids_BS[:, None, :])
  if q_positions_BT is not None:
    tests.append(kv_positions_BS[:, None, :] <= q_positions_BT[:, :, None])
    if window:
      tests.append(in_window(q_positions_BT, kv_positions_BS, window))
  if kv_valid_BS is not None:
    tests.append(kv_valid_BS[:, None, :])
  if not tests:
    raise ValueError("visible() needs segment ids, positions or key validity")
  out = tests[0]
  for test in tests[1:]:
    out = out & test
  return out


def in_window(q_positions_BT: jax.Array, kv_positions_BS: jax.Array, window: int) -> jax.Array:
  """[B, T, S]: the key is less than `window` positions before the query (keys after it pass: causality
  is its own test). Compared as kv > q - window: no int32 overflow at the kernels' padding positions
  (int32 max), where kv - q or q - kv could overflow."""
  return kv_positions_BS[:, None, :] > q_positions_BT[:, :, None] - window


def causal_self(segment_ids_BT: jax.Array, window: int = 0) -> jax.Array:
  """[B, T, T]: self-attention over one packed sequence, positions its indices 0..T-1 (`window`: 0 off)."""
  positions_1T = jnp.arange(segment_ids_BT.shape[1], dtype=jnp.int32)[None]
  return visible(q_segment_ids_BT=segment_ids_BT, kv_segment_ids_BS=segment_ids_BT,
                 q_positions_BT=positions_1T, kv_positions_BS=positions_1T, window=window)


def apply(scores: jax.Array, visible_mask: jax.Array) -> jax.Array:
  """Scores where visible, MASK_VALUE elsewhere (the mask broadcasts against the scores)."""
  return jnp.where(visible_mask, scores, MASK_VALUE)
