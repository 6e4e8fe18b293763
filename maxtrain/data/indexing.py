"""Tokenizes text files into train/val token stores (see `store.py`).

Inputs are files, directories (walked recursively, hidden entries skipped) and
globs. `.jsonl` files hold one document per line (the `--text-key` field);
any other file is one UTF-8 document, unless it contains NUL bytes, in which
case it is skipped as binary. Every document is stored as its tokens followed
by EOS, the document boundary the loader packs across.

The train/val split is per document and depends only on the seed and the
document's name (its path relative to the input directory, plus the line
number for .jsonl), so it is stable across runs, worker counts and machines.

Usage: python tools/index_data.py --input DIR --output data/mycorpus
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import hashlib
import json
import multiprocessing
import os
import sys
import time
from concurrent import futures
from typing import Any, Sequence

import numpy as np

from maxtrain.data.store import StoreWriter, token_dtype
from maxtrain.data.tokenizer import ByteTokenizer, load_tokenizer
from maxtrain.errors import UserError

_JOB_BYTES = 4 << 20  # Input bytes per worker job: amortizes IPC, bounds RAM.
_JOB_FILES = 256


@dataclasses.dataclass(frozen=True)
class SourceFile:
  """An input file and the stable name its split decision hashes."""
  path: str
  key: str
  size: int


def collect_files(inputs: Sequence[str]) -> list[SourceFile]:
  """Expands files, directories and globs into a sorted, de-duplicated list.

  A file's split key is its path relative to its input's base: the directory
  itself, a glob's fixed leading directories, or a file's parent. So `dir`,
  `'dir/*'` and `dir/a.txt` all name dir/a.txt "a.txt".
  """
  found: dict[str, SourceFile] = {}

  def add(path: str, base: str) -> None:
    real = os.path.realpath(path)
    if real not in found and os.path.isfile(real):
      key = os.path.relpath(path, base).replace(os.sep, "/")
      found[real] = SourceFile(path, key, os.path.getsize(real))

  def add_tree(root: str, base: str) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
      dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
      for name in sorted(filenames):
        if not name.startswith("."):
          add(os.path.join(dirpath, name), base)

  for spec in inputs:
    if glob.has_magic(spec):
      matches = sorted(glob.glob(spec, recursive=True))
      if not matches:
        raise UserError(
            f"input glob {spec!r} matches nothing; check the pattern (quote "
            "it so the shell does not expand it)")
      fixed = []
      for part in spec.split(os.sep):
        if glob.has_magic(part):
          break
        fixed.append(part)
      base = os.sep.join(fixed) or "."
    elif os.path.exists(spec):
      matches = [spec]
      base = spec if os.path.isdir(spec) else os.path.dirname(spec) or "."
    else:
      raise UserError(
          f"input {spec!r} does not exist; pass existing files, directories "
          "or globs to --input")
    for match in matches:
      if os.path.isdir(match):
        add_tree(match, base)
      else:
        add(match, base)
  return sorted(found.values(), key=lambda f: (f.key, f.path))


def val_score(seed: int, key: str) -> float:
  """A uniform [0, 1) number fixed by (seed, key); < val_fraction → val."""
  digest = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little") / 2.0**64


# ---- Worker side. Globals are set once per worker process by `_init`. ----

_tokenizer = None
_text_key = "text"
_dtype = np.dtype(np.uint16)


def _init(tokenizer_spec: str, text_key: str) -> None:
  global _tokenizer, _text_key, _dtype
  _tokenizer = load_tokenizer(tokenizer_spec)
  _text_key = text_key
  _dtype = token_dtype(_tokenizer.vocab_size)


def _encode(text: str) -> np.ndarray:
  ids = _tokenizer.encode(text)
  out = np.empty(ids.size + 1, _dtype)  # Store dtype halves the IPC bytes.
  out[:-1] = ids
  out[-1] = _tokenizer.eos_id
  return out


def _run_task(task: tuple[str, bool, int, int]) -> dict[str, Any]:
  """Tokenizes one text file, or the lines of a .jsonl starting in [start, end).

  Returns docs as (line number within the task, tokens); line numbers become
  absolute in the parent, which knows how many lines earlier tasks had.
  """
  try:
    return _read_task(*task)
  except OSError as e:
    return {"error": (None, f"could not be read ({e.strerror or e})")}


def _read_task(path: str, is_jsonl: bool, start: int,
               end: int) -> dict[str, Any]:
  if not is_jsonl:
    with open(path, "rb") as f:
      data = f.read()
    if b"\0" in data:
      return {"docs": [], "bytes": len(data), "lines": 0, "binary": True}
    text = data.decode("utf-8", errors="replace")
    return {"docs": [(0, _encode(text))], "bytes": len(data), "lines": 0}
  docs, n_bytes, n_lines = [], 0, 0
  with open(path, "rb") as f:
    if start > 0:  # Lines belong to the task in which they start.
      f.seek(start - 1)
      if f.read(1) != b"\n":
        f.readline()
    while f.tell() < end:
      line = f.readline()
      if not line:
        break
      n_bytes += len(line)
      n_lines += 1
      if not line.strip():
        continue
      try:
        record = json.loads(line.decode("utf-8", errors="replace"))
      except ValueError as e:
        return {"error": (n_lines, f"is not valid JSON ({e})")}
      if not isinstance(record, dict) or _text_key not in record:
        return {"error": (n_lines, f"has no {_text_key!r} field")}
      text = record[_text_key]
      if not isinstance(text, str):
        return {"error": (n_lines, f"field {_text_key!r} is "
                          f"{type(text).__name__}, not a string")}
      docs.append((n_lines, _encode(text)))
  return {"docs": docs, "bytes": n_bytes, "lines": n_lines}


def _run_job(tasks: list[tuple[str, bool, int, int]]) -> list[dict[str, Any]]:
  return [_run_task(t) for t in tasks]


# ---- Parent side. ----


def _make_jobs(files: Sequence[SourceFile]) -> list[list[tuple]]:
  """Splits the input into jobs of about _JOB_BYTES, keeping file order."""
  tasks = []
  for f in files:
    is_jsonl = f.path.endswith(".jsonl")
    if is_jsonl and f.size > _JOB_BYTES:
      for start in range(0, f.size, _JOB_BYTES):
        tasks.append((f.path, True, start, min(start + _JOB_BYTES, f.size)))
    else:
      tasks.append((f.path, is_jsonl, 0, f.size))
  jobs, job, job_bytes = [], [], 0
  for task in tasks:
    job.append(task)
    job_bytes += task[3] - task[2]
    if job_bytes >= _JOB_BYTES or len(job) >= _JOB_FILES:
      jobs.append(job)
      job, job_bytes = [], 0
  if job:
    jobs.append(job)
  return jobs


def _ordered_results(jobs: list, workers: int, init_args: tuple):
  """Yields each job's results in order, with at most a few jobs in flight."""
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


class _Splitter:
  """Routes documents to train/val, guaranteeing a val doc when asked.

  Until the first val document shows up, the train document with the lowest
  val score is held back; if no val document ever comes, it becomes the val
  set. Deterministic, and buffers at most one document.
  """

  def __init__(self, train: StoreWriter, val: StoreWriter,
               val_fraction: float, seed: int):
    self.train, self.val = train, val
    self.val_fraction, self.seed = val_fraction, seed
    self.held: tuple[float, np.ndarray] | None = None
    self.num_docs = 0

  def add(self, key: str, tokens: np.ndarray) -> None:
    self.num_docs += 1
    score = val_score(self.seed, key)
    if score < self.val_fraction:
      self.val.add(tokens)
      self._release_held()
    elif self.val_fraction > 0 and self.val.num_docs == 0:
      if self.held is None or score < self.held[0]:
        self._release_held()
        self.held = (score, tokens)
      else:
        self.train.add(tokens)
    else:
      self.train.add(tokens)

  def _release_held(self) -> None:
    if self.held is not None:
      self.train.add(self.held[1])
      self.held = None

  def finish(self) -> None:
    if self.held is not None and self.num_docs >= 2:
      self.val.add(self.held[1])
      self.held = None
    self._release_held()


def index_sources(files: Sequence[SourceFile], output: str,
                  tokenizer_spec: str = "byte", val_fraction: float = 0.01,
                  workers: int | None = None, text_key: str = "text",
                  seed: int = 0, progress: bool = True,
                  source: dict | None = None) -> dict:
  """Tokenizes `files` into `output`.train / `output`.val; returns a summary."""
  from tqdm import tqdm  # Only the indexer needs it.

  if not 0.0 <= val_fraction < 1.0:
    raise UserError(
        f"val fraction {val_fraction} is outside [0, 1); pass e.g. 0.01")
  workers = (os.cpu_count() or 1) if workers is None else workers
  if workers < 1:
    raise UserError(f"workers={workers}; pass a positive number of workers")
  if not files:
    raise UserError("empty corpus: no input files found; check --input")
  tokenizer = load_tokenizer(tokenizer_spec)
  total_bytes = sum(f.size for f in files)
  if source is None:
    source = {"num_files": len(files), "bytes": total_bytes,
              "val_fraction": val_fraction, "seed": seed}
  started = time.perf_counter()
  writers = [StoreWriter(f"{output}.{split}", tokenizer.vocab_size,
                         tokenizer.identity, source)
             for split in ("train", "val")]
  splitter = _Splitter(*writers, val_fraction, seed)
  keys = {f.path: f.key for f in files}
  bytes_read = skipped_binary = 0
  lines_before = collections.Counter()  # .jsonl lines in earlier tasks.
  jobs = _make_jobs(files)
  if tokenizer.identity == ByteTokenizer.identity:
    # Byte "tokenizing" is a memcpy: shipping its output between processes
    # costs more than it saves (31 MB stdlib: 0.3 s here vs 1.4 s pooled).
    workers = 1
  bar = tqdm(total=total_bytes, unit="B", unit_scale=True, file=sys.stderr,
             desc="tokenizing", disable=not progress)
  results = _ordered_results(jobs, workers, (tokenizer_spec, text_key))
  try:
    for job, job_results in zip(jobs, results):
      for (path, is_jsonl, _, _), r in zip(job, job_results):
        if "error" in r:
          line, msg = r["error"]
          if line is None:
            raise UserError(f"input file {path!r} {msg}; fix its permissions "
                            "or leave it out of --input")
          raise UserError(
              f"{path}:{lines_before[path] + line}: line {msg}; every .jsonl "
              f"line must be a JSON object with a string {text_key!r} field "
              "(choose the field with --text-key)")
        skipped_binary += r.get("binary", False)
        for line, tokens in r["docs"]:
          if tokens.size <= 1:  # Only EOS: the document was empty.
            continue
          key = keys[path]
          if is_jsonl:
            key = f"{key}:{lines_before[path] + line}"
          splitter.add(key, tokens)
        lines_before[path] += r["lines"]
        bytes_read += r["bytes"]
        bar.update(r["bytes"])
    splitter.finish()
    if splitter.num_docs == 0:
      raise UserError(
          f"empty corpus: the {len(files)} input files hold no non-empty "
          f"documents ({skipped_binary} skipped as binary); check --input "
          "and --text-key")
    headers = [w.close() for w in writers]
  except BaseException:
    for w in writers:
      w.abort()
    raise
  finally:
    results.close()  # Stops the worker pool even when we bail out early.
    bar.close()
  seconds = time.perf_counter() - started
  train, val = headers
  return {
      "train_prefix": f"{output}.train",
      "val_prefix": f"{output}.val",
      "tokenizer": tokenizer.identity,
      "vocab_size": tokenizer.vocab_size,
      "files": len(files),
      "skipped_binary": skipped_binary,
      "documents": train["num_docs"] + val["num_docs"],
      "train_documents": train["num_docs"],
      "val_documents": val["num_docs"],
      "train_tokens": train["num_tokens"],
      "val_tokens": val["num_tokens"],
      "bytes_read": bytes_read,
      "seconds": seconds,
      "bytes_per_second": bytes_read / max(seconds, 1e-9),
  }


def index_files(inputs: list[str], output: str, tokenizer_spec: str = "byte",
                val_fraction: float = 0.01, workers: int | None = None,
                text_key: str = "text", seed: int = 0, progress: bool = True,
                source: dict | None = None) -> dict:
  """Indexes files/directories/globs `inputs` into `output`.{train,val}."""
  files = collect_files(inputs)
  if not files:
    raise UserError(
        f"empty corpus: no input files found in {', '.join(inputs)}; check "
        "--input (hidden files and directories are skipped)")
  return index_sources(files, output, tokenizer_spec, val_fraction, workers,
                       text_key, seed, progress, source)


def format_summary(s: dict) -> str:
  return (
      f"indexed {s['documents']} documents from {s['files']} files "
      f"({s['skipped_binary']} binary files skipped)\n"
      f"  train: {s['train_documents']} docs, {s['train_tokens']} tokens -> "
      f"{s['train_prefix']}.{{bin,idx,json}}\n"
      f"  val:   {s['val_documents']} docs, {s['val_tokens']} tokens -> "
      f"{s['val_prefix']}.{{bin,idx,json}}\n"
      f"  read {s['bytes_read']} bytes in {s['seconds']:.2f} s "
      f"({s['bytes_per_second'] / 1e6:.1f} MB/s), tokenizer {s['tokenizer']}")


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
      description="Tokenize text files into maxtrain train/val token stores.")
  parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                      help="files, directories (recursive) or globs")
  parser.add_argument("--output", required=True, metavar="PREFIX",
                      help="writes PREFIX.train.* and PREFIX.val.*")
  parser.add_argument("--tokenizer", default="byte",
                      help="'byte' or a local tokenizer.json (default: byte)")
  parser.add_argument("--val-fraction", type=float, default=0.01)
  parser.add_argument("--workers", type=int, default=os.cpu_count(),
                      help="tokenizer processes (default: all cores; the byte "
                      "tokenizer always runs in-process, that is faster)")
  parser.add_argument("--text-key", default="text",
                      help="field holding the text in .jsonl files")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the train/val split")
  args = parser.parse_args(argv)
  try:
    summary = index_files(args.input, args.output, args.tokenizer,
                          args.val_fraction, args.workers, args.text_key,
                          args.seed)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(format_summary(summary))


if __name__ == "__main__":
  main()
