"""The run's data: its token stores opened and checked against the model, the resumable train
loader, and the fixed eval batches, delivered as global device arrays laid out for the step."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax

from maxtrain import config as config_lib
from maxtrain.config import schema
from maxtrain.program import batch as batch_lib
from maxtrain.data import corpus, mixture, pipeline
from maxtrain.data.loader import MixtureLoader, process_rows
from maxtrain.data.store import TokenStore
from maxtrain.errors import UserError
from maxtrain.data.tokenizer import load_tokenizer

log = logging.getLogger("maxtrain")


def open_stores(data_cfg: schema.Data, vocab_size: int) -> tuple[TokenStore, TokenStore]:
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
  identity = load_tokenizer(tokenizer).identity
  if store.tokenizer_identity != identity:
    raise UserError(f"token store {store.prefix} was built with tokenizer {store.tokenizer_identity}, but "
                    f"config.data.tokenizer={tokenizer!r} is {identity}: set --config.data.tokenizer to the "
                    "tokenizer.json the store was built with (generate and convert decode with it), or rebuild "
                    "the store with tools/index_data.py --tokenizer")


def check_checkpoint_tokenizer(store: TokenStore, data_cfg: schema.Data, meta: dict, path: Any) -> None:
  """A resumed checkpoint was trained on stores of one tokenizer: this run's must be the same."""
  saved = meta.get("tokenizer_identity")
  saved_cfg = config_lib.Config.from_dict(config_lib.saved_config(meta, f"checkpoint {path}")).data.tokenizer
  if saved is not None and saved != store.tokenizer_identity:
    raise UserError(f"checkpoint {path} was trained on stores tokenized by {saved} (data.tokenizer={saved_cfg!r}), "
                    f"but token store {store.prefix} was built with {store.tokenizer_identity}: resume with the "
                    "stores and data.tokenizer it was trained with, or start a new run in another output_dir")
  if saved is None and saved_cfg != data_cfg.tokenizer:
    raise UserError(f"checkpoint {path} was trained with data.tokenizer={saved_cfg!r}, this run has "
                    f"config.data.tokenizer={data_cfg.tokenizer!r}: resume with the one it was trained with")


class Data:
  """The train loader over the config's sources (one store, or a mixture in stages: `data/mixture.py`)
  and each source's fixed eval batches."""

  def __init__(self, cfg: schema.Config, batch_shardings: dict[str, Any]):
    cfg = config_lib.Config.of(cfg)
    d, vocab = cfg.data, cfg.model.vocab_size
    sources, stages = mixture.from_config(d)
    if d.sources:  # each source is a PREFIX.train / PREFIX.val pair, checked as data.path would be
      pairs = [open_stores(config_lib.with_values(d, {"path": s.prefix}), vocab) for s in sources]
    else:
      pairs = [open_stores(d, vocab)]
    self.train_store, self.val_store = pairs[0]
    self.names = [s.name for s in sources]
    self.stores = {s.name: pair for s, pair in zip(sources, pairs)}
    self.shardings = batch_shardings
    # The loader also checks every batch's ids against the model's vocabulary: a file can change
    # after it was indexed, and an id out of range would give NaN losses, not an error.
    train_sources = [dataclasses.replace(s, prefix=train.prefix) for s, (train, _) in zip(sources, pairs)]
    self.loader = MixtureLoader(train_sources, stages, cfg.seed, process_rows(batch_shardings[pipeline.KEYS[0]]),
                                vocab_size=vocab, allow_new_batch_size=d.resume_new_batch_size,
                                read_ahead=d.read_ahead, read_threads=d.read_threads)
    self.eval_sets = {name: [batch_lib.to_device(rows, batch_shardings) for rows in pipeline.eval_batches(
        val.prefix, d.seq_len, d.batch_size, cfg.eval.batches, jax.process_index(), jax.process_count(),
        vocab_size=vocab)] for name, (_, val) in self.stores.items()}
    self.eval_batches = [b for batches in self.eval_sets.values() for b in batches]
    self.max_epochs, self._past_max = d.max_epochs, set()
    self._data_cfg = d
    self.data_change: str | None = None  # token stores refuse other data in the loader: never set here

  @property
  def tokenizer_identity(self) -> str:
    return self.train_store.tokenizer_identity

  def unigram_entropy(self) -> float:
    return self.train_store.unigram_entropy()

  def close(self) -> None:
    self.loader.close()  # the read-ahead threads

  def check_checkpoint(self, meta: dict, path: Any) -> None:
    """Before compiling: the checkpoint's tokenizer is this run's."""
    check_checkpoint_tokenizer(self.train_store, self._data_cfg, meta, path)

  def extra_eval(self, program: Any, params: Any) -> dict[str, float]:
    return {}  # held-out accuracies are post-training's (posttrain/data.py)

  def describe(self) -> str:
    return "; ".join(f"{name}: train {train.prefix} ({train.num_tokens} tokens), val {val.prefix} "
                     f"({val.num_tokens} tokens)" for name, (train, val) in self.stores.items())

  def next_batch(self) -> tuple[dict[str, jax.Array], float]:
    """The next train batch on device and the seconds spent waiting."""
    t0 = time.monotonic()
    batch = batch_lib.to_device(next(self.loader), self.shardings)
    return batch, time.monotonic() - t0

  def scalars(self, state: dict | None = None) -> dict[str, float]:
    """What the batches up to `state` (a `get_state()`; default: all served, including one read for the
    next step) consumed: per source data/<name>/{tokens,sequences,epochs}, and data/tokens in all (tokens
    seen: right through batch ramps and seq_len stages, which change the tokens per step)."""
    consumed = self.loader.consumed(None if state is None else int(state["step"]))
    out = {f"data/{name}/{kind}": float(value) for name, counts in consumed.items() for kind, value in counts.items()}
    out["data/tokens"] = float(sum(counts["tokens"] for counts in consumed.values()))
    return out

  def newly_past_max_epochs(self) -> dict[str, float]:
    """Sources read past data.max_epochs since the last call (each named once), with their epochs."""
    if not self.max_epochs:
      return {}
    past = {name: c["epochs"] for name, c in self.loader.consumed().items()
            if c["epochs"] > self.max_epochs and name not in self._past_max}
    self._past_max.update(past)
    return past

  def bytes_per_token(self, name: str) -> float | None:
    """The source's average UTF-8 bytes per token (from its header's input size), for bits per byte."""
    train, val = self.stores[name]
    source = train.header.get("source") or {}
    size = source.get("bytes", source.get("total_bytes"))
    tokens = train.num_tokens + val.num_tokens
    return size / tokens if isinstance(size, (int, float)) and size > 0 and tokens else None

  def get_state(self) -> dict:
    return self.loader.get_state()

  def set_state(self, state: dict) -> None:
    if set(state) <= {"step", "source"}:  # a post-training run's position (posttrain/data.py)
      raise UserError("the checkpoint's data state is a post-training run's (prompt/response rows or RL prompts), "
                      "not a token-store loader's: resume it with the post.mode it was trained with, or start a new "
                      "run in another output_dir")
    self.loader.set_state(state)  # O(stages): the loader indexes windows, nothing is replayed
