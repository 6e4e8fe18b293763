"""The run's data: its token stores opened and checked against the model, the resumable train
loader, and the fixed eval batches, delivered as global device arrays laid out for the step."""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import ml_collections

from maxtrain.program import batch as batch_lib
from maxtrain.data import corpus, pipeline
from maxtrain.data.store import TokenStore
from maxtrain.errors import UserError
from maxtrain.runtime import faults

log = logging.getLogger("maxtrain")


def open_stores(data_cfg: ml_collections.ConfigDict, vocab_size: int) -> tuple[TokenStore, TokenStore]:
  """Opens (building the embedded corpus on first use) and checks the train and val stores."""
  if data_cfg.path:
    train_prefix, val_prefix = f"{data_cfg.path}.train", f"{data_cfg.path}.val"
  else:
    train_prefix, val_prefix = corpus.prepare_corpus(data_cfg.corpus, tokenizer_spec=data_cfg.tokenizer)
  train, val = TokenStore.open(train_prefix), TokenStore.open(val_prefix)
  for store in (train, val):
    if store.vocab_size > vocab_size:
      raise UserError(
          f"token store {store.prefix} was built with a tokenizer of {store.vocab_size} ids "
          f"({store.tokenizer_identity}), more than config.model.vocab_size={vocab_size}. "
          f"Set --config.model.vocab_size to at least {store.vocab_size} (rounded up so the mesh divides it)."
      )
    store.check_vocab(vocab_size)  # the ids actually stored (the header's maximum, or one scan of old stores)
  if data_cfg.path:
    check_tokenizer(train, data_cfg.tokenizer)
  if train.tokenizer_identity != val.tokenizer_identity:
    raise UserError(f"{train.prefix} and {val.prefix} were built with different tokenizers "
                    f"({train.tokenizer_identity} vs {val.tokenizer_identity}); rebuild both with tools/index_data.py")
  return train, val


def check_tokenizer(store: TokenStore, tokenizer: str) -> None:
  """The tokenizer is part of a run's identity: the store's header must name the config's `data.tokenizer`
  (what generate and convert will decode with). UserError naming both."""
  from maxtrain.data.tokenizer import load_tokenizer

  identity = load_tokenizer(tokenizer).identity
  if store.tokenizer_identity != identity:
    raise UserError(f"token store {store.prefix} was built with tokenizer {store.tokenizer_identity}, but "
                    f"config.data.tokenizer={tokenizer!r} is {identity}: set --config.data.tokenizer to the "
                    "tokenizer.json the store was built with (generate and convert decode with it), or rebuild "
                    "the store with tools/index_data.py --tokenizer")


def check_checkpoint_tokenizer(store: TokenStore, data_cfg: ml_collections.ConfigDict, meta: dict, path: Any) -> None:
  """A resumed checkpoint was trained on stores of one tokenizer: this run's must be the same."""
  saved = meta.get("tokenizer_identity")
  saved_cfg = _dotted(meta.get("config", {}), "data.tokenizer")
  if saved is not None and saved != store.tokenizer_identity:
    raise UserError(f"checkpoint {path} was trained on stores tokenized by {saved} (data.tokenizer={saved_cfg!r}), "
                    f"but token store {store.prefix} was built with {store.tokenizer_identity}: resume with the "
                    "stores and data.tokenizer it was trained with, or start a new run in another output_dir")
  if saved is None and saved_cfg is not None and saved_cfg != data_cfg.tokenizer:
    raise UserError(f"checkpoint {path} was trained with data.tokenizer={saved_cfg!r}, this run has "
                    f"config.data.tokenizer={data_cfg.tokenizer!r}: resume with the one it was trained with")


def _dotted(tree: dict, key: str) -> Any:
  for part in key.split("."):
    tree = tree.get(part, {}) if isinstance(tree, dict) else {}
  return tree if tree != {} else None


class Data:
  def __init__(self, cfg: ml_collections.ConfigDict, batch_shardings: dict[str, Any]):
    d = cfg.data
    self.train_store, self.val_store = open_stores(d, cfg.model.vocab_size)
    self.shardings = batch_shardings
    # Both loaders also check every batch's ids against the model's vocabulary: a file can change
    # after it was indexed, and an id out of range would give NaN losses, not an error.
    vocab = cfg.model.vocab_size
    self.loader = pipeline.TrainLoader(self.train_store.prefix, d.seq_len, d.batch_size, cfg.seed,
                                       jax.process_index(), jax.process_count(), vocab_size=vocab)
    self.eval_batches = [batch_lib.to_device(rows, batch_shardings) for rows in pipeline.eval_batches(
        self.val_store.prefix, d.seq_len, d.batch_size, cfg.eval.batches, jax.process_index(), jax.process_count(),
        vocab_size=vocab)]

  def describe(self) -> str:
    return (f"train {self.train_store.prefix} ({self.train_store.num_tokens} tokens), "
            f"val {self.val_store.prefix} ({self.val_store.num_tokens} tokens)")

  def next_batch(self, fault: tuple[float, float] = faults.NONE) -> tuple[dict[str, jax.Array], float]:
    """The next train batch on device (with the step's fault input) and the seconds spent waiting."""
    t0 = time.monotonic()
    batch = batch_lib.to_device(next(self.loader), self.shardings)
    wait_s = time.monotonic() - t0
    return faults.attach(batch, fault, self.shardings[faults.INPUT]), wait_s

  def get_state(self) -> dict:
    return self.loader.get_state()

  def set_state(self, state: dict) -> None:
    self.loader.set_state(state)  # O(1): the loader indexes windows, nothing is replayed
