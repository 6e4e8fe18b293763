"""Greedy speculative decoding with the model's own multi-token-prediction depth 1 as the draft (`--draft mtp`).

Each step the MTP module (models/mtp.py) drafts the token after next from the main model's last hidden state and
the token the main model just chose; one main-model call over [that token, the draft] verifies it. The main model's
argmax at the first position is the next token whatever the draft said, so the text is exactly greedy decoding's
(tests/test_mtp.py); when it equals the draft, the second position's argmax comes free: 2 tokens for one call.

State between steps (all on the device, one `lax.while_loop`): the main cache holds slots 0..m-1 and x_m is chosen
(not yet in it); the MTP cache holds positions 0..m-1 (position i: main hidden state h_i and token x_{i+1}); the
draft d guesses x_{m+1}. A rejected draft is rolled back by moving the caches' write position back (a slot past it
is overwritten before any query sees it: the mask is causal over slots). Every row of the batch decodes the same
prompt (copies fill the batch shards), so the rows accept alike and one cache position serves them all.

Shape legend: B batch (copies of one prompt), T length, S cache slots, D model, V vocab, N new tokens.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxtrain.errors import UserError
from maxtrain.inference.sampling import Generator, Sampling, sample

GREEDY = Sampling()


def check(cfg: Any, sampling: Sampling) -> None:
  """UserError (exit 2) when the model or the sampling rule cannot take the MTP draft; before anything compiles."""
  if not cfg.mtp_layers:
    raise UserError("--draft=mtp: the checkpoint has no multi-token-prediction module (model.mtp_layers=0); train "
                    "with --config.model.mtp_layers=1 or decode without --draft")
  if sampling.temperature != 0:
    raise UserError(f"--draft=mtp with --temperature={sampling.temperature}: speculative decoding here is greedy "
                    "only; use --temperature=0")
  moe = cfg.moe
  if moe.num_experts and moe.dispatch == "capacity" and moe.capacity(2) < 2:
    raise UserError(f"--draft=mtp: model.moe.dispatch=capacity keeps {moe.capacity(2)} slot(s) per expert for the "
                    "2-token verify call, so it could drop a token one-token decoding keeps (a different text); use "
                    "--config.model.moe.dispatch=dropless or a larger model.moe.capacity_factor")
  if cfg.sliding_window:
    raise UserError(f"--draft=mtp: model.sliding_window={cfg.sliding_window} keeps a ring cache that a rejected "
                    "draft cannot roll back; decode without --draft")


class SpeculativeGenerator:
  """Greedy decoding of one prompt at a time, drafted by the MTP depth 1 of `generator`'s model."""

  def __init__(self, generator: Generator):
    self.generator, self.cfg = generator, generator.cfg
    graphdef = generator.graphdef

    def model(params):
      return nnx.merge(graphdef, params)

    def prefill(params, tokens_BT, length, vocab_limit):
      """The prompt through both models: the first new token x_P, the first draft, and the loop's state."""
      m = model(params)
      b, p = tokens_BT.shape
      h_BTD, cache = m.decode_features(tokens_BT, jnp.ones_like(tokens_BT, jnp.bool_), m.init_cache(b, length))
      x_B = sample(m._logits(h_BTD[:, -1:])[:, 0], None, GREEDY, vocab_limit).astype(jnp.int32)
      next_BT = jnp.concatenate([tokens_BT[:, 1:], x_B[:, None]], axis=1)
      logits_BTV, mtp_cache = m.mtp_decode(h_BTD, next_BT, m.init_mtp_cache(b, length))
      draft_B = sample(logits_BTV[:, -1], None, GREEDY, vocab_limit).astype(jnp.int32)
      h_BSD = jnp.zeros((b, length, h_BTD.shape[-1]), h_BTD.dtype).at[:, :p].set(h_BTD)
      tokens_BS = jnp.zeros((b, length), jnp.int32).at[:, :p].set(tokens_BT).at[:, p].set(x_B)
      return x_B, draft_B, cache, mtp_cache, h_BSD, tokens_BS

    def decode_loop(params, x_B, draft_B, cache, mtp_cache, h_BSD, tokens_BS, num_tokens, vocab_limit):
      """Tokens 0..num_tokens-1 [B, num_tokens] (token 0: x_B) and (verify calls, accepted drafts)."""
      def step(carry):
        x_B, draft_B, cache, mtp_cache, h_BSD, tokens_BS, out_BN, n, calls, accepted = carry
        m_ = cache.length  # x_m = x_B goes to slot m, the draft to m + 1
        mdl = model(params)
        pair_BT = jnp.stack([x_B, draft_B], axis=1)
        h_BTD, cache = mdl.decode_features(pair_BT, jnp.ones_like(pair_BT, jnp.bool_), cache)
        logits_BTV = mdl._logits(h_BTD)
        a_B = sample(logits_BTV[:, 0], None, GREEDY, vocab_limit).astype(jnp.int32)  # x_{m+1}, the greedy token
        b_B = sample(logits_BTV[:, 1], None, GREEDY, vocab_limit).astype(jnp.int32)  # x_{m+2} if the draft held
        ok = (a_B[0] == draft_B[0]).astype(jnp.int32)  # every row is the same prompt
        h_BSD = jax.lax.dynamic_update_slice_in_dim(h_BSD, h_BTD, m_, axis=1)
        tokens_BS = jax.lax.dynamic_update_slice_in_dim(tokens_BS, jnp.stack([x_B, a_B, b_B], axis=1), m_, axis=1)
        cache = dataclasses.replace(cache, length=m_ + 1 + ok)  # a rejected draft's slot: written over next
        # The MTP cache catches up to the new main length: positions s, s + 1 (s = m - 1 on a rejection, which
        # writes position m - 1 again with the same values), each (h_i, x_{i+1}).
        s = m_ - 1 + ok
        mtp_cache = dataclasses.replace(mtp_cache, length=s)
        mtp_logits_BTV, mtp_cache = mdl.mtp_decode(jax.lax.dynamic_slice_in_dim(h_BSD, s, 2, axis=1),
                                                   jax.lax.dynamic_slice_in_dim(tokens_BS, s + 1, 2, axis=1),
                                                   mtp_cache)
        draft_B = sample(mtp_logits_BTV[:, 1], None, GREEDY, vocab_limit).astype(jnp.int32)
        out_BN = jax.lax.dynamic_update_slice_in_dim(out_BN, jnp.stack([a_B, b_B], axis=1), n, axis=1)
        x_B = jnp.where(ok > 0, b_B, a_B)
        return x_B, draft_B, cache, mtp_cache, h_BSD, tokens_BS, out_BN, n + 1 + ok, calls + 1, accepted + ok

      out_BN = jnp.zeros((x_B.shape[0], num_tokens + 2), jnp.int32).at[:, 0].set(x_B)
      zero = jnp.zeros((), jnp.int32)
      carry = (x_B, draft_B, cache, mtp_cache, h_BSD, tokens_BS, out_BN, zero + 1, zero, zero)
      carry = jax.lax.while_loop(lambda c: c[7] < num_tokens, step, carry)
      return carry[6][:, :num_tokens], carry[8], carry[9]

    self._prefill = jax.jit(prefill, static_argnums=(2, 3))
    self._decode = jax.jit(decode_loop, static_argnums=(7, 8))

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling = GREEDY,
               eos_ids: Sequence[int] = (), vocab_limit: int | None = None) -> tuple[list[list[int]], dict]:
    """`Generator.generate`'s result (greedy), each prompt decoded on its own, and in the stats the draft's
    `acceptance_rate` (accepted drafts / verify calls, in [0, 1]) and the verify calls made."""
    g = self.generator
    check(g.cfg, sampling)
    vocab_limit = vocab_limit or g.cfg.vocab_size
    eos, out, calls, accepted = set(eos_ids), [], 0, 0
    prefill_s = decode_s = 0.0
    # The verify call writes up to slot P + N, the token buffer one further; one length for every prompt: the
    # decode loop compiles once (the prefill once per prompt length).
    length = max(len(p) for p in prompts) + max_new_tokens + 2
    with jax.set_mesh(g.mesh):
      for prompt in prompts:
        tokens_BT = np.tile(np.asarray(prompt, np.int32)[None], (g.batch_multiple, 1))
        t0 = time.monotonic()
        state = self._prefill(g.params, tokens_BT, length, vocab_limit)
        jax.block_until_ready(state)
        t1 = time.monotonic()
        tokens_BN, n_calls, n_accepted = self._decode(g.params, *state, max_new_tokens, vocab_limit)
        row = np.asarray(tokens_BN)[0].tolist()
        t2 = time.monotonic()
        prefill_s, decode_s = prefill_s + t1 - t0, decode_s + t2 - t1
        calls, accepted = calls + int(n_calls), accepted + int(n_accepted)
        end = next((i for i, t in enumerate(row) if t in eos), len(row))
        out.append(row[:end])
    steps = sum(len(o) for o in out)
    return out, {"prefill_s": prefill_s, "decode_s": decode_s, "tokens": steps,
                 "tokens_per_s": steps / max(decode_s, 1e-9), "verify_calls": calls,
                 "acceptance_rate": accepted / max(calls, 1)}
