"""Supervised fine-tuning in the training loop: `SftData` stands in for `loop/data.py` Data when
`post.mode` is sft (the same methods the trainer calls), serving packed prompt/response rows
(`data/sft.py`) with the loss on response tokens only, and held-out eval batches; plus the held-out
exact-match accuracy of greedy generation (`exact_match`), logged at every eval as `sft/exact_match`.

The train order is a permutation of the packed rows per epoch (seed + epoch): batch k of the run is
a function of (seed, k), so the data state is the step alone and resume is exact.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np
from flax import nnx

from maxtrain.data import sft as sft_data
from maxtrain.data.pipeline import KEYS
from maxtrain.data.tokenizer import load_tokenizer
from maxtrain.errors import require
from maxtrain.program import batch as batch_lib
from maxtrain.runtime import faults

log = logging.getLogger("maxtrain")


class _Source:
  """What the trainer reads of a token store: the tokenizer identity, a prefix, an entropy."""

  def __init__(self, name: str, identity: str, targets: np.ndarray, mask: np.ndarray):
    self.prefix, self.tokenizer_identity = name, identity
    counts = np.bincount(targets[mask > 0].reshape(-1))
    p = counts[counts > 0] / max(counts.sum(), 1)
    self._entropy = float(-(p * np.log(p)).sum())

  def unigram_entropy(self) -> float:
    return self._entropy


class _NoLoader:
  def close(self) -> None:
    pass


class SftData:
  def __init__(self, cfg: ml_collections.ConfigDict, batch_shardings: dict[str, Any]):
    d, p = cfg.data, cfg.post
    self.tokenizer = load_tokenizer(d.tokenizer)
    require(self.tokenizer.vocab_size <= cfg.model.vocab_size,
            f"config.data.tokenizer={d.tokenizer!r} has {self.tokenizer.vocab_size} ids, more than "
            f"config.model.vocab_size={cfg.model.vocab_size}")
    self.source, self.batch_size, self.seed, self.mode = p.data, d.batch_size, cfg.seed, p.mode
    self.train = sft_data.packed_rows(p.data, "train", self.tokenizer, d.seq_len, cfg.seed)
    evals = sft_data.packed_rows(p.data, "eval", self.tokenizer, d.seq_len, cfg.seed)
    self.num_rows = len(self.train["inputs"])
    require(self.num_rows >= self.batch_size, f"config.post.data={p.data!r} packs into {self.num_rows} rows of "
            f"data.seq_len={d.seq_len}, fewer than data.batch_size={self.batch_size}")
    self.shardings, self.loader, self.step = batch_shardings, _NoLoader(), 0
    self.train_store = _Source(p.data or "arithmetic", self.tokenizer.identity, self.train["targets"],
                               self.train["loss_mask"])
    n_eval = min(cfg.eval.batches * self.batch_size, len(evals["inputs"]) // self.batch_size * self.batch_size)
    self.eval_sets = {"sft": [batch_lib.to_device({k: evals[k][i:i + self.batch_size] for k in KEYS}, batch_shardings)
                              for i in range(0, n_eval, self.batch_size)]}
    self.eval_examples = sft_data.load_examples(p.data, "eval", self.tokenizer)[:p.eval_prompts]
    self.max_new_tokens, self._generator = p.max_new_tokens, None

  def describe(self) -> str:
    return (f"{self.mode}: {self.source or 'arithmetic'}: {self.num_rows} packed rows, "
            f"{int(self.train['loss_mask'].sum())} response tokens")

  def rows(self, step: int) -> dict[str, np.ndarray]:
    """The rows of the batch that completes as step `step` + 1 (epoch-wise permutations)."""
    per_epoch = self.num_rows // self.batch_size
    epoch, k = divmod(step, per_epoch)
    order = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)[k * self.batch_size:(k + 1) * self.batch_size]
    return {key: self.train[key][order] for key in KEYS}

  def next_batch(self, fault: tuple[float, float] = faults.NONE) -> tuple[dict[str, jax.Array], float]:
    t0 = time.monotonic()
    batch = batch_lib.to_device(self.rows(self.step), self.shardings)
    self.step += 1
    return faults.attach(batch, fault, self.shardings[faults.INPUT]), time.monotonic() - t0

  def get_state(self) -> dict:
    return {"step": self.step}

  def set_state(self, state: dict) -> None:
    self.step = int(state["step"])

  def scalars(self, state: dict | None = None) -> dict[str, float]:
    step = self.step if state is None else int(state["step"])
    return {"data/sequences": float(step * self.batch_size),
            "data/epochs": step * self.batch_size / self.num_rows}

  def newly_past_max_epochs(self) -> dict[str, float]:
    return {}

  def bytes_per_token(self, name: str) -> float | None:
    return None

  def extra_eval(self, program: Any, params: Any) -> dict[str, float]:
    """`sft/exact_match` of greedy completions on the held-out prompts (post.eval_prompts)."""
    if not self.eval_examples:
      return {}
    if self._generator is None:
      self._generator = make_generator(program, params)
    self._generator.params = params
    acc = exact_match(self._generator, self.tokenizer, self.eval_examples, self.max_new_tokens)
    log.info("held-out exact match %.3f (%d prompts, greedy)", acc, len(self.eval_examples))
    return {"sft/exact_match": acc}


def make_generator(program: Any, params: Any) -> Any:
  """The project's generator over the training model and mesh; its params are set per call."""
  from maxtrain.inference.sampling import Generator

  model = nnx.merge(program.state.graphdef, params)
  return Generator(model, program.mesh, program.plan.layout.rules,
                   batch_multiple=program.plan.layout.shards("act_batch"))


def exact_match(generator: Any, tokenizer: Any, examples: Sequence[dict], max_new_tokens: int,
                batch: int = 256) -> float:
  """Fraction of examples whose greedy completion (to EOS) equals the response, whitespace-stripped."""
  from maxtrain.inference.sampling import Sampling

  hits = 0
  for i in range(0, len(examples), batch):
    chunk = examples[i:i + batch]
    prompts = [tokenizer.encode(e["prompt"]).tolist() for e in chunk]
    outs, _ = generator.generate(prompts, max_new_tokens, Sampling(), eos_ids=(tokenizer.eos_id,),
                                 vocab_limit=tokenizer.vocab_size)
    hits += sum(tokenizer.decode(o).strip() == e["response"].strip() for o, e in zip(outs, chunk))
  return hits / max(len(examples), 1)
