"""The shipped tasks' data loader (lm-eval `custom_dataset`): the JSON file (a list of rows) next to the
task's YAML as a `datasets` test split, read from disk; nothing downloads."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load(data_file: str = "", **_) -> dict:
  import datasets

  rows = json.loads((HERE / data_file).read_text())
  return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
