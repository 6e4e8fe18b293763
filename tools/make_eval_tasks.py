"""Regenerates the shipped evaluation tasks' data (maxtrain/evaluation/tasks/*.json: a JSON list of rows,
not .jsonl, which the test store's indexer would read as documents with a `text` field) from the running
interpreter's standard library: `python tools/make_eval_tasks.py`. Deterministic for one stdlib; the
shipped files were made with Python 3.11. Lines are short so that every example fits the default model
(model.max_seq_len=1024, byte tokens)."""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "maxtrain" / "evaluation" / "tasks"
MODULES = ("json/encoder.py", "textwrap.py", "shlex.py", "fnmatch.py", "bisect.py", "heapq.py", "glob.py",
           "base64.py", "string.py", "copy.py", "calendar.py", "random.py")
N = 24  # examples per task: a few seconds on a CPU


def code_lines() -> list[str]:
  root = Path(sysconfig.get_paths()["stdlib"])
  lines = []
  for name in MODULES:
    for line in (root / name).read_text().splitlines():
      s = line.strip()
      if 24 <= len(s) <= 72 and not s.startswith(("#", '"', "'")) and "(" in s and " " in s:
        lines.append(line.rstrip())
  return sorted(set(lines))


def split(line: str) -> tuple[str, str]:
  """A line cut at its middle-most single space (after the indent): the start, then the rest with its
  leading space. A space starts a new word for byte-level BPE tokenizers too, so the rest's tokens are
  the same alone as after the start (no token spans the cut)."""
  body = len(line) - len(line.lstrip())
  cuts = [i for i in range(body + 1, len(line) - 1) if line[i] == " " and line[i - 1] != " " and line[i + 1] != " "]
  cut = min(cuts, key=lambda i: abs(i - (body + len(line)) / 2))
  return line[:cut], line[cut:]


def main() -> None:
  rng = random.Random(0)
  lines = code_lines()
  picked = rng.sample(lines, 3 * N)
  mc = []
  for line in picked[:N]:
    prefix, answer = split(line)
    wrong = [split(other)[1] for other in rng.sample([x for x in lines if split(x)[1] != answer], 3)]
    label = rng.randrange(4)
    mc.append({"prefix": prefix, "choices": wrong[:label] + [answer] + wrong[label:], "label": label})
  complete = [dict(zip(("prefix", "answer"), split(line))) for line in picked[N:2 * N]]
  ppl = [{"text": "\n".join(picked[2 * N + i:2 * N + i + 1] + rng.sample(lines, 2))} for i in range(N)]
  for name, rows in (("pycode_mc", mc), ("pycode_complete", complete), ("pycode_ppl", ppl)):
    (OUT / f"{name}.json").write_text("[\n" + ",\n".join(json.dumps(row) for row in rows) + "\n]\n")


if __name__ == "__main__":
  main()
