"""Regenerates the shipped evaluation tasks' data (maxtrain/evaluation/tasks/*.jsonl) from the running
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
      if 24 <= len(s) <= 72 and not s.startswith(("#", '"', "'")) and "(" in s:
        lines.append(line.rstrip())
  return sorted(set(lines))


def split(line: str) -> tuple[str, str]:
  """A line cut after its first '(' : the call's name, then its arguments."""
  cut = line.index("(") + 1
  return line[:cut], line[cut:]


def main() -> None:
  rng = random.Random(0)
  lines = code_lines()
  picked = rng.sample(lines, 3 * N)
  with open(OUT / "pycode_mc.jsonl", "w") as f:
    for line in picked[:N]:
      prefix, answer = split(line)
      wrong = [split(other)[1] for other in rng.sample([x for x in lines if split(x)[1] != answer], 3)]
      label = rng.randrange(4)
      choices = wrong[:label] + [answer] + wrong[label:]
      f.write(json.dumps({"prefix": prefix, "choices": choices, "label": label}) + "\n")
  with open(OUT / "pycode_complete.jsonl", "w") as f:
    for line in picked[N:2 * N]:
      prefix, answer = split(line)
      f.write(json.dumps({"prefix": prefix, "answer": answer}) + "\n")
  with open(OUT / "pycode_ppl.jsonl", "w") as f:
    for i in range(N):
      f.write(json.dumps({"text": "\n".join(picked[2 * N + i:2 * N + i + 1] + rng.sample(lines, 2))}) + "\n")


if __name__ == "__main__":
  main()
