"""Tokenizes text files into train/val token stores (see `store.py`).

Inputs are files, directories (walked recursively, hidden entries skipped) and
globs. `.jsonl` files hold one document per line (the `--text-key` field);
any other file is one UTF-8 document, unless it contains NUL bytes, in which
case it is skipped as binary. Every document is stored as its tokens followed
by EOS, the document boundary the loader packs across.

Text that is not valid UTF-8 follows `--errors`: `strict` stops (exit 2) at
the first invalid byte, naming the file and byte offset; `replace` (the
default) decodes invalid sequences as U+FFFD; `skip` leaves the document out
(a whole file, or one .jsonl line). Either way each affected file is counted
and listed, with zero-byte files, in the summary and the header's `source`.

`--verify PREFIX` re-reads a finished store: offsets, every id against the
header, and the checksum; it names the first bad document.

The train/val split is per document and depends only on the seed and the
document's name (its path relative to the input directory, plus the line
number for .jsonl), so it is stable across runs, worker counts and machines.

Usage: python tools/index_data.py --input DIR --output data/mycorpus
"""

from __future__ import annotations

import argparse
import codecs
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

from maxtrain.data.store import StoreWriter, TokenStore, token_dtype
from maxtrain.data.tokenizer import ByteTokenizer, load_tokenizer
from maxtrain.errors import UserError

_JOB_BYTES = 4 << 20  # Input bytes per worker job: amortizes IPC, bounds RAM.
_JOB_FILES = 256
ERRORS = ("strict", "replace", "skip")  # --errors choices; see the docstring.
_LISTED = 100  # Files named per category in a header's `source`.


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
_errors = "replace"
_dtype = np.dtype(np.uint16)
_replaced = 0  # Invalid sequences replaced since the last `_decode`.


def _count_and_replace(e: UnicodeError) -> tuple[str, int]:
  global _replaced
  _replaced += 1
  return "\ufffd", e.end


codecs.register_error("maxtrain-count-replace", _count_and_replace)


def _init(tokenizer_spec: str, text_key: str, errors: str = "replace") -> None:
  global _tokenizer, _text_key, _errors, _dtype
  _tokenizer = load_tokenizer(tokenizer_spec)
  _text_key = text_key
  _errors = errors
  _dtype = token_dtype(_tokenizer.vocab_size)


class _Invalid(Exception):
  """Text that is not valid UTF-8 under --errors=strict|skip."""

  def __init__(self, offset: int):
    super().__init__(offset)
    self.offset = offset


def _decode(data: bytes) -> tuple[str, int, int]:
  """(text, invalid sequences replaced, byte offset of the first or -1).

  Raises _Invalid on invalid input unless --errors=replace.
  """
  global _replaced
  try:
    return data.decode("utf-8"), 0, -1
  except UnicodeDecodeError as e:
    first = e.start
  if _errors != "replace":
    raise _Invalid(first)
  _replaced = 0
  text = data.decode("utf-8", errors="maxtrain-count-replace")
  return text, _replaced, first


def _clean(text: str) -> tuple[str, int]:
  """Lone surrogates (from JSON escapes such as "\\ud800"), like bad bytes."""
  global _replaced
  try:
    text.encode("utf-8")
    return text, 0
  except UnicodeEncodeError as e:
    first = e.start
  _replaced = 0
  if _errors != "replace":
    raise _Invalid(-1 - first)  # Negative: a character index, not a byte.
  _replaced = 0
  text = text.encode("utf-16-le", "surrogatepass").decode(
      "utf-16-le", errors="maxtrain-count-replace")
  return text, _replaced


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
    return {"error": (None, f"could not be read ({e.strerror or e})",
                      "fix its permissions or leave it out of --input")}


_UTF8_FIX = ("re-encode it as UTF-8, or pass --errors=replace (decode as "
             "U+FFFD) or --errors=skip (leave it out)")


def _read_task(path: str, is_jsonl: bool, start: int,
               end: int) -> dict[str, Any]:
  """Tokenizes one task. "invalid": sequences replaced, or documents skipped
  (--errors=skip); "first_invalid": the file byte offset of the first one."""
  if not is_jsonl:
    with open(path, "rb") as f:
      data = f.read()
    out = {"docs": [], "bytes": len(data), "lines": 0, "invalid": 0}
    if b"\0" in data:
      return {**out, "binary": True}
    try:
      text, out["invalid"], first = _decode(data)
    except _Invalid as e:
      if _errors == "strict":
        return {"error": (None, f"is not valid UTF-8 at byte {e.offset}",
                          _UTF8_FIX)}
      return {**out, "invalid": 1, "first_invalid": e.offset}  # Skipped.
    if out["invalid"]:
      out["first_invalid"] = first
    out["docs"] = [(0, _encode(text))]
    return out
  docs, n_bytes, n_lines, invalid, first_invalid = [], 0, 0, 0, None
  with open(path, "rb") as f:
    if start > 0:  # Lines belong to the task in which they start.
      f.seek(start - 1)
      if f.read(1) != b"\n":
        f.readline()
    while f.tell() < end:
      line_start = f.tell()
      line = f.readline()
      if not line:
        break
      n_bytes += len(line)
      n_lines += 1
      if not line.strip():
        continue
      try:
        decoded, replaced, first = _decode(line)
        record = json.loads(decoded)
        if not isinstance(record, dict) or _text_key not in record:
          return {"error": (n_lines, f"has no {_text_key!r} field", None)}
        text = record[_text_key]
        if not isinstance(text, str):
          return {"error": (n_lines, f"field {_text_key!r} is "
                            f"{type(text).__name__}, not a string", None)}
        text, surrogates = _clean(text)
      except ValueError as e:
        return {"error": (n_lines, f"is not valid JSON ({e})", None)}
      except _Invalid as e:
        where = (f"byte {line_start + e.offset}" if e.offset >= 0 else
                 f"character {-1 - e.offset} of its {_text_key!r} field "
                 "(a lone surrogate escape)")
        if _errors == "strict":
          return {"error": (n_lines, f"is not valid UTF-8 at {where}",
                            _UTF8_FIX)}
        invalid += 1  # --errors=skip: one line left out.
        if first_invalid is None:
          first_invalid = line_start + max(e.offset, 0)
        continue
      if replaced or surrogates:
        invalid += replaced + surrogates
        if first_invalid is None:
          first_invalid = line_start + max(first, 0)
      docs.append((n_lines, _encode(text)))
  out = {"docs": docs, "bytes": n_bytes, "lines": n_lines, "invalid": invalid}
  if first_invalid is not None:
    out["first_invalid"] = first_invalid
  return out


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
                  source: dict | None = None, errors: str = "replace") -> dict:
  """Tokenizes `files` into `output`.train / `output`.val; returns a summary.

  Without `source`, the headers' `source` describes the input, including
  the files with invalid UTF-8 and the zero-byte ones; a given `source` (a
  caller's fingerprint) is stored as is.
  """
  from tqdm import tqdm  # Only the indexer needs it.

  if not 0.0 <= val_fraction < 1.0:
    raise UserError(
        f"val fraction {val_fraction} is outside [0, 1); pass e.g. 0.01")
  if errors not in ERRORS:
    raise UserError(f"errors={errors!r}; pass one of {', '.join(ERRORS)}")
  workers = (os.cpu_count() or 1) if workers is None else workers
  if workers < 1:
    raise UserError(f"workers={workers}; pass a positive number of workers")
  if not files:
    raise UserError("empty corpus: no input files found; check --input")
  tokenizer = load_tokenizer(tokenizer_spec)
  total_bytes = sum(f.size for f in files)
  own_source = source is None
  if own_source:
    source = {"num_files": len(files), "bytes": total_bytes,
              "val_fraction": val_fraction, "seed": seed, "errors": errors}
  started = time.perf_counter()
  writers = []
  try:
    for split in ("train", "val"):
      writers.append(StoreWriter(f"{output}.{split}", tokenizer.vocab_size,
                                 tokenizer.identity, source))
  except UserError:
    for w in writers:
      w.abort()
    raise
  splitter = _Splitter(*writers, val_fraction, seed)
  keys = {f.path: f.key for f in files}
  bytes_read = skipped_binary = 0
  lines_before = collections.Counter()  # .jsonl lines in earlier tasks.
  file_bytes = collections.Counter()
  invalid: dict[str, dict[str, int]] = {}  # path -> {"count", "first_byte"}
  jobs = _make_jobs(files)
  if tokenizer.identity == ByteTokenizer.identity:
    # Byte "tokenizing" is a memcpy: shipping its output between processes
    # costs more than it saves (31 MB stdlib: 0.3 s here vs 1.4 s pooled).
    workers = 1
  bar = tqdm(total=total_bytes, unit="B", unit_scale=True, file=sys.stderr,
             desc="tokenizing", disable=not progress)
  results = _ordered_results(jobs, workers, (tokenizer_spec, text_key, errors))
  try:
    for job, job_results in zip(jobs, results):
      for (path, is_jsonl, _, _), r in zip(job, job_results):
        if "error" in r:
          line, msg, fix = r["error"]
          if line is None:
            raise UserError(f"input file {path!r} {msg}; {fix}")
          raise UserError(
              f"{path}:{lines_before[path] + line}: line {msg}; " + (fix or
              f"every .jsonl line must be a JSON object with a string "
              f"{text_key!r} field (choose the field with --text-key)"))
        skipped_binary += r.get("binary", False)
        if r.get("invalid"):
          entry = invalid.setdefault(
              path, {"count": 0, "first_byte": r["first_invalid"]})
          entry["count"] += r["invalid"]
        for line, tokens in r["docs"]:
          if tokens.size <= 1:  # Only EOS: the document was empty.
            continue
          key = keys[path]
          if is_jsonl:
            key = f"{key}:{lines_before[path] + line}"
          splitter.add(key, tokens)
        lines_before[path] += r["lines"]
        file_bytes[path] += r["bytes"]
        bytes_read += r["bytes"]
        bar.update(r["bytes"])
    splitter.finish()
    empty_files = [f.path for f in files if file_bytes[f.path] == 0]
    report = _input_report(errors, invalid, empty_files)
    if splitter.num_docs == 0:
      raise UserError(
          f"empty corpus: the {len(files)} input files hold no non-empty "
          f"documents ({skipped_binary} skipped as binary, "
          f"{len(empty_files)} zero-byte, {len(invalid)} with invalid UTF-8 "
          f"under --errors={errors}); check --input and --text-key")
    if own_source:
      source.update(_listed(report))  # The writers hold this dict.
    headers = [w.close() for w in writers]
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
      **report,
      "documents": train["num_docs"] + val["num_docs"],
      "train_documents": train["num_docs"],
      "val_documents": val["num_docs"],
      "train_tokens": train["num_tokens"],
      "val_tokens": val["num_tokens"],
      "bytes_read": bytes_read,
      "seconds": seconds,
      "bytes_per_second": bytes_read / max(seconds, 1e-9),
  }


def _input_report(errors: str, invalid: dict[str, dict[str, int]],
                  empty_files: list[str]) -> dict[str, Any]:
  """What the input held that was not plain UTF-8 text, per file."""
  return {
      "errors": errors,
      # --errors=replace: sequences replaced; skip: documents left out.
      "invalid_utf8_files": len(invalid),
      "invalid_utf8_count": sum(e["count"] for e in invalid.values()),
      "invalid_utf8": invalid,
      "empty_files": empty_files,
  }


def _listed(report: dict[str, Any]) -> dict[str, Any]:
  """The report for a header: at most _LISTED files named per category."""
  out = dict(report)
  out["invalid_utf8"] = dict(list(report["invalid_utf8"].items())[:_LISTED])
  out["num_empty_files"] = len(report["empty_files"])
  out["empty_files"] = report["empty_files"][:_LISTED]
  return out


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


def _names(paths: Sequence[str], shown: int = 5) -> str:
  more = f", ... and {len(paths) - shown} more" if len(paths) > shown else ""
  return ", ".join(paths[:shown]) + more


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
  invalid = s.get("invalid_utf8") or {}
  if invalid:
    what = ("invalid sequences replaced with U+FFFD" if s["errors"] == "replace"
            else "documents skipped")
    per_file = [f"{p} ({e['count']}, first at byte {e['first_byte']})"
                for p, e in invalid.items()]
    lines.append(
        f"  invalid UTF-8 (--errors={s['errors']}): {len(invalid)} files, "
        f"{s['invalid_utf8_count']} {what}: {_names(per_file)}")
  if s.get("empty_files"):
    lines.append(f"  zero-byte files: {len(s['empty_files'])}: "
                 f"{_names(s['empty_files'])}")
  return "\n".join(lines)


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
  """Usage mistakes are one line too: exit 2, no usage dump."""

  def error(self, message: str):
    self.exit(2, f"error: {message} (see --help)\n")


def main(argv: Sequence[str] | None = None) -> None:
  parser = _Parser(
      description="Tokenize text files into maxtrain train/val token stores, "
      "or verify a store.")
  parser.add_argument("--input", nargs="+", metavar="PATH",
                      help="files, directories (recursive) or globs")
  parser.add_argument("--output", metavar="PREFIX",
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
  parser.add_argument("--errors", choices=ERRORS, default="replace",
                      help="text that is not valid UTF-8: stop (strict), "
                      "decode it as U+FFFD (replace, default) or leave the "
                      "document out (skip); counted and listed either way")
  args = parser.parse_args(argv)
  if args.verify is None and (args.input is None or args.output is None):
    parser.error("pass --input and --output to index, or --verify PREFIX")
  try:
    if args.verify is not None:
      print(verify_store(args.verify))
      return
    summary = index_files(args.input, args.output, args.tokenizer,
                          args.val_fraction, args.workers, args.text_key,
                          args.seed, progress=sys.stderr.isatty(),
                          errors=args.errors)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(format_summary(summary))


if __name__ == "__main__":
  main()
