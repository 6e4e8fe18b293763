"""The documentation still points at things that exist: in README.md and docs/*.md every relative link
(and anchor) resolves, and every command-line example names a module, config file, tool, config key
and maxtrain/ file that exists. The code moves; these catch the sentence it leaves behind."""

import importlib
import re
from pathlib import Path

import pytest

from maxtrain import config as config_lib

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
REPO_DIRS = ("maxtrain/", "configs/", "tools/", "tests/", "launch/", "docs/", ".ci/")
SUBPACKAGES = {p.name for p in (REPO / "maxtrain").iterdir() if (p / "__init__.py").exists()}
SOURCE_NAMES = {p.name for d in ("maxtrain", "configs", "tools", "tests") for p in (REPO / d).rglob("*.py")}
# The README's two Quickstart commands; .ci/run runs the second verbatim.
TRAIN_COMMAND = "python3 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/python -m maxtrain.train"


def flat_keys(cfg, prefix=""):
  keys = set()
  for name, value in cfg.items():
    keys.add(prefix + name)
    if hasattr(value, "items"):
      keys |= flat_keys(value, prefix + name + ".")
  return keys


KEYS = flat_keys(config_lib.base_config())
SECTIONS = {k for k in KEYS if "." not in k and hasattr(config_lib.base_config()[k], "items")}


def split_fences(text: str) -> tuple[str, list[str]]:
  """(the prose with fenced blocks blanked, the fenced blocks' contents)."""
  prose, blocks, block = [], [], None
  for line in text.splitlines():
    if line.lstrip().startswith("```"):
      if block is None:
        block = []
      else:
        blocks.append("\n".join(block))
        block = None
      prose.append("")
    elif block is not None:
      block.append(line)
      prose.append("")
    else:
      prose.append(line)
  return "\n".join(prose), blocks


def inline_code(prose: str) -> list[str]:
  return re.findall(r"`([^`\n]+)`", prose)


def slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().replace("`", "").lower())
  return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
  prose, _ = split_fences(path.read_text())
  found, seen = set(), {}
  for match in re.finditer(r"^#{1,6} (.+)$", prose, re.M):
    base = slug(match.group(1))
    n = seen.get(base, 0)
    seen[base] = n + 1
    found.add(base if n == 0 else f"{base}-{n}")
  return found


def link_problems(path: Path, text: str) -> list[str]:
  prose, _ = split_fences(text)
  prose = re.sub(r"`[^`\n]+`", "", prose)
  problems = []
  for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose):
    if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
      continue
    file_part, _, anchor = target.partition("#")
    dest = (path.parent / file_part).resolve() if file_part else path
    if not dest.exists():
      problems.append(f"{path.name}: link to {target}: no file {dest}")
    elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
      problems.append(f"{path.name}: link to {target}: no heading #{anchor} in {dest.name}")
  return problems


def resolves(dotted: str) -> bool:
  """`maxtrain.a.b.name`: the longest module prefix imports and the rest are attributes of it."""
  parts = dotted.split(".")
  for cut in range(len(parts), 0, -1):
    module_path = REPO.joinpath(*parts[:cut])
    if module_path.with_suffix(".py").exists() or (module_path / "__init__.py").exists():
      obj = importlib.import_module(".".join(parts[:cut]))
      for attr in parts[cut:]:
        if not hasattr(obj, attr):
          return False
        obj = getattr(obj, attr)
      return True
  return False


def placeholder(name: str) -> bool:
  """`maxtrain.X`, `maxtrain/cli/X.py`, `PREFIX`: a name the reader fills in."""
  return re.search(r"(^|[./])[A-Z]+(?=[./]|$)", name) is not None


def check_key(where: str, key: str, problems: list[str]):
  if key not in KEYS:
    problems.append(f"{where}: config key {key} does not exist in base_config()")


def command_problems(path: Path, text: str) -> list[str]:
  prose, blocks = split_fences(text)
  spans = inline_code(prose)
  code = "\n".join([*blocks, *spans])
  where, problems = path.name, []
  for module in re.findall(r"-m\s+(maxtrain(?:\.\w+)+)", code):
    if not placeholder(module) and not resolves(module):
      problems.append(f"{where}: python -m {module}: no such module")
  for config in re.findall(r"--config=(configs/[\w./-]+)", code):
    if not (REPO / config).is_file():
      problems.append(f"{where}: --config={config}: no such file")
  for key in re.findall(r"--config\.([A-Za-z_][\w.]*\w)", code):
    check_key(where, key, problems)
  for file in re.findall(r"(?<![\w./<-])((?:" + "|".join(map(re.escape, REPO_DIRS)) + r")[\w./-]*\w)", code):
    if not placeholder(file) and not (REPO / file).exists():
      problems.append(f"{where}: {file}: no such file or directory")
  for span in spans:
    span = span.strip()
    first = re.match(r"([a-z_]+)/[\w/]+\.py$", span)
    if first and first.group(1) in SUBPACKAGES and not (REPO / "maxtrain" / span).exists():
      problems.append(f"{where}: `{span}`: no maxtrain/{span}")
    if re.fullmatch(r"[\w-]+\.py", span) and span not in SOURCE_NAMES:
      problems.append(f"{where}: `{span}`: no file of that name in maxtrain/, configs/, tools/ or tests/")
    key = re.match(r"([a-z_]+)\.([a-z_][\w.]*\w)(=\S*)?$", span)
    if key and key.group(1) in SECTIONS and "/" not in span:
      check_key(where, f"{key.group(1)}.{key.group(2)}", problems)
    dotted = re.match(r"(maxtrain(?:\.\w+)+)(\(.*\))?$", span)
    if dotted and not resolves(dotted.group(1)):
      problems.append(f"{where}: `{span}`: {dotted.group(1)} does not resolve")
  problems += key_table_problems(where, prose)
  return problems


def key_table_problems(where: str, prose: str) -> list[str]:
  """Rows of a `| key | default | meaning |` table: `section.a`, `b` names section.a and section.b."""
  problems, in_table = [], False
  for line in prose.splitlines():
    if re.match(r"\|\s*key\s*\|", line):
      in_table = True
    elif not line.startswith("|"):
      in_table = False
    elif in_table and not line.startswith("| ---"):
      names = inline_code(line.split("|")[1])
      parent = names[0].rpartition(".")[0] if names else ""
      for name in names:
        if "*" not in name:
          check_key(where, name if "." in name or not parent else f"{parent}.{name}", problems)
  return problems


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path):
  assert link_problems(path, path.read_text()) == []


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_line_example_resolves(path):
  assert command_problems(path, path.read_text()) == []


def test_every_guide_is_linked_from_the_readme():
  readme = (REPO / "README.md").read_text()
  linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", readme))
  assert {p.name for p in DOCS[1:]} - linked == set()


def test_the_quickstart_commands_are_unchanged():
  _, blocks = split_fences((REPO / "README.md").read_text())
  ci_command = next(line for line in (REPO / ".ci/run").read_text().splitlines() if line.startswith("python3 -m venv .venv "))
  assert TRAIN_COMMAND in blocks and ci_command in blocks


BROKEN = """# Broken

See [the guide](missing.md), [a heading](checkpoints.md#no-such-heading), [here](#broken) and [gone](#nope).

```bash
python -m maxtrain.no_such_module --config=configs/no_such.py --config.model.no_such_key=1
python tools/no_such_tool.py --config.steps=3
```

The loop is in `maxtrain/trainer.py` (`loop/trainer.py` now, next to `rollback.py`, not `optim.py`), its key
`optimizer.no_such=2`;
`maxtrain.config.no_such_function()`.

| key | default | meaning |
| --- | --- | --- |
| `model.d_model`, `no_such_sibling` | 256 | a row naming one real key and one that is not |
"""


def test_the_checker_catches_broken_links_and_examples(tmp_path):
  doc = tmp_path / "docs" / "broken.md"
  doc.parent.mkdir()
  (tmp_path / "docs" / "checkpoints.md").write_text("# Checkpoints\n")
  doc.write_text(BROKEN)
  links = link_problems(doc, BROKEN)
  assert len(links) == 3, links
  assert any("missing.md" in p for p in links) and any("no-such-heading" in p for p in links)
  assert any("#nope" in p for p in links)
  found = "\n".join(command_problems(doc, BROKEN))
  for culprit in ["maxtrain.no_such_module", "configs/no_such.py", "model.no_such_key", "tools/no_such_tool.py",
                  "maxtrain/trainer.py", "`optim.py`", "optimizer.no_such", "maxtrain.config.no_such_function",
                  "model.no_such_sibling"]:
    assert culprit in found, culprit
  for fine in ["config key steps ", "loop/trainer.py", "rollback.py", "model.d_model "]:
    assert fine not in found + " ", fine
