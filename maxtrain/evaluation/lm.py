"""lm-evaluation-harness's `LM` interface over a maxtrain model: log-likelihoods from one jitted forward
pass per batch (rows padded to a fixed batch and a length bucket, so a task compiles a few shapes), and
generation with `inference.sampling.Generator` (the training model's KV-cache path).

Prompts are encoded as the model's tokenizer says (`data.tokenizer.prompt_ids`: a Hugging Face
tokenizer's post-processor, nothing for the byte tokenizer), context/continuation split as lm-eval's own
Hugging Face backend splits them (`TemplateLM._encode_pair`), so the two backends score the same tokens.

Shape legend: B batch, T length, V vocab.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval.api.model import TemplateLM

from maxtrain.interop import init_from
from maxtrain.data.tokenizer import ByteTokenizer, prompt_ids
from maxtrain.inference import sampling

LENGTH_BUCKET = 64  # rows are padded to a multiple of this: few shapes, little padding


def make_scorer(generator: sampling.Generator, vocab_limit: int):
  """jit(params, tokens_BT, targets_BT, valid_BT) -> (log p(target) [B, T], target is the argmax [B, T]),
  over the real vocabulary only (padding rows of the embedding never count), in fp32."""
  graphdef = generator.graphdef

  def score(params, tokens_BT, targets_BT, valid_BT):
    model = nnx.merge(graphdef, params)
    positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1], dtype=jnp.int32), tokens_BT.shape)
    logits_BTV = model(tokens_BT, valid_BT.astype(jnp.int32), positions_BT).astype(jnp.float32)
    logits_BTV = jnp.where(jnp.arange(logits_BTV.shape[-1]) < vocab_limit, logits_BTV, -jnp.inf)
    logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    logp_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return logp_BT, jnp.argmax(logits_BTV, axis=-1) == targets_BT

  return jax.jit(score)


class MaxtrainLM(TemplateLM):
  """The lm-eval model: `MaxtrainLM(generator, tokenizer, vocab_limit, batch_size)`; `after_batch` is called
  after each scored batch (the watch sidecar's fault seam)."""

  def __init__(self, generator: sampling.Generator, tokenizer: Any, vocab_limit: int, batch_size: int = 8,
               after_batch: Callable[[], None] | None = None):
    super().__init__()
    self.generator, self.tok, self.vocab_limit = generator, tokenizer, vocab_limit
    multiple = generator.batch_multiple
    self.batch_size = batch_size + (-batch_size % multiple)  # the batch must divide its shards
    self.max_length = generator.cfg.max_seq_len
    self._score = make_scorer(generator, vocab_limit)
    self.after_batch = after_batch

  @property
  def eot_token_id(self) -> int:
    return self.tok.eos_id

  @property
  def prefix_token_id(self) -> int:
    # What precedes text with no context: a document follows an EOS in training's byte stream; a Hugging
    # Face tokenizer's BOS (its EOS when it has none), as lm-eval's Hugging Face backend uses.
    return self.tok.eos_id if isinstance(self.tok, ByteTokenizer) else self.tok.bos_id

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    if add_special_tokens is False:
      return self.tok.encode(string).tolist()
    return prompt_ids(self.tok, string)

  def load_params(self, path: str) -> None:
    """Another checkpoint of the same model into this one's placed parameters: nothing recompiles."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            self.generator.params)
    self.generator.params = init_from.load_params(path, self.generator.cfg, abstract)

  def tok_decode(self, ids: Sequence[int]) -> str:
    return self.tok.decode(ids)

  def score_tokens(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """(sum log p(continuation | context), whether greedy decoding gives the continuation) per pair,
    longest first in fixed-size batches; the input is cut from the left to the model's length."""
    rows = [(context + continuation)[-(self.max_length + 1):] for context, continuation in pairs]
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
    with jax.set_mesh(self.generator.mesh):
      for start in range(0, len(order), self.batch_size):
        chunk = order[start:start + self.batch_size]
        longest = len(rows[chunk[0]]) - 1
        t = min(self.max_length, longest + (-longest % LENGTH_BUCKET))
        tokens_BT, targets_BT = np.zeros((self.batch_size, t), np.int32), np.zeros((self.batch_size, t), np.int32)
        valid_BT = np.zeros((self.batch_size, t), bool)
        for b, i in enumerate(chunk):
          row = rows[i]
          tokens_BT[b, :len(row) - 1], targets_BT[b, :len(row) - 1], valid_BT[b, :len(row) - 1] = row[:-1], row[1:], True
        logp_BT, greedy_BT = (np.asarray(x) for x in self._score(self.generator.params, tokens_BT, targets_BT, valid_BT))
        for b, i in enumerate(chunk):
          end, n = len(rows[i]) - 1, len(pairs[i][1])
          out[i] = (float(logp_BT[b, end - n:end].sum(dtype=np.float64)), bool(greedy_BT[b, end - n:end].all()))
        if self.after_batch is not None:
          self.after_batch()
    return out

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
    results = self.score_tokens([(context, continuation) for _, context, continuation in requests])
    for (key, _, _), result in zip(requests, results):
      self.cache_hook.add_partial("loglikelihood", key, result)
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """Each text's total log-likelihood over disjoint windows of the model's length (lm-eval's own
    windowing: the first token is predicted from `prefix_token_id`)."""
    from lm_eval import utils

    windows, owners = [], []
    for i, (string,) in enumerate(req.args for req in requests):
      for window in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
          token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
          context_len=1)):
        windows.append(window)
        owners.append(i)
    totals = [0.0] * len(requests)
    for owner, (logp, _) in zip(owners, self.score_tokens(windows)):
      totals[owner] += logp
    for req, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
    return totals

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Greedy (or sampled, per the task's kwargs) continuations, cut before the first stop string;
    requests with the same kwargs run as one batch per `batch_size`."""
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

    groups: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
      groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
    out = [""] * len(requests)
    for indices in groups.values():
      kwargs = normalize_gen_kwargs(dict(requests[indices[0]].args[1]), 256)
      until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok.decode([self.tok.eos_id]) or None)
      max_new = min(int(kwargs["max_gen_toks"]), self.max_length - 1)
      rule = sampling.Sampling(temperature=float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0)
      for start in range(0, len(indices), self.batch_size):
        chunk = indices[start:start + self.batch_size]
        prompts = [(self.tok_encode(requests[i].args[0]) or [self.prefix_token_id])[-(self.max_length - max_new):]
                   for i in chunk]
        tokens, _ = self.generator.generate(prompts, max_new, rule, eos_ids=[self.tok.eos_id],
                                            vocab_limit=self.vocab_limit, length_multiple=LENGTH_BUCKET // 2)
        for i, ids in zip(chunk, tokens):
          text = self.tok.decode(ids)
          for stop in until:
            text = text.split(stop)[0] if stop else text
          out[i] = text
          self.cache_hook.add_partial("generate_until", requests[i].args, text)
    return out
