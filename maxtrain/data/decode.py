"""Turns input files into document texts, and tallies what was not plain text.

`.jsonl` files hold one document per line (the `--text-key` field); any other
file is one UTF-8 document, unless it contains NUL bytes, in which case it is
skipped as binary.

Text that is not valid UTF-8 follows `--errors`: `strict` stops (exit 2) at
the first invalid byte, naming the file and byte offset; `replace` (the
default) decodes invalid sequences as U+FFFD; `skip` leaves the document out
(a whole file, or one .jsonl line). Either way each affected file is counted
and listed, with zero-byte files, in the summary and the header's `source`.

Decoding runs in the tokenizer workers; `InputReport` gathers their tallies in
the parent.
"""

from __future__ import annotations

import codecs
import collections
import dataclasses
import json
from typing import Any, Iterator, Sequence

ERRORS = ("strict", "replace", "skip")  # --errors choices; see the docstring.
_LISTED = 100  # Files named per category in a header's `source`.
_UTF8_FIX = ("re-encode it as UTF-8, or pass --errors=replace (decode as "
             "U+FFFD) or --errors=skip (leave it out)")


class DecodeError(Exception):
  """Input that stops indexing, raised in a worker and reported by the parent.

  `line` counts within the task (None: the whole file); only the parent knows
  the lines of earlier tasks. `fix` None means the .jsonl format hint.
  """

  def __init__(self, line: int | None, what: str, fix: str | None = None):
    super().__init__(line, what, fix)  # All three, so it pickles back intact.
    self.line, self.what, self.fix = line, what, fix

  def message(self, path: str, lines_before: int, text_key: str) -> str:
    """For the user; `lines_before`: the .jsonl lines of earlier tasks."""
    if self.line is None:
      return f"input file {path!r} {self.what}; {self.fix}"
    return f"{path}:{lines_before + self.line}: line {self.what}; " + (
        self.fix or f"every .jsonl line must be a JSON object with a string "
        f"{text_key!r} field (choose the field with --text-key)")


@dataclasses.dataclass
class Tally:
  """What one task read; summed per file by `InputReport`."""
  num_bytes: int = 0
  num_lines: int = 0  # .jsonl lines, blank ones included.
  invalid: int = 0  # Sequences replaced, or documents skipped (--errors=skip).
  first_invalid: int | None = None  # File byte offset of the first of those.
  binary: bool = False

  def note_invalid(self, count: int, offset: int) -> None:
    self.invalid += count
    if self.first_invalid is None:
      self.first_invalid = offset


def documents(path: str, is_jsonl: bool, start: int, end: int, text_key: str,
              errors: str, tally: Tally) -> Iterator[tuple[int, str]]:
  """Yields (line number within the task, text): a whole file's, or those of
  the .jsonl lines that start in [start, end).

  Counts into `tally` as it goes; raises DecodeError on input that stops
  indexing, including a file that cannot be read.
  """
  try:
    if is_jsonl:
      yield from _jsonl_documents(path, start, end, text_key, errors, tally)
    else:
      yield from _file_document(path, errors, tally)
  except OSError as e:
    fix = "fix its permissions or leave it out of --input"
    raise DecodeError(None, f"could not be read ({e.strerror or e})",
                      fix) from None


def _file_document(path: str, errors: str,
                   tally: Tally) -> Iterator[tuple[int, str]]:
  with open(path, "rb") as f:
    data = f.read()
  tally.num_bytes = len(data)
  if b"\0" in data:
    tally.binary = True
    return
  try:
    text, replaced, first = _decode(data, errors)
  except _Invalid as e:
    if errors == "strict":
      raise DecodeError(None, f"is not valid UTF-8 at byte {e.offset}",
                        _UTF8_FIX) from None
    tally.note_invalid(1, e.offset)  # --errors=skip: the file is left out.
    return
  if replaced:
    tally.note_invalid(replaced, first)
  yield 0, text


def _jsonl_documents(path: str, start: int, end: int, text_key: str,
                     errors: str, tally: Tally) -> Iterator[tuple[int, str]]:
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
      tally.num_bytes += len(line)
      tally.num_lines += 1
      if line.strip():
        text = _jsonl_text(line, line_start, text_key, errors, tally)
        if text is not None:
          yield tally.num_lines, text


def _jsonl_text(line: bytes, line_start: int, text_key: str, errors: str,
                tally: Tally) -> str | None:
  """The text of the .jsonl line just counted; None: --errors=skip drops it."""
  n = tally.num_lines
  try:
    decoded, replaced, first = _decode(line, errors)
    record = json.loads(decoded)
    if not isinstance(record, dict) or text_key not in record:
      raise DecodeError(n, f"has no {text_key!r} field")
    text = record[text_key]
    if not isinstance(text, str):
      raise DecodeError(
          n, f"field {text_key!r} is {type(text).__name__}, not a string")
    text, surrogates = _clean(text, errors)
  except ValueError as e:
    raise DecodeError(n, f"is not valid JSON ({e})") from None
  except _Invalid as e:
    if errors == "strict":
      where = (f"byte {line_start + e.offset}" if e.offset >= 0 else
               f"character {-1 - e.offset} of its {text_key!r} field "
               "(a lone surrogate escape)")
      raise DecodeError(n, f"is not valid UTF-8 at {where}",
                        _UTF8_FIX) from None
    tally.note_invalid(1, line_start + max(e.offset, 0))  # The line is skipped.
    return None
  if replaced or surrogates:
    tally.note_invalid(replaced + surrogates, line_start + max(first, 0))
  return text


_replaced = 0  # Invalid sequences replaced since the last reset.


def _count_and_replace(e: UnicodeError) -> tuple[str, int]:
  global _replaced
  _replaced += 1
  return "\ufffd", e.end


codecs.register_error("maxtrain-count-replace", _count_and_replace)


class _Invalid(Exception):
  """Text that is not valid UTF-8 under --errors=strict|skip."""

  def __init__(self, offset: int):
    super().__init__(offset)
    self.offset = offset


def _decode(data: bytes, errors: str) -> tuple[str, int, int]:
  """(text, invalid sequences replaced, byte offset of the first or -1).

  Raises _Invalid on invalid input unless --errors=replace.
  """
  global _replaced
  try:
    return data.decode("utf-8"), 0, -1
  except UnicodeDecodeError as e:
    first = e.start
  if errors != "replace":
    raise _Invalid(first)
  _replaced = 0
  text = data.decode("utf-8", errors="maxtrain-count-replace")
  return text, _replaced, first


def _clean(text: str, errors: str) -> tuple[str, int]:
  """Lone surrogates (from JSON escapes such as "\\ud800"), like bad bytes."""
  global _replaced
  try:
    text.encode("utf-8")
    return text, 0
  except UnicodeEncodeError as e:
    first = e.start
  if errors != "replace":
    raise _Invalid(-1 - first)  # Negative: a character index, not a byte.
  _replaced = 0
  text = text.encode("utf-16-le", "surrogatepass").decode(
      "utf-16-le", errors="maxtrain-count-replace")
  return text, _replaced


class InputReport:
  """Per input file: invalid UTF-8 (count, first byte), zero bytes, binary."""

  def __init__(self, errors: str):
    self.errors = errors
    self.num_binary = 0
    self.invalid: dict[str, dict[str, int]] = {}  # path -> count, first_byte
    self._file_bytes: collections.Counter[str] = collections.Counter()

  def add(self, path: str, tally: Tally) -> None:
    self.num_binary += tally.binary
    if tally.invalid:
      entry = self.invalid.setdefault(
          path, {"count": 0, "first_byte": tally.first_invalid})
      entry["count"] += tally.invalid
    self._file_bytes[path] += tally.num_bytes

  def as_dict(self, paths: Sequence[str]) -> dict[str, Any]:
    """The summary's entries; `paths`: every input file, in order."""
    return {
        "errors": self.errors,
        # --errors=replace: sequences replaced; skip: documents left out.
        "invalid_utf8_files": len(self.invalid),
        "invalid_utf8_count": sum(e["count"] for e in self.invalid.values()),
        "invalid_utf8": self.invalid,
        "empty_files": [p for p in paths if self._file_bytes[p] == 0],
    }


def for_header(report: dict[str, Any]) -> dict[str, Any]:
  """`InputReport.as_dict` for a header: at most _LISTED files per category."""
  out = dict(report)
  out["invalid_utf8"] = dict(list(report["invalid_utf8"].items())[:_LISTED])
  out["num_empty_files"] = len(report["empty_files"])
  out["empty_files"] = report["empty_files"][:_LISTED]
  return out


def summary_lines(s: dict[str, Any]) -> list[str]:
  """The indexing summary's lines about invalid UTF-8 and zero-byte files."""
  lines = []
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
  return lines


def _names(paths: Sequence[str], shown: int = 5) -> str:
  more = f", ... and {len(paths) - shown} more" if len(paths) > shown else ""
  return ", ".join(paths[:shown]) + more
