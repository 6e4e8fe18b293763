"""Tokenizes text files into train/val token stores (see `store.py`).

Inputs are files, directories (walked recursively, hidden entries skipped) and
globs; `decode.py` turns them into documents (.jsonl lines, UTF-8 under
`--errors`). Every document is stored as its tokens followed by EOS, the
document boundary the loader packs across.

`--verify PREFIX` re-reads a finished store: offsets, every id against the
header, and the checksum; it names the first bad document.

The train/val split is per document and depends only on the seed and the
document's name (its path relative to the input directory, plus the line
number for .jsonl), so it is stable across runs, worker counts and machines.

Usage: python tools/index_data.py --input DIR --output data/mycorpus
       (several stores: --input web/ --output stores/web --input code/ --output stores/code)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import fnmatch
import glob
import hashlib
import os
import sys
import time
from typing import Any, Iterator, Sequence

import numpy as np

from maxtrain.data import decode, tokenize_workers
from maxtrain.data.store import StoreWriter, TokenStore
from maxtrain.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from maxtrain.errors import UserError, printable

_JOB_BYTES = 4 << 20  # Input bytes per worker job: amortizes IPC, bounds RAM.
_JOB_FILES = 256


@dataclasses.dataclass(frozen=True)
class SourceFile:
  """An input file and the stable name its split decision hashes."""
  path: str
  key: str
  size: int


def expand_glob(spec: str) -> Iterator[str]:
  """The paths matching `spec` as glob.glob(spec, recursive=True) finds them, except that `**` does
  not descend into symlinked directories: glob.glob follows them, and a symlink loop (`a/loop -> ..`)
  then multiplies the paths at every level, a hang with two loops. Hidden names match only a pattern
  that starts with '.', as in glob."""
  parts = spec.split(os.sep)
  root = os.sep if spec.startswith(os.sep) else os.curdir
  yield from (os.path.normpath(p) if spec.startswith(os.sep) else os.path.relpath(p)
              for p in _match(root, [p for p in parts if p]))


def _match(path: str, parts: list[str]) -> Iterator[str]:
  if not parts:
    yield path
    return
  head, rest = parts[0], parts[1:]
  if not glob.has_magic(head):
    if os.path.lexists(os.path.join(path, head)):
      yield from _match(os.path.join(path, head), rest)
    return
  try:
    names = sorted(os.listdir(path)) if os.path.isdir(path) else []
  except OSError:
    names = []  # unreadable: glob.glob skips it too
  names = [n for n in names if head.startswith(".") or not n.startswith(".")]
  if head == "**":
    yield from _match(path, rest)  # zero directories
    for name in names:
      sub = os.path.join(path, name)
      if os.path.isdir(sub) and not os.path.islink(sub):
        yield from _match(sub, parts)
    return
  for name in fnmatch.filter(names, head):
    yield from _match(os.path.join(path, name), rest)


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

  def unreadable(e: OSError) -> None:
    raise UserError(
        f"input directory {e.filename!r} could not be read ({e.strerror or e});"
        " fix its permissions or leave it out of --input")

  def add_tree(root: str, base: str) -> None:
    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
      dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
      for name in sorted(filenames):
        if not name.startswith("."):
          add(os.path.join(dirpath, name), base)

  for spec in inputs:
    if glob.has_magic(spec):
      matches = sorted(expand_glob(spec))
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
  # surrogateescape: a file name that is not UTF-8 hashes as its raw bytes (UTF-8 names are unchanged)
  digest = hashlib.blake2b(f"{seed}\0{key}".encode("utf-8", "surrogateescape"), digest_size=8).digest()
  return int.from_bytes(digest, "little") / 2.0**64


def _make_jobs(
    files: Sequence[SourceFile]) -> list[list[tokenize_workers.Task]]:
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


class _Assembler:
  """Folds task results, in input order, into the splitter and input report.

  Workers number .jsonl lines within their task; adding the lines of earlier
  tasks gives file line numbers, which name documents and errors.
  """

  def __init__(self, files: Sequence[SourceFile], splitter: _Splitter,
               report: decode.InputReport, text_key: str):
    self.keys = {f.path: f.key for f in files}
    self.splitter, self.report, self.text_key = splitter, report, text_key
    self.lines_before: collections.Counter[str] = collections.Counter()
    self.bytes_read = 0

  def add(self, task: tokenize_workers.Task,
          result: tokenize_workers.TaskResult) -> None:
    path, is_jsonl = task[:2]
    if result.error is not None:
      raise UserError(result.error.message(path, self.lines_before[path],
                                           self.text_key))
    self.report.add(path, result.tally)
    for line, tokens in result.docs:
      if tokens.size <= 1:  # Only EOS: the document was empty.
        continue
      key = self.keys[path]
      if is_jsonl:
        key = f"{key}:{self.lines_before[path] + line}"
      self.splitter.add(key, tokens)
    self.lines_before[path] += result.tally.num_lines
    self.bytes_read += result.tally.num_bytes


def _check_args(files: Sequence[SourceFile], val_fraction: float, errors: str,
                workers: int | None) -> int:
  """Validates `index_sources`' arguments; returns the number of workers."""
  if not 0.0 <= val_fraction < 1.0:
    raise UserError(
        f"val fraction {val_fraction} is outside [0, 1); pass e.g. 0.01")
  if errors not in decode.ERRORS:
    raise UserError(
        f"errors={errors!r}; pass one of {', '.join(decode.ERRORS)}")
  workers = (os.cpu_count() or 1) if workers is None else workers
  if workers < 1:
    raise UserError(f"workers={workers}; pass a positive number of workers")
  if not files:
    raise UserError("empty corpus: no input files found; check --input")
  return workers


def _open_writers(output: str, tokenizer: Tokenizer,
                  source: dict) -> list[StoreWriter]:
  """The train and val writers; neither is left behind if one fails."""
  writers = []
  try:
    for split in ("train", "val"):
      writers.append(StoreWriter(f"{output}.{split}", tokenizer.vocab_size,
                                 tokenizer.identity, source))
  except UserError:
    for w in writers:
      w.abort()
    raise
  return writers


@contextlib.contextmanager
def _aborting(writers: list[StoreWriter], output: str) -> Iterator[None]:
  """Aborts the writers on any failure, so no partial store is left."""
  try:
    yield
  except OSError as e:  # Reading is reported by the workers: this is writing.
    for w in writers:
      w.abort()
    raise UserError(
        f"could not write token store {output!r} ({e.filename or output}: "
        f"{e.strerror or e}); free space there or choose another --output"
    ) from None
  except BaseException:
    for w in writers:
      w.abort()
    raise


def _check_not_empty(files: Sequence[SourceFile], num_docs: int,
                     report: dict[str, Any], num_binary: int) -> None:
  """Says why nothing was indexed: what the input held instead."""
  if num_docs == 0:
    raise UserError(
        f"empty corpus: the {len(files)} input files hold no non-empty "
        f"documents ({num_binary} skipped as binary, "
        f"{len(report['empty_files'])} zero-byte, "
        f"{report['invalid_utf8_files']} with invalid UTF-8 under "
        f"--errors={report['errors']}); check --input and --text-key")


def index_sources(files: Sequence[SourceFile], output: str,
                  tokenizer_spec: str = "byte", val_fraction: float = 0.01,
                  workers: int | None = None, text_key: str = "text",
                  seed: int = 0, progress: bool = True,
                  source: dict | None = None, errors: str = "replace") -> dict:
  """Tokenizes `files` into `output`.train / `output`.val; returns a summary.

  Without `source`, the headers' `source` describes the input, including
  the files with invalid UTF-8 and the zero-byte ones; a given `source` (a
  caller's fingerprint) is stored as is.
  """
  from tqdm import tqdm  # Only the indexer needs it.

  workers = _check_args(files, val_fraction, errors, workers)
  tokenizer = load_tokenizer(tokenizer_spec)
  total_bytes = sum(f.size for f in files)
  own_source = source is None
  if own_source:
    source = {"num_files": len(files), "bytes": total_bytes,
              "val_fraction": val_fraction, "seed": seed, "errors": errors}
  started = time.perf_counter()
  writers = _open_writers(output, tokenizer, source)
  splitter = _Splitter(*writers, val_fraction, seed)
  inputs = decode.InputReport(errors)
  assembler = _Assembler(files, splitter, inputs, text_key)
  jobs = _make_jobs(files)
  if tokenizer.identity == ByteTokenizer.identity:
    # Byte "tokenizing" is a memcpy: shipping its output between processes
    # costs more than it saves (31 MB stdlib: 0.3 s here vs 1.4 s pooled).
    workers = 1
  bar = tqdm(total=total_bytes, unit="B", unit_scale=True, file=sys.stderr,
             desc="tokenizing", disable=not progress)
  results = tokenize_workers.ordered_results(jobs, workers, tokenizer_spec,
                                             text_key, errors)
  try:
    with _aborting(writers, output):
      for job, job_results in zip(jobs, results):
        for task, result in zip(job, job_results):
          assembler.add(task, result)
          bar.update(result.tally.num_bytes)
      splitter.finish()
      report = inputs.as_dict([f.path for f in files])
      _check_not_empty(files, splitter.num_docs, report, inputs.num_binary)
      if own_source:
        source.update(decode.for_header(report))  # The writers hold this dict.
      headers = [w.close() for w in writers]
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
      "skipped_binary": inputs.num_binary,
      **report,
      "documents": train["num_docs"] + val["num_docs"],
      "train_documents": train["num_docs"],
      "val_documents": val["num_docs"],
      "train_tokens": train["num_tokens"],
      "val_tokens": val["num_tokens"],
      "bytes_read": assembler.bytes_read,
      "seconds": seconds,
      "bytes_per_second": assembler.bytes_read / max(seconds, 1e-9),
  }


def index_files(inputs: list[str], output: str, tokenizer_spec: str = "byte",
                val_fraction: float = 0.01, workers: int | None = None,
                text_key: str = "text", seed: int = 0, progress: bool = True,
                source: dict | None = None, errors: str = "replace") -> dict:
  """Indexes files/directories/globs `inputs` into `output`.{train,val}."""
  files = collect_files(inputs)
  if not files:
    raise UserError(
        f"empty corpus: no input files found in {', '.join(inputs)}; check "
        "--input (hidden files and directories are skipped)")
  return index_sources(files, output, tokenizer_spec, val_fraction, workers,
                       text_key, seed, progress, source, errors)


def format_summary(s: dict) -> str:
  lines = [
      f"indexed {s['documents']} documents from {s['files']} files "
      f"({s['skipped_binary']} binary files skipped)",
      f"  train: {s['train_documents']} docs, {s['train_tokens']} tokens -> "
      f"{s['train_prefix']}.{{bin,idx,json}}",
      f"  val:   {s['val_documents']} docs, {s['val_tokens']} tokens -> "
      f"{s['val_prefix']}.{{bin,idx,json}}",
      f"  read {s['bytes_read']} bytes in {s['seconds']:.2f} s "
      f"({s['bytes_per_second'] / 1e6:.1f} MB/s), tokenizer {s['tokenizer']}"]
  return "\n".join(lines + decode.summary_lines(s))


def verify_store(prefix: str) -> str:
  """Fully checks the store `prefix` (or `prefix`.train and .val, as written by
  --output); returns a one-line summary or raises UserError."""
  prefixes = [prefix]
  if (not os.path.exists(prefix + ".json") and
      os.path.exists(prefix + ".train.json")):
    prefixes = [prefix + ".train", prefix + ".val"]
  started = time.perf_counter()
  parts = []
  for p in prefixes:
    store = TokenStore.open(p)
    store.verify()
    parts.append(f"{p}: {store.num_docs} docs, {store.num_tokens} tokens, "
                 f"max id {store.max_token_id} < vocab {store.vocab_size}")
  return (f"OK {'; '.join(parts)} (offsets, ids and checksum verified in "
          f"{time.perf_counter() - started:.2f} s)")


class _Parser(argparse.ArgumentParser):
  """Usage mistakes are bad input like any other: one line through the entry-point shell, exit 2, no usage dump."""

  def error(self, message: str):
    raise UserError(f"{message} (see --help)")


def parser() -> argparse.ArgumentParser:
  """`tools/index_data.py`'s flags (it runs `index` through the entry-point shell, maxtrain/cli/shell.py)."""
  parser = _Parser(
      description="Tokenize text files into maxtrain train/val token stores, "
      "or verify a store.")
  parser.add_argument("--input", nargs="+", metavar="PATH", action="append",
                      help="files, directories (recursive) or globs; repeat "
                      "--input and --output to build several stores, the k-th "
                      "--input into the k-th --output")
  parser.add_argument("--output", metavar="PREFIX", action="append",
                      help="writes PREFIX.train.* and PREFIX.val.*")
  parser.add_argument("--verify", metavar="PREFIX",
                      help="check a finished store fully (PREFIX.{bin,idx,json}"
                      ", or PREFIX.train and PREFIX.val) and exit")
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
  parser.add_argument("--errors", choices=decode.ERRORS, default="replace",
                      help="text that is not valid UTF-8: stop (strict), "
                      "decode it as U+FFFD (replace, default) or leave the "
                      "document out (skip); counted and listed either way")
  return parser


def index(args: argparse.Namespace) -> None:
  """Indexes `args.input` into the `args.output` stores, or verifies `args.verify`; UserError on bad input."""
  if args.verify is None and (args.input is None or args.output is None):
    raise UserError("pass --input and --output to index, or --verify PREFIX (see --help)")
  if args.verify is None:
    jobs = _jobs(args.input, args.output)
    if jobs is None:
      raise UserError(f"{len(args.output)} --output prefixes need as many --input groups, one per store; got "
                      f"{len(args.input)} (see --help)")
  if args.verify is not None:
    print(verify_store(args.verify))
    return
  for inputs, output in jobs:  # one store per (inputs, output): a mixture's sources
    summary = index_files(inputs, output, args.tokenizer, args.val_fraction, args.workers, args.text_key,
                          args.seed, progress=sys.stderr.isatty(), errors=args.errors)
    print(printable(format_summary(summary)), flush=True)


def _jobs(inputs: list[list[str]], outputs: list[str]
          ) -> list[tuple[list[str], str]] | None:
  """(inputs, output) per store: one --output takes every --input; several
  pair up with the --input groups in order (None when the counts differ)."""
  if len(outputs) == 1:
    return [([path for group in inputs for path in group], outputs[0])]
  if len(inputs) != len(outputs):
    return None
  return list(zip(inputs, outputs))
