"""Continuous batching: a decode batch of R rows that stays full while prompts remain. A row whose completion
ends (its EOS, or max_new_tokens) takes the next prompt at the next chunk boundary, instead of idling until
the longest row of a static batch ends.

The cache keeps the model's own layout (`Decoder.init_cache`, every row at the same slot count) and moves
rows, not slots: it has L0 + K slots (L0 = the padded prompt width P + max_new_tokens, K tokens decoded per
on-device chunk). Every row's live tokens sit right-aligned at the slots before L0 when a chunk starts: a
refill writes a new prompt's prefill (the fresh path, computed as the static generator's prefill) into slots
L0 - P .. L0 - 1 of its row (the rest of the row cleared and not valid); a chunk writes slots L0 .. L0 + K - 1,
then every row shifts left by K. A row holds at most P + max_new_tokens - 1 live slots, so only slots no
query can see any more are shifted out. RoPE positions count a row's valid slots (`Decoder.decode_features`),
which a shift does not change, so each row computes what it would alone. Window layers keep every slot
(`init_cache(rings=False)`): a ring's slot mod R does not survive a shift.

Randomness: token i of prompt n is drawn with key fold_in(fold_in(seed, n), i), whatever row, chunk or batch
it lands in: sampling is a function of the seed and the prompt list, not of R (the static generator shares
one key per token index across its rows, so the two draw different samples at temperature > 0; greedy is
the same). Shape legend: R decode rows, k rows refilled, P prompt width, S cache slots, K chunk, V vocab.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import weakref
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxtrain.inference import sampling as sampling_lib
from maxtrain.program import batch as batch_lib

CHUNK = 8  # tokens per on-device decode call: the host sees finished rows every CHUNK tokens
_BATCHERS: "weakref.WeakKeyDictionary[Any, dict[int, ContinuousBatcher]]" = weakref.WeakKeyDictionary()


def batcher(generator: sampling_lib.Generator, rows: int) -> "ContinuousBatcher":
  """The continuous batcher of `rows` decode rows (rounded up to the batch shards) over `generator`'s model,
  mesh and current params; built once per generator and row count (its compiled functions are reused)."""
  rows += -rows % generator.batch_multiple
  batchers = _BATCHERS.setdefault(generator, {})
  if rows not in batchers:
    batchers[rows] = ContinuousBatcher(generator, rows)
  return batchers[rows]


def _per_row(logits_RV: jax.Array, keys_R: jax.Array, sampling: Any, vocab_limit: int) -> jax.Array:
  return jax.vmap(lambda l_V, key: sampling_lib.sample(l_V[None], key, sampling, vocab_limit)[0])(logits_RV, keys_R)


def _token_keys(base: jax.Array, prompt_R: jax.Array, index_R: jax.Array) -> jax.Array:
  return jax.vmap(lambda n, i: jax.random.fold_in(jax.random.fold_in(base, n), i))(prompt_R, index_R)


class ContinuousBatcher:
  """The continuous decode loop over a `sampling.Generator`'s model, mesh and parameters (module docstring)."""

  def __init__(self, generator: Any, rows: int, chunk: int = CHUNK):
    scores = sampling_lib.scores

    assert rows % generator.batch_multiple == 0, (rows, generator.batch_multiple)
    self.generator, self.rows, self.chunk = generator, rows, chunk
    graphdef = generator.graphdef

    def model(params):
      return nnx.merge(graphdef, params)

    def empty(params, rows, width, slots):
      """R rows of `slots` slots, `width` of them (L0) written already: the next chunk writes slot L0."""
      cache = model(params).init_cache(rows, slots, rings=False)
      return dataclasses.replace(cache, length=jnp.asarray(width, jnp.int32), fresh=False)

    def refill(params, cache, token_R, prompt_R, count_R, tokens_kP, valid_kP, rows_k, prompts_k, base, sampling,
               vocab_limit):
      """Prompts `prompts_k` prefilled into rows `rows_k` (row index R: a padding row, dropped)."""
      k, p = tokens_kP.shape
      s, width = cache.valid_BS.shape[1], cache.length
      m = model(params)
      logits_kPV, fresh = m.decode(tokens_kP, valid_kP, m.init_cache(k, p, rings=False))
      keys_k = _token_keys(base, prompts_k, jnp.zeros_like(prompts_k))
      first_k = _per_row(logits_kPV[:, -1], keys_k, sampling, vocab_limit).astype(jnp.int32)
      start = s - self.chunk - p  # L0 - P (static: L0 and P are the shapes)

      def place(main, new):  # the whole row: zeros, the prefill at L0 - P .. L0 - 1, zeros
        lead = main.ndim - 4  # a scanned stack's layer dim
        pad = [(0, 0)] * lead + [(0, 0), (start, s - start - p), (0, 0), (0, 0)]
        index = (slice(None),) * lead + (rows_k,)
        return main.at[index].set(jnp.pad(new.astype(main.dtype), pad), mode="drop")

      kv = jax.tree.map(place, cache.kv, fresh.kv)
      valid_kS = jnp.pad(valid_kP, [(0, 0), (start, s - start - p)])
      cache = dataclasses.replace(cache, kv=kv, valid_BS=cache.valid_BS.at[rows_k].set(valid_kS, mode="drop"),
                                  length=width)
      token_R = token_R.at[rows_k].set(first_k, mode="drop")
      prompt_R = prompt_R.at[rows_k].set(prompts_k, mode="drop")
      count_R = count_R.at[rows_k].set(1, mode="drop")
      return cache, token_R, prompt_R, count_R, first_k, scores(logits_kPV[:, -1], first_k)

    def decode_chunk(params, cache, token_R, prompt_R, count_R, base, sampling, vocab_limit):
      """`chunk` tokens of every row [R, K] with their scores [R, K, 2]; then the cache shifts left by K."""
      width = cache.length

      def step(i, carry):
        cache, token_R, out_RK, score_RK2 = carry
        logits_R1V, cache = model(params).decode(token_R[:, None], jnp.ones_like(token_R, jnp.bool_)[:, None],
                                                 cache)
        keys_R = _token_keys(base, prompt_R, count_R + i)
        token_R = _per_row(logits_R1V[:, 0], keys_R, sampling, vocab_limit).astype(jnp.int32)
        return (cache, token_R, out_RK.at[:, i].set(token_R),
                score_RK2.at[:, i].set(scores(logits_R1V[:, 0], token_R)))

      r = token_R.shape[0]
      out_RK, score_RK2 = jnp.zeros((r, self.chunk), jnp.int32), jnp.zeros((r, self.chunk, 2), jnp.float32)
      cache, token_R, out_RK, score_RK2 = jax.lax.fori_loop(0, self.chunk, step, (cache, token_R, out_RK, score_RK2))
      shift = lambda a, axis: jnp.concatenate(  # noqa: E731 - slots K.. move to 0..; the last K are cleared
          [jax.lax.slice_in_dim(a, self.chunk, a.shape[axis], axis=axis),
           jnp.zeros_like(jax.lax.slice_in_dim(a, 0, self.chunk, axis=axis))], axis=axis)
      kv = jax.tree.map(lambda a: shift(a, a.ndim - 3), cache.kv)
      cache = dataclasses.replace(cache, kv=kv, valid_BS=shift(cache.valid_BS, 1), length=width)
      return cache, token_R, count_R + self.chunk, out_RK, score_RK2

    self._empty = jax.jit(empty, static_argnums=(1, 2, 3))
    self._refill = jax.jit(refill, static_argnums=(10, 11), donate_argnums=(1, 2, 3, 4))
    self._decode = jax.jit(decode_chunk, static_argnums=(6, 7), donate_argnums=(1, 2, 4))

  def _bucket(self, k: int) -> int:
    """Refill batch sizes: powers of two (times the batch shards), so a few shapes compile."""
    m = self.generator.batch_multiple
    b = m
    while b < k:
      b *= 2
    return min(b, self.rows)

  def generate_scored(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Any, eos_id: int | None,
                      vocab_limit: int | None = None, length_multiple: int = 1) -> tuple[np.ndarray, np.ndarray, dict]:
    """As `Generator.generate_scored`: [N, max_new_tokens] tokens, [N, max_new_tokens, 2] scores, and
    `seconds` (prefills and decoding interleave), `tokens` (the completions', EOS included) and `row_steps`
    (decode row-steps run, idle rows included); a completion is cut after its first `eos_id` (the rest is
    `eos_id`, scores 0)."""
    g = self.generator
    vocab_limit = vocab_limit or g.cfg.vocab_size
    n, r = len(prompts), self.rows
    width = max(len(p) for p in prompts)
    width += -width % length_multiple
    l0 = width + max_new_tokens
    fill = eos_id if eos_id is not None else 0
    tokens_NM = np.full((n, max_new_tokens), fill, np.int32)
    scores_NM2 = np.zeros((n, max_new_tokens, 2), np.float32)
    made = np.zeros(n, np.int64)  # tokens of prompt n so far
    base = jax.random.key(sampling.seed)
    sampling = dataclasses.replace(sampling, seed=0)  # the seed is in `base`
    pending = collections.deque(range(n))
    row_prompt = [-1] * r  # the prompt each row decodes (-1: free)
    t0 = time.monotonic()
    steps = 0

    def take(p: int, toks: np.ndarray, scs: np.ndarray) -> bool:
      """Appends a row's new tokens to prompt p's completion; True when it ended."""
      for t, sc in zip(toks.tolist(), scs):
        i = made[p]
        tokens_NM[p, i], scores_NM2[p, i] = t, sc
        made[p] += 1
        if made[p] == max_new_tokens or t == eos_id:
          return True
      return False

    with jax.set_mesh(g.mesh):
      cache = self._empty(g.params, r, l0, l0 + self.chunk)
      token_R = jnp.zeros(r, jnp.int32)
      prompt_R, count_R = jnp.zeros(r, jnp.int32), jnp.zeros(r, jnp.int32)
      while True:
        free = [i for i in range(r) if row_prompt[i] < 0]
        if free and pending:
          take_n = min(len(free), len(pending))
          k = self._bucket(take_n)
          rows_k, prompts_k = np.full(k, r, np.int32), np.zeros(k, np.int32)
          tokens_kP, valid_kP = np.zeros((k, width), np.int32), np.zeros((k, width), bool)
          for j in range(k):
            if j < take_n:
              rows_k[j], prompts_k[j] = free[j], pending.popleft()
              row_prompt[free[j]] = int(prompts_k[j])
            p = prompts[prompts_k[j]]  # a padding row prefills prompt 0 (and is dropped)
            tokens_kP[j, width - len(p):], valid_kP[j, width - len(p):] = p, True
          cache, token_R, prompt_R, count_R, first_k, score_k2 = self._refill(
              g.params, cache, token_R, prompt_R, count_R, tokens_kP, valid_kP, rows_k, prompts_k, base, sampling,
              vocab_limit)
          first_k, score_k2 = batch_lib.to_host(first_k), batch_lib.to_host(score_k2)  # whole on every process
          for j in range(take_n):
            if take(int(prompts_k[j]), first_k[j:j + 1], score_k2[j:j + 1]):
              row_prompt[rows_k[j]] = -1
          if any(p < 0 for p in row_prompt) and pending:
            continue  # rows that ended at their first token: refill them before decoding
        if all(p < 0 for p in row_prompt):
          break
        cache, token_R, count_R, out_RK, score_RK2 = self._decode(g.params, cache, token_R, prompt_R, count_R, base,
                                                                  sampling, vocab_limit)
        out_RK, score_RK2 = batch_lib.to_host(out_RK), batch_lib.to_host(score_RK2)  # note: the host syncs once per chunk
        steps += r * self.chunk
        for i in range(r):
          if row_prompt[i] >= 0 and take(row_prompt[i], out_RK[i], score_RK2[i]):
            row_prompt[i] = -1
    seconds = time.monotonic() - t0
    return tokens_NM, scores_NM2, {"seconds": seconds, "tokens": int(made.sum()), "row_steps": steps}
