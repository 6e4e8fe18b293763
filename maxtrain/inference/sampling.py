"""Text generation: a model loaded from any checkpoint onto the training mesh, a jitted prefill and a
jitted decode step over the KV cache (`models/decode.py`), and the sampling rule (temperature 0 =
greedy; else temperature, then top-k, then top-p). Randomness: key = fold_in(seed, token index), so a
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
import optax
from flax import nnx

from maxtrain.models import decode


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


class Generator:
  """Batched generation with one model on one mesh (params already placed by the rules)."""

  def __init__(self, model: Any, mesh: Any, rules: Any, *, batch_multiple: int = 1):
    from maxtrain.sharding import rules as sharding_rules

    self.graphdef, self.params = nnx.split(model)
    self.cfg, self.mesh, self.batch_multiple = model.cfg, mesh, batch_multiple

    def prefill(params, tokens_BT, valid_BT, length):
      with sharding_rules.activate(rules):
        m = nnx.merge(self.graphdef, params)
        cache = decode.init_cache(m, tokens_BT.shape[0], length)
        logits_BTV, cache = decode.forward(m, tokens_BT, valid_BT, cache, jnp.int32(0))
      return logits_BTV[:, -1], cache

    def step(params, cache, token_B, start):
      with sharding_rules.activate(rules):
        logits_BTV, cache = decode.forward(nnx.merge(self.graphdef, params), token_B[:, None],
                                           jnp.ones_like(token_B, jnp.bool_)[:, None], cache, start)
      return logits_BTV[:, 0], cache

    self._prefill = jax.jit(prefill, static_argnums=3)
    self._step = jax.jit(step, donate_argnums=1)
    self._sample = jax.jit(sample, static_argnums=(2, 3))

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling,
               eos_ids: Sequence[int] = (), vocab_limit: int | None = None) -> tuple[list[list[int]], dict]:
    """New tokens per prompt (up to and without the first EOS) and timings."""
    vocab_limit = vocab_limit or self.cfg.vocab_size
    rows = len(prompts) + (-len(prompts) % self.batch_multiple)  # the batch must divide its shards
    longest = max(len(p) for p in prompts)
    tokens_BT, valid_BT = np.zeros((rows, longest), np.int32), np.zeros((rows, longest), bool)
    for i, p in enumerate(list(prompts) + [prompts[0]] * (rows - len(prompts))):
      tokens_BT[i, longest - len(p):], valid_BT[i, longest - len(p):] = p, True
    key = jax.random.key(sampling.seed)
    out, done = [[] for _ in prompts], np.zeros(len(prompts), bool)
    with jax.set_mesh(self.mesh):
      t0 = time.monotonic()
      logits_BV, cache = self._prefill(self.params, tokens_BT, valid_BT, longest + max_new_tokens)
      token_B = self._sample(logits_BV, jax.random.fold_in(key, 0), sampling, vocab_limit)
      token_B.block_until_ready()
      t1 = time.monotonic()
      for i in range(max_new_tokens):
        host = np.asarray(token_B)[:len(prompts)]
        for b in np.flatnonzero(~done):
          done[b] = int(host[b]) in eos_ids
          if not done[b]:
            out[b].append(int(host[b]))
        if done.all() or i == max_new_tokens - 1:
          break
        logits_BV, cache = self._step(self.params, cache, token_B, jnp.int32(longest + i))
        token_B = self._sample(logits_BV, jax.random.fold_in(key, i + 1), sampling, vocab_limit)
      t2 = time.monotonic()
    steps = sum(len(o) for o in out)
    return out, {"prefill_s": t1 - t0, "decode_s": t2 - t1, "tokens": steps,
                 "tokens_per_s": steps / max(t2 - t1, 1e-9)}


def load(path: str, *, seed: int = 0, overrides: Sequence[str] = ()) -> tuple[Generator, Any, Any]:
  """(generator, tokenizer, source) for the model at `path`, on the mesh its run trained on: the mesh
  section of the checkpoint's saved config where there is one (a training checkpoint), else the
  training defaults (FSDP over every device), then `overrides` (`--config.KEY=VALUE`), validated as
  training validates them. The parameters are placed by the program the trainer builds
  (`program/build.py`), so they are sharded as in training."""
  from maxtrain import config as config_lib
  from maxtrain.config.loader import DEFAULT_CONFIG, parse_args, set_override
  from maxtrain.data.tokenizer import load_tokenizer
  from maxtrain.errors import UserError, require
  from maxtrain.interop import init_from
  from maxtrain.interop.sources import open_source
  from maxtrain.program.build import program_for

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
  experts = cfg.model.moe.num_experts
  require(not experts, f"{path}: a mixture-of-experts model (model.moe.num_experts={experts}); generation (the "
          "KV-cache decoder, models/decode.py) runs dense models only")
  program = program_for(cfg, jax.devices(), require_data=False)
  spec, rules = program.state, program.plan.layout.rules
  params = init_from.load_params(path, program.model_cfg, program.abstract_state().params)
  model = nnx.merge(spec.graphdef, params)
  tokenizer = load_tokenizer(source.tokenizer or "byte")  # the one the run trained with (its saved config)
  trained = getattr(source, "tokenizer_identity", None)
  require(trained is None or trained == tokenizer.identity,
          f"{path} was trained on stores tokenized by {trained}, but its data.tokenizer={source.tokenizer!r} is "
          f"now {tokenizer.identity} (the file changed since): restore that tokenizer file")
  generator = Generator(model, program.mesh, rules, batch_multiple=program.plan.layout.shards("act_batch"))
  return generator, tokenizer, source
