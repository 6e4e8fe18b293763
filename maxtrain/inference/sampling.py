"""Text generation: a model loaded from any checkpoint onto the training mesh, a jitted prefill and a
jitted on-device decode loop over the training model's own KV-cache path (`Decoder.decode`), and the
sampling rule (temperature 0 = greedy; else temperature, then top-k, then top-p). Randomness: key = fold_in(seed, token index), so a
seed gives the same text on any mesh.

Shape legend: B batch, T length, V vocab.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxtrain import config as config_lib
from maxtrain.config.loader import DEFAULT_CONFIG, parse_args, set_override
from maxtrain.data.tokenizer import load_tokenizer
from maxtrain.errors import UserError, require
from maxtrain.interop import init_from
from maxtrain.interop.sources import open_source
from maxtrain.program import batch as batch_lib
from maxtrain.program.build import program_for


@dataclasses.dataclass(frozen=True)
class Sampling:
  temperature: float = 0.0  # 0: greedy
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1: off
  seed: int = 0


def sample(logits_BV: jax.Array, key: jax.Array, sampling: Sampling, vocab_limit: int) -> jax.Array:
  """Next tokens [B]; ids >= vocab_limit (vocabulary padding) are never chosen."""
  logits_BV = jnp.where(jnp.arange(logits_BV.shape[-1]) < vocab_limit, logits_BV, -jnp.inf)
  if sampling.temperature == 0:
    return jnp.argmax(logits_BV, axis=-1)
  logits_BV = logits_BV / sampling.temperature
  if sampling.top_k > 0:
    kth_B1 = jax.lax.top_k(logits_BV, sampling.top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
  if sampling.top_p < 1.0:
    sorted_BV = -jnp.sort(-logits_BV, axis=-1)
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    keep_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV < sampling.top_p  # the smallest set reaching top_p
    threshold_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    logits_BV = jnp.where(logits_BV < threshold_B1, -jnp.inf, logits_BV)
  return jax.random.categorical(key, logits_BV, axis=-1)


def scores(logits_BV: jax.Array, token_B: jax.Array) -> jax.Array:
  """[B, 2]: the token's log-probability and the distribution's entropy, from the raw fp32 logits."""
  logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
  logp_B = jnp.take_along_axis(logp_BV, token_B[:, None].astype(jnp.int32), axis=-1)[:, 0]
  entropy_B = -jnp.sum(jnp.exp(logp_BV) * logp_BV, axis=-1)
  return jnp.stack([logp_B, entropy_B], axis=-1)


class Generator:
  """Batched generation with one model on one mesh (params already placed by the model's rules): the training
  model's own cache path (`Decoder.init_cache` / `Decoder.decode`), jitted twice: the prefill (and the first
  token), then every later token in one on-device loop. The host reads the tokens once, at the end."""

  def __init__(self, model: Any, mesh: Any, *, batch_multiple: int = 1):
    # The model's layout is its own (`model.parallel`: the builder's rules, program/state.py).
    self.graphdef, self.params = nnx.split(model)
    self.cfg, self.mesh, self.batch_multiple = model.cfg, mesh, batch_multiple

    def init_cache(params, batch, length):
      return nnx.merge(self.graphdef, params).init_cache(batch, length)

    def forward(params, tokens_BT, valid_BT, cache):
      return nnx.merge(self.graphdef, params).decode(tokens_BT, valid_BT, cache)

    def prefill(params, tokens_BT, valid_BT, key, length, sampling, vocab_limit):
      logits_BTV, cache = forward(params, tokens_BT, valid_BT, init_cache(params, tokens_BT.shape[0], length))
      token_B = sample(logits_BTV[:, -1], jax.random.fold_in(key, 0), sampling, vocab_limit)
      return token_B, scores(logits_BTV[:, -1], token_B), cache

    def decode_loop(params, token_B, score_B2, cache, key, num_tokens, sampling, vocab_limit):
      """Tokens 1..num_tokens-1 after token 0, each from the one before: [B, num_tokens] with token 0,
      and each token's `scores` [B, num_tokens, 2]."""
      def step(i, carry):
        token_B, cache, out_BN, score_BN2 = carry
        logits_BTV, cache = forward(params, token_B[:, None], jnp.ones_like(token_B, jnp.bool_)[:, None], cache)
        token_B = sample(logits_BTV[:, 0], jax.random.fold_in(key, i), sampling, vocab_limit).astype(out_BN.dtype)
        return token_B, cache, out_BN.at[:, i].set(token_B), score_BN2.at[:, i].set(scores(logits_BTV[:, 0], token_B))

      out_BN = jnp.zeros((token_B.shape[0], num_tokens), jnp.int32).at[:, 0].set(token_B)
      score_BN2 = jnp.zeros((token_B.shape[0], num_tokens, 2), jnp.float32).at[:, 0].set(score_B2)
      return jax.lax.fori_loop(1, num_tokens, step, (token_B.astype(jnp.int32), cache, out_BN, score_BN2))[2:]

    self.init_cache = jax.jit(init_cache, static_argnums=(1, 2))
    self.forward = jax.jit(forward, donate_argnums=3)  # one call over the cache (tests teacher-force with it)
    self._prefill = jax.jit(prefill, static_argnums=(4, 5, 6))
    self._decode = jax.jit(decode_loop, static_argnums=(5, 6, 7), donate_argnums=3)

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling,
               eos_ids: Sequence[int] = (), vocab_limit: int | None = None,
               length_multiple: int = 1) -> tuple[list[list[int]], dict]:
    """New tokens per prompt (up to and without the first EOS) and timings. Every row decodes
    max_new_tokens on the device; what follows a row's first EOS is cut on the host. The prompts are
    left-padded to a multiple of `length_multiple` (fewer shapes to compile across calls)."""
    tokens_BN, _, timing = self.generate_scored(prompts, max_new_tokens, sampling, vocab_limit, length_multiple)
    eos = set(eos_ids)
    out = []
    for row in tokens_BN.tolist():
      end = next((i for i, t in enumerate(row) if t in eos), len(row))
      out.append(row[:end])
    steps = sum(len(o) for o in out)
    return out, {**timing, "tokens": steps, "tokens_per_s": steps / max(timing["decode_s"], 1e-9)}

  def generate_scored(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling,
                      vocab_limit: int | None = None, length_multiple: int = 1) -> tuple[np.ndarray, np.ndarray, dict]:
    """All max_new_tokens tokens of every prompt [N, max_new_tokens] (nothing cut at EOS), with each
    token's (log-probability, entropy) under the model's own distribution (the raw logits: temperature 1,
    every id) [N, max_new_tokens, 2], and timings. RL compares these log-probs with the trainer's."""
    vocab_limit = vocab_limit or self.cfg.vocab_size
    rows = len(prompts) + (-len(prompts) % self.batch_multiple)  # the batch must divide its shards
    longest = max(len(p) for p in prompts)
    longest += -longest % length_multiple
    tokens_BT, valid_BT = np.zeros((rows, longest), np.int32), np.zeros((rows, longest), bool)
    for i, p in enumerate(list(prompts) + [prompts[0]] * (rows - len(prompts))):
      tokens_BT[i, longest - len(p):], valid_BT[i, longest - len(p):] = p, True
    key = jax.random.key(sampling.seed)
    sampling = dataclasses.replace(sampling, seed=0)  # the seed is in `key`: another seed compiles nothing new
    with jax.set_mesh(self.mesh):
      t0 = time.monotonic()
      token_B, score_B2, cache = self._prefill(self.params, tokens_BT, valid_BT, key, longest + max_new_tokens,
                                               sampling, vocab_limit)
      token_B.block_until_ready()
      t1 = time.monotonic()
      tokens_BN, score_BN2 = self._decode(self.params, token_B, score_B2, cache, key, max_new_tokens, sampling,
                                          vocab_limit)
      # whole on every process (the trainer's mesh may span processes: each then holds only its rows)
      tokens_BN, score_BN2 = batch_lib.to_host(tokens_BN), batch_lib.to_host(score_BN2)
      t2 = time.monotonic()
    n = len(prompts)
    return tokens_BN[:n], score_BN2[:n], {"prefill_s": t1 - t0, "decode_s": t2 - t1}


def load(path: str, *, seed: int = 0, overrides: Sequence[str] = ()) -> tuple[Generator, Any, Any]:
  """(generator, tokenizer, source) for the model at `path`, on the mesh its run trained on: the mesh
  section of the checkpoint's saved config where there is one (a training checkpoint), else the
  training defaults (FSDP over every device), then `overrides` (`--config.KEY=VALUE`), validated as
  training validates them. The parameters are placed by the program the trainer builds
  (`program/build.py`), so they are sharded as in training."""
  source = open_source(path)
  cfg = config_lib.base_config()
  for key, value in source.model.items():
    if key in cfg.model:
      cfg.model[key] = value
  saved = getattr(source, "config", None) or {}  # only a training checkpoint saves its run's config
  for key, value in saved.get("mesh", {}).items():
    if key in cfg.mesh:
      cfg.mesh[key] = value
  cfg.data.seq_len = min(cfg.data.seq_len, cfg.model.max_seq_len)
  # Generation pads its prompts to the batch shards itself; a training batch that divides any mesh of
  # these devices keeps the batch checks from failing on a size nothing here uses.
  cfg.data.batch_size, cfg.seed = jax.device_count(), seed
  file, keys = parse_args(overrides)
  if str(file) != str(DEFAULT_CONFIG):
    raise UserError(f"--config={file}: generation takes the model from the checkpoint; give --config.KEY=VALUE "
                    "overrides only (e.g. --config.mesh.tensor=2)")
  for key, value in keys:
    set_override(cfg, key, value)
  program = program_for(cfg, jax.devices(), require_data=False)
  params = init_from.load_params(path, program.model_cfg, program.abstract_state().params)
  tokenizer = load_tokenizer(source.tokenizer or "byte")  # the one the run trained with (its saved config)
  trained = getattr(source, "tokenizer_identity", None)
  require(trained is None or trained == tokenizer.identity,
          f"{path} was trained on stores tokenized by {trained}, but its data.tokenizer={source.tokenizer!r} is "
          f"now {tokenizer.identity} (the file changed since): restore that tokenizer file")
  return for_program(program, params), tokenizer, source


def for_program(program: Any, params: Any) -> Generator:
  """The one way to build a generator from a program: its model (graph) with `params`, on its mesh and
  model's sharding rules, prompts padded to its batch shards. Callers that reuse it set `.params` per call."""
  model = nnx.merge(program.state.graphdef, params)
  return Generator(model, program.mesh, batch_multiple=program.plan.layout.shards("act_batch"))
