"""The train loader over a mixture (`data/mixture.py`): each process builds its rows of global batch
`step` by index arithmetic, so its state is (step, global sequence, stage table) and resumes on any
process count, device count or mesh.

Global row r of step s's batch is global sequence `sequence_of_step(s) + r`, whatever the layout;
a process reads only the rows its devices hold (`process_rows`).

Batches are served by Grain: a `MapDataset` over the current stage's steps, whose item k is this
process's rows of step `first + k` (a pure function of the step), read ahead by Grain's prefetch
threads while the device runs the step. The state is the loader's step, never Grain's iterator
position; the Grain iterator is rebuilt at each stage boundary (the shapes may change) and on set_state.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Iterator, Sequence

import grain
import jax
import numpy as np

from maxtrain.data import pipeline
from maxtrain.data.mixture import Mixture, Source, Stage
from maxtrain.data.store import TokenStore
from maxtrain.errors import UserError

log = logging.getLogger("maxtrain")
STATE_VERSION = 2
_ENDLESS = 2**62  # the last stage's length in steps: Grain's MapDataset needs one


def contiguous_rows(process_index: int, process_count: int) -> Callable[[int], np.ndarray]:
  """Process p's rows of a batch of B: [p * B/P, (p + 1) * B/P), the layout of one process per node."""
  def rows(batch_size: int) -> np.ndarray:
    per = pipeline._check_processes(batch_size, process_index, process_count)
    return np.arange(process_index * per, (process_index + 1) * per)
  return rows


def process_rows(sharding: jax.sharding.Sharding) -> Callable[[int], np.ndarray]:
  """The rows of a [B, ...] batch that this process's devices hold under `sharding`, in order."""
  def rows(batch_size: int) -> np.ndarray:
    held = set()
    length = getattr(sharding, "mesh", None).size if hasattr(sharding, "mesh") else 1  # divisible by any split
    for index in sharding.addressable_devices_indices_map((batch_size, length)).values():
      held.update(range(*index[0].indices(batch_size)))
    return np.array(sorted(held), np.int64)
  return rows


class MixtureLoader:
  """Iterator over this process's rows of each step's global batch, with resumable state.

  `sources` name the train stores; `stages` is the config's table (`mixture.parse_stages`).
  `vocab_size` (the model's) is checked against every store and every batch. `read_ahead` batches are
  prepared by `read_threads` Grain threads ahead of the one asked for (0: each batch is built on call).
  """

  def __init__(self, sources: Sequence[Source], stages: Sequence[Stage], seed: int,
               rows: Callable[[int], np.ndarray], *, vocab_size: int | None = None,
               allow_new_batch_size: bool = False, read_ahead: int = 4, read_threads: int = 2):
    self.sources, self.config_stages, self.seed = list(sources), list(stages), seed
    self.names = [s.name for s in self.sources]
    self.stores = [TokenStore.open(s.prefix) for s in self.sources]
    check_stores(self.stores, self.names, vocab_size)
    self.model_vocab_size, self.allow_new_batch_size, self._rows = vocab_size, allow_new_batch_size, rows
    self.mixture = Mixture(self.names, [s.num_tokens for s in self.stores], self.config_stages, seed)
    self.step = 0  # the step whose batch comes next
    self.read_ahead, self.read_threads = read_ahead, read_threads
    self._ahead: Iterator[dict[str, np.ndarray]] | None = None  # Grain's iterator over the stage's steps
    self._ahead_step = self._ahead_stop = -1  # the step whose batch `_ahead` yields next; its stage's end

  def __iter__(self) -> MixtureLoader:
    return self

  def batch_of_step(self, step: int) -> dict[str, np.ndarray]:
    """This process's rows of global batch `step` (a pure function of the step and the table)."""
    stage = self.mixture.stages[self.mixture.stage_of_step(step)]
    return self._read(self.mixture, step, self._rows(stage.batch_size))

  def _read(self, mixture: Mixture, step: int, held: np.ndarray) -> dict[str, np.ndarray]:
    """The rows `held` of global batch `step` under `mixture` (thread-safe: Grain's threads call it)."""
    first = mixture.sequence_of_step(step)
    seq_len = mixture.stages[mixture.stage_of_step(step)].seq_len
    where = [(j, mixture.pieces(j, q, t)) for j, q, t in (mixture.locate(first + int(r)) for r in held)]
    rows = []
    for j, pieces in where:
      if len(pieces) > 1:  # a re-cut epoch's pieces: each piece's last target is checked here
        pipeline.check_piece_ids(self.stores[j], pieces, self.model_vocab_size)
      rows.append(pipeline.pack_pieces(self.stores[j].tokens, self.stores[j].offsets, pieces, seq_len))
    batch = {k: np.stack([row[k] for row in rows]) for k in pipeline.KEYS}
    bad = pipeline.first_bad_token(batch, min(pipeline.id_limit(s, self.model_vocab_size) for s in self.stores))
    if bad is not None:  # name the store and document of the first bad row
      j, pieces = where[bad[0]]
      row = {k: v[bad[0]:bad[0] + 1] for k, v in batch.items()}
      pipeline.check_batch_ids(row, self.stores[j], self.model_vocab_size,
                               lambda _, col: pipeline.piece_position(pieces, col))
    return batch

  def __next__(self) -> dict[str, np.ndarray]:
    if self.read_ahead <= 0:
      batch = self.batch_of_step(self.step)
    else:
      if self._ahead is None or self._ahead_step != self.step or self.step == self._ahead_stop:
        self._start_reading()  # first use, a moved position, or the next stage
      batch = next(self._ahead)
      self._ahead_step += 1
    self.step += 1
    return batch

  def _start_reading(self) -> None:
    """A Grain iterator over this stage's steps from `self.step`, reading ahead in threads. The rows and the
    mixture are fixed here, on the calling thread (process_rows asks jax), so workers only read stores."""
    self.close()
    mixture, t = self.mixture, self.mixture.stage_of_step(self.step)
    stop = mixture.stages[t + 1].step if t + 1 < len(mixture.stages) else self.step + _ENDLESS
    source = _StepBatches(self, mixture, self.step, stop - self.step, self._rows(mixture.stages[t].batch_size))
    options = grain.ReadOptions(num_threads=self.read_threads, prefetch_buffer_size=self.read_ahead)
    self._ahead = iter(grain.MapDataset.source(source).to_iter_dataset(options))
    self._ahead_step, self._ahead_stop = self.step, stop

  def close(self) -> None:
    """Stops the read-ahead threads (the next batch restarts them)."""
    if self._ahead is not None and hasattr(self._ahead, "close"):
      self._ahead.close()
    self._ahead, self._ahead_step, self._ahead_stop = None, -1, -1

  def sequence(self) -> int:
    """Global sequences consumed so far."""
    return self.mixture.sequence_of_step(self.step)

  def consumed(self, step: int | None = None) -> dict[str, dict[str, float]]:
    """Per source: sequences, tokens and epochs consumed by the batches before `step` (default: so far)."""
    return self.mixture.consumed(self.sequence() if step is None else self.mixture.sequence_of_step(step))

  def get_state(self) -> dict[str, Any]:
    """JSON-able, the same on every process: the step, the global sequence, the resolved stage table and
    each source's identity and accounting."""
    consumed = self.consumed()
    return {"version": STATE_VERSION, "step": self.step, "sequence": self.sequence(), "seed": self.seed,
            "stages": [s.to_json() for s in self.mixture.stages],
            "sources": {name: {"prefix": src.prefix, "num_tokens": store.num_tokens, **consumed[name]}
                        for name, src, store in zip(self.names, self.sources, self.stores)}}

  def set_state(self, state: dict[str, Any]) -> None:
    """Continues the saved run's global sequence of batches from its step, on whatever layout this is.

    The saved stage table is history up to the saved step; this config's table rules from there on. When
    the stage active at the saved step differs (weights, seq_len, or batch_size if allowed), a new stage
    starts at the saved sequence, each source continuing from its place. UserError when it cannot.
    """
    state = _upgrade(state, self.names)
    if int(state["seed"]) != self.seed:
      raise UserError(f"the checkpoint's data order comes from seed {state['seed']}, this run's config.seed="
                      f"{self.seed}: the batches would not continue. Restore seed={state['seed']}")
    saved = state["sources"]
    if list(saved) != self.names:
      raise UserError(f"the checkpoint mixes sources {', '.join(saved)}, this run {', '.join(self.names)}: the "
                      "sequence of batches cannot continue. Restore config.data.sources (change weights with "
                      "data.stages, a weight of 0 drops a source)")
    for name, store in zip(self.names, self.stores):
      if saved[name].get("num_tokens") not in (None, store.num_tokens):
        raise UserError(f"source {name!r}: {store.prefix} holds {store.num_tokens} tokens, the checkpoint's "
                        f"store held {saved[name]['num_tokens']}: its windows changed, so the run cannot continue "
                        "exactly. Restore the original store or start a fresh run")
    stages = self._merged(int(state["step"]), [Stage.from_json(s) for s in state["stages"]])
    self.close()  # batches read ahead belong to the old position and table
    self.mixture = Mixture(self.names, [s.num_tokens for s in self.stores], stages, self.seed)
    self.step = int(state["step"])
    if self.sequence() != int(state["sequence"]):
      raise UserError(f"the checkpoint's data state is inconsistent: step {self.step} is sequence "
                      f"{self.sequence()} by its stage table, not {state['sequence']}; start a fresh run")

  def _merged(self, step: int, history: list[Stage]) -> list[Stage]:
    """The saved stages up to `step`, then this config's from `step` on (re-anchored at the saved sequence)."""
    past = [s for s in history if s.step <= step]
    now = past[-1]
    seq = now.seq + (step - now.step) * now.batch_size
    cfg = self.config_stages[max(i for i, s in enumerate(self.config_stages) if s.step <= step)]
    if cfg.batch_size != now.batch_size and not self.allow_new_batch_size:
      raise UserError(f"the checkpoint of step {step} ran data.batch_size={now.batch_size}, this config "
                      f"{cfg.batch_size}: the batches would be cut differently. Restore the batch size, or set "
                      "data.resume_new_batch_size=true to continue the same sequence of windows in new batches")
    if (cfg.batch_size, cfg.seq_len, cfg.weights) != (now.batch_size, now.seq_len, now.weights):
      log.info("data: the stage at step %d changes on resume (batch %d, seq_len %d, weights %s): a new stage "
               "starts at sequence %d", step, cfg.batch_size, cfg.seq_len, cfg.weights, seq)
      past.append(Stage(step, seq, cfg.batch_size, cfg.seq_len, cfg.weights))
    for s in self.config_stages:
      if s.step > step:
        last = past[-1]
        past.append(dataclasses.replace(s, seq=last.seq + (s.step - last.step) * last.batch_size))
    return [s for i, s in enumerate(past) if i + 1 == len(past) or past[i + 1].step > s.step]


class _StepBatches:
  """Grain's random-access source over one stage's steps: item k is this process's rows of step first + k."""

  def __init__(self, loader: MixtureLoader, mixture: Mixture, first: int, length: int, held: np.ndarray):
    self.loader, self.mixture, self.first, self.length, self.held = loader, mixture, first, length, held

  def __len__(self) -> int:
    return self.length

  def __getitem__(self, k: int) -> dict[str, np.ndarray]:
    return self.loader._read(self.mixture, self.first + int(k), self.held)


def _upgrade(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
  """A single-store loader's state (before mixtures: a per-process batch count) as a version-2 state."""
  if "version" in state:
    return state
  if len(names) != 1:
    raise UserError("the checkpoint's data state is from a single-store run; this run mixes "
                    f"{', '.join(names)}: the batches cannot continue. Use config.data.path as before")
  step, batch, seq_len = int(state["next_index"]), int(state["global_batch_size"]), int(state["seq_len"])
  return {"version": STATE_VERSION, "step": step, "sequence": step * batch, "seed": state["seed"],
          "stages": [Stage(0, 0, batch, seq_len, (1.0,)).to_json()], "sources": {names[0]: {}}}


def check_stores(stores: Sequence[TokenStore], names: Sequence[str], vocab_size: int | None) -> None:
  """Refuses stores that cannot be mixed: different tokenizers, ids past the model's vocabulary, empty."""
  first = stores[0]
  for name, store in zip(names, stores):
    if store.tokenizer_identity != first.tokenizer_identity:
      raise UserError(f"source {name!r} ({store.prefix}) was built with tokenizer {store.tokenizer_identity}, "
                      f"source {names[0]!r} ({first.prefix}) with {first.tokenizer_identity}: a mixture needs one "
                      "tokenizer. Rebuild it with tools/index_data.py and the same --tokenizer")
    if vocab_size is not None and store.vocab_size > vocab_size:
      raise UserError(f"source {name!r} ({store.prefix}) was built with a tokenizer of {store.vocab_size} ids "
                      f"({store.tokenizer_identity}), more than config.model.vocab_size={vocab_size}. Set "
                      f"--config.model.vocab_size to at least {store.vocab_size}")
    if vocab_size is not None:
      store.check_vocab(vocab_size)
    if store.num_tokens < 2:
      raise UserError(f"source {name!r} ({store.prefix}) is empty ({store.num_tokens} tokens); index data into "
                      "it or drop it from config.data.sources")
