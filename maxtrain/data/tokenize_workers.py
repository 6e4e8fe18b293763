"""Decodes and tokenizes indexing jobs in worker processes, results in order.

A job is a list of tasks `(path, is_jsonl, start, end)`: a whole file, or the
.jsonl lines that start in [start, end). Jobs are big enough to amortize the
inter-process traffic; `indexing._make_jobs` sizes them.
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import sys
from concurrent import futures
from typing import Iterator

import numpy as np

from maxtrain.data import decode
from maxtrain.data.store import token_dtype
from maxtrain.data.tokenizer import load_tokenizer

Task = tuple[str, bool, int, int]  # (path, is_jsonl, start, end)


@dataclasses.dataclass
class TaskResult:
  """One task's documents as (line number within the task, tokens)."""
  docs: list[tuple[int, np.ndarray]]
  tally: decode.Tally
  error: decode.DecodeError | None = None  # Set: docs and tally are partial.


def ordered_results(jobs: list[list[Task]], workers: int, tokenizer_spec: str,
                    text_key: str, errors: str
                    ) -> Iterator[list[TaskResult]]:
  """Yields each job's results in order, with at most a few jobs in flight.

  Close it to stop the workers early.
  """
  init_args = (tokenizer_spec, text_key, errors)
  done = 0
  if workers > 1 and len(jobs) > 1:
    # spawn, not fork: the caller may be a multithreaded JAX process.
    pool = futures.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"),
        initializer=_init, initargs=init_args)
    try:
      pending = collections.deque()
      for job in jobs:  # A bounded window: backpressure keeps RAM flat.
        pending.append(pool.submit(_run_job, job))
        if len(pending) >= 4 * workers:
          yield pending.popleft().result()
          done += 1
      while pending:
        yield pending.popleft().result()
        done += 1
      return
    except futures.process.BrokenProcessPool:
      # Spawned workers re-import the main module; without an
      # `if __name__ == "__main__":` guard (or from stdin) they die at start.
      # A multiprocessing.Pool would respawn them forever; we carry on here.
      print("warning: tokenizer worker processes failed to start (does the "
            "main script lack an `if __name__ == '__main__':` guard?); "
            "tokenizing in this process", file=sys.stderr)
    finally:
      pool.shutdown(wait=False, cancel_futures=True)
  _init(*init_args)
  for job in jobs[done:]:
    yield _run_job(job)


# ---- Worker side. Globals are set once per worker process by `_init`. ----

_tokenizer = None
_text_key = "text"
_errors = "replace"
_dtype = np.dtype(np.uint16)


def _init(tokenizer_spec: str, text_key: str, errors: str) -> None:
  global _tokenizer, _text_key, _errors, _dtype
  _tokenizer = load_tokenizer(tokenizer_spec)
  _text_key = text_key
  _errors = errors
  _dtype = token_dtype(_tokenizer.vocab_size)


def _encode(text: str) -> np.ndarray:
  ids = _tokenizer.encode(text)
  out = np.empty(ids.size + 1, _dtype)  # Store dtype halves the IPC bytes.
  out[:-1] = ids
  out[-1] = _tokenizer.eos_id
  return out


def _run_task(task: Task) -> TaskResult:
  """Line numbers stay within the task: only the parent knows how many lines
  earlier tasks had."""
  path, is_jsonl, start, end = task
  tally, docs = decode.Tally(), []
  try:
    for line, text in decode.documents(path, is_jsonl, start, end, _text_key,
                                       _errors, tally):
      docs.append((line, _encode(text)))
  except decode.DecodeError as e:
    return TaskResult([], tally, e)
  return TaskResult(docs, tally)


def _run_job(tasks: list[Task]) -> list[TaskResult]:
  return [_run_task(t) for t in tasks]
