"""The shape of the code: packages that import only those below them (no import cycles), the mesh named
only in `sharding/` (tools included), tools that import the installed package, short functions, a
supervisor that starts without jax, `--help` generated from the declarations, every entry point through the
one shell (cli/shell.py), no ambient state (ContextVar) in models/ or sharding/, and a layout drawing
(docs/architecture.md) that matches the tree."""

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path
from typing import Mapping

import pytest

from maxtrain import config as config_lib
from maxtrain.sharding.mesh import AXES, DCN_AXES

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "maxtrain"
MODULES = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
           for p in sorted(PACKAGE.rglob("*.py"))}
# Mesh axis names: the ones in use and the ones the long-context and MoE work will add.
MESH_AXES = set(AXES) | set(DCN_AXES) | {"context", "expert"}
# Where a mesh axis may be spelled outside sharding/: the declaration of the `mesh.*` config keys.
AXIS_ALLOWED = {"maxtrain/config/keys.py": {"mesh.data", "mesh.fsdp", "mesh.expert", "mesh.context", "mesh.tensor",
                                         "mesh.dcn_data", "mesh.dcn_fsdp", "mesh.pipeline",
                                         "mesh.dcn_pipeline", "mesh.dcn_expert"}}
TOOLS = sorted((REPO / "tools").glob("*.py"))
MAX_FUNCTION_LINES = 80
LONG_ALLOWED = {("maxtrain/config/keys.py", "base_config")}  # a declaration: one documented line per key


def parse(path: Path) -> ast.Module:
  """The file's AST. Once more on CPython 3.11's "AST constructor recursion depth mismatch": its AST builder keeps
  one depth counter per interpreter, so another thread building an AST at the same time (3.11's traceback module
  parses each frame's line for its ^^^ markers: a background Orbax thread logging a failure from an earlier test
  of this worker) can fail a correct parse (seen once in CI on 3.11.7). A real syntax error fails both times."""
  source = path.read_text()
  try:
    return ast.parse(source)
  except SystemError as e:
    if "recursion depth mismatch" not in str(e):
      raise
    return ast.parse(source)


def imports_of(module: str, path: Path) -> set[str]:
  """maxtrain modules imported anywhere in the file (function-level imports included)."""
  found = set()
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  for node in ast.walk(parse(path)):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
      names = [f"{base}.{a.name}" for a in node.names] + [base]
    else:
      continue
    found |= {n for n in names if n in MODULES and n != module}
  return found


# The packages, lowest first: a module imports only from its own package or those before it here.
PACKAGE_ORDER = ("errors", "config", "runtime", "monitor", "data", "sharding", "models", "optim", "checkpoint",
                 "program", "interop", "inference", "evaluation", "posttrain", "aot", "loop", "cli")
SHIMS = {"train", "launch", "compile", "convert", "generate", "eval"}  # maxtrain/X.py: `python -m maxtrain.X`, cli/X.py
def package_of(module: str) -> str | None:
  """The module's place in PACKAGE_ORDER; None for `maxtrain` itself (only the version: any module may
  import it)."""
  parts = module.split(".")
  if len(parts) == 1:
    return None
  return "cli" if len(parts) == 2 and parts[1] in SHIMS else parts[1]


def order_violations(modules: Mapping[str, Path]) -> list[tuple[str, str, str]]:
  """(module, its package, a later package it imports), once per pair, for the imports against PACKAGE_ORDER."""
  found = set()
  for module, path in modules.items():
    own = package_of(module)
    for dep in imports_of(module, path):
      target = package_of(dep)
      if own is not None and target is not None and PACKAGE_ORDER.index(target) > PACKAGE_ORDER.index(own):
        found.add((module, own, target))
  return sorted(found)


def test_every_package_has_a_place_in_the_order():
  assert {package_of(m) for m in MODULES} - {None} - set(PACKAGE_ORDER) == set(), \
      "a package missing from PACKAGE_ORDER: add it where its imports put it"


def test_packages_import_only_packages_below_them():
  violations = order_violations(MODULES)
  bad = [f"{m} ({own}) imports {target}" for m, own, target in violations]
  assert not bad, f"imports against the package order {' < '.join(PACKAGE_ORDER)} (why sharding/ takes the " \
                  f"models' kernels as arguments, for example): {bad}"


def test_the_order_check_would_catch_a_back_edge(tmp_path):
  sample = tmp_path / "sample.py"
  sample.write_text("from maxtrain.errors import UserError\n\n\ndef f():\n  from ..loop import trainer\n")
  assert order_violations({"maxtrain.sharding.sample": sample}) == [("maxtrain.sharding.sample", "sharding", "loop")]
  assert order_violations({"maxtrain.loop.sample": sample}) == []
  assert package_of("maxtrain.train") == "cli" and package_of("maxtrain.program.build") == "program"


def test_no_import_cycles():
  graph = {m: imports_of(m, p) for m, p in MODULES.items()}
  graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}  # a package's own __init__
  state: dict[str, int] = {}

  def visit(m, stack):
    state[m] = 1
    for d in sorted(graph[m]):
      if state.get(d) == 1:
        pytest.fail("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
      if d not in state:
        visit(d, stack + [d])
    state[m] = 2

  for m in sorted(graph):
    if m not in state:
      visit(m, [m])


def unexplained_local_imports(path: Path) -> list[int]:
  """Lines of function-local imports of maxtrain with no comment saying why (on the line, or a comment line right
  above the block of imports it starts): an import belongs at the top of the module unless it breaks a cycle, keeps
  jax out of a jax-free path (config loading, `--help`) or defers a heavy optional dependency."""
  lines = path.read_text().splitlines()
  tree = parse(path)
  top = {id(n) for n in tree.body}

  def commented(number: int) -> bool:
    if "#" in lines[number - 1]:
      return True
    above = number - 1
    while above >= 1 and re.match(r"\s+(from|import) ", lines[above - 1]):
      above -= 1
    return above >= 1 and lines[above - 1].strip().startswith("#")

  found = []
  for node in ast.walk(tree):
    if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top and not commented(node.lineno):
      names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
      if getattr(node, "level", 0) or any(n == "maxtrain" or n.startswith("maxtrain.") for n in names):
        found.append(node.lineno)
  return sorted(found)


def test_function_local_imports_of_maxtrain_say_why():
  """Issue 42: the project's own modules are imported at the top; the few imported inside a function say why."""
  found = {p.relative_to(REPO).as_posix(): unexplained_local_imports(p) for p in MODULES.values()}
  assert {k: v for k, v in found.items() if v} == {}, "move these imports to the top of the module, or say why not"


def test_the_local_import_check_would_catch_an_unexplained_one(tmp_path):
  sample = tmp_path / "x.py"
  sample.write_text("from maxtrain import errors\n\n\ndef f():\n  import json\n  from maxtrain.data import store\n"
                    "  from maxtrain.models import registry  # jax: not for --help\n  return store, registry\n\n\n"
                    "def g():\n  # lm-eval (an optional extra)\n  from maxtrain.evaluation import lm\n"
                    "  from maxtrain.inference import sampling\n\n  from . import rules\n  return lm, sampling, rules\n")
  assert unexplained_local_imports(sample) == [6, 16]


# What the checkpoint policy may import: it decides from measurements and state, it never measures nor acts (no
# files, clocks, key-value store, devices, Orbax), so each rule is unit-tested with plain values.
POLICY_IMPORTS = {"__future__", "dataclasses", "math", "typing", "collections.abc", "maxtrain.errors"}


def module_imports(path: Path) -> set[str]:
  """Every module a file imports (any package), function-level imports included."""
  found = set()
  for node in ast.walk(parse(path)):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      found.add("." * node.level + (node.module or ""))
  return found


def test_checkpoint_policy_does_no_io():
  extra = module_imports(PACKAGE / "checkpoint" / "policy.py") - POLICY_IMPORTS
  assert not extra, f"maxtrain/checkpoint/policy.py imports {sorted(extra)}: the policy takes measurements as " \
                    "arguments; measure and act in cadence.py / resume.py / schedule.py"


def test_the_policy_check_would_catch_an_io_import(tmp_path):
  bad = tmp_path / "policy.py"
  bad.write_text("import dataclasses\n\ndef f():\n  from pathlib import Path\n  import orbax.checkpoint as ocp\n")
  assert module_imports(bad) - POLICY_IMPORTS == {"pathlib", "orbax.checkpoint"}


MAX_CHECKPOINT_CLASS_METHODS = 14  # about 12 methods, plus __init__ and a property


def test_checkpoint_classes_are_small():
  """The checkpoint package is small parts (a tier, its writer or reader, the resume search, the run's component):
  a class that outgrows this is two."""
  big = {f"{path.name}:{node.name}": n for path in sorted((PACKAGE / "checkpoint").glob("*.py"))
         for node in ast.walk(parse(path)) if isinstance(node, ast.ClassDef)
         if (n := sum(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for f in node.body))
         > MAX_CHECKPOINT_CLASS_METHODS}
  assert not big, f"checkpoint classes with more than {MAX_CHECKPOINT_CLASS_METHODS} methods: {big}"


def axis_mentions(path: Path) -> set[str]:
  """String literals equal to a mesh axis name, and `mesh.<axis>` attribute chains."""
  toks = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
  found = set()
  for i, tok in enumerate(toks):
    if tok.type == tokenize.STRING:
      try:
        value = ast.literal_eval(tok.string)
      except (ValueError, SyntaxError):
        continue
      if value in MESH_AXES:
        found.add(repr(value))
    elif tok.type == tokenize.NAME and tok.string in MESH_AXES and i >= 2 and toks[i - 1].string == "." \
        and toks[i - 2].string == "mesh":
      found.add(f"mesh.{tok.string}")
  return found


def test_only_sharding_names_mesh_axes():
  offenders = {}
  for path in [*MODULES.values(), *TOOLS]:
    rel = path.relative_to(REPO).as_posix()
    if rel.startswith("maxtrain/sharding/"):
      continue
    extra = axis_mentions(path) - AXIS_ALLOWED.get(rel, set())
    if extra:
      offenders[rel] = sorted(extra)
  assert not offenders, f"mesh axes named outside maxtrain/sharding/ (ask a sharding.layout.Layout): {offenders}"


def test_the_axis_check_would_catch_a_mesh_axis(tmp_path):
  sample = tmp_path / "x.py"
  sample.write_text('spec = P(("data", "fsdp"), None)\nn = cfg.mesh.tensor\nkey = "mesh.fsdp"\n')
  assert axis_mentions(sample) == {"'data'", "'fsdp'", "mesh.tensor"}


def sys_path_edits(path: Path) -> list[int]:
  """Lines that change `sys.path` (`sys.path.insert(...)`, `.append`, `.extend`)."""
  lines = []
  for node in ast.walk(parse(path)):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
        node.func.attr in ("insert", "append", "extend") and ast.unparse(node.func.value) == "sys.path":
      lines.append(node.lineno)
  return lines


def test_tools_import_the_installed_package():
  """Tools run as `python tools/x.py` and import `maxtrain` as installed (`pip install -e .`), never a
  path of their own choosing."""
  edits = {p.relative_to(REPO).as_posix(): sys_path_edits(p) for p in TOOLS}
  assert {k: v for k, v in edits.items() if v} == {}


def test_the_sys_path_check_would_catch_an_insert(tmp_path):
  sample = tmp_path / "x.py"
  sample.write_text("import sys\nsys.path.insert(0, '..')\nsys.argv.insert(0, 'x')\n")
  assert sys_path_edits(sample) == [2]


SHELL = "maxtrain/cli/shell.py"  # the one entry-point shell: parsing, --help, logging, exit codes


def _is_exit(node: ast.AST) -> bool:
  """`sys.exit(...)`, `exit(...)` or `SystemExit(...)`: a call that ends the process with a code."""
  func = node.func if isinstance(node, ast.Call) else None
  name = getattr(func, "attr", getattr(func, "id", None))
  return name == "SystemExit" or (name == "exit" and getattr(getattr(func, "value", None), "id", "sys") == "sys")


def _is_code(node: ast.AST | None, in_cli: bool) -> bool:
  """An exit code: an `EXIT_*` name, or in an entry point any int literal."""
  return (isinstance(node, ast.Name) and node.id.startswith("EXIT_")) or \
      (in_cli and isinstance(node, ast.Constant) and type(node.value) is int)


def shell_violations(path: Path, rel: str) -> list[str]:
  """What only the shell may do, done elsewhere: set up logging, exit with a code (other than a shim's
  `sys.exit(main())`), or turn a caught exception into an exit code; and an entry point whose `main` does not
  run through the shell."""
  found, tree = [], parse(path)
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "basicConfig" and rel != SHELL:
      found.append(f"{rel}:{node.lineno}: logging.basicConfig (the shell sets up logging)")
    if isinstance(node, ast.Call) and _is_exit(node) and not (
        len(node.args) == 1 and isinstance(node.args[0], ast.Call) and getattr(node.args[0].func, "id", None) == "main"):
      found.append(f"{rel}:{node.lineno}: exits with a code of its own (return it through the shell)")
    if isinstance(node, ast.ExceptHandler) and rel != SHELL:
      for inner in ast.walk(node):
        if isinstance(inner, ast.Return) and _is_code(inner.value, rel.startswith("maxtrain/cli/")):
          found.append(f"{rel}:{inner.lineno}: maps an exception to an exit code (errors.EXITS, via the shell)")
  is_entry = rel.startswith("maxtrain/cli/") and rel not in (SHELL, "maxtrain/cli/__init__.py")
  mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
  if is_entry and not any(isinstance(c, ast.Call) and getattr(c.func, "attr", None) == "run"
                          and getattr(c.func.value, "id", None) == "shell" for m in mains for c in ast.walk(m)):
    found.append(f"{rel}: main() does not call shell.run")
  return found


def test_every_entry_point_goes_through_the_one_shell():
  """Every `python -m maxtrain.X` (cli/X.py; the shims only import it) runs through cli/shell.py, and nothing
  else in the package sets up logging, exits with a code or maps exceptions to exit codes."""
  entry_points = sorted(p.stem for p in (PACKAGE / "cli").glob("*.py"))
  assert set(entry_points) - {"__init__", "shell"} == SHIMS
  found = []
  for path in MODULES.values():
    found += shell_violations(path, path.relative_to(REPO).as_posix())
  assert found == []


def test_the_shell_check_would_catch_a_private_shell(tmp_path):
  sample = tmp_path / "x.py"
  sample.write_text("import logging, sys\nfrom maxtrain.errors import UserError\n"
                    "def main(argv=None):\n  logging.basicConfig()\n  try:\n    pass\n"
                    "  except UserError as e:\n    print(f'x: error: {e}')\n    return EXIT_BAD_INPUT\n"
                    "  sys.exit(2)\n\nif __name__ == '__main__':\n  sys.exit(main())\n")
  found = shell_violations(sample, "maxtrain/cli/x.py")
  assert [f.split(": ", 1)[0] for f in found] == ["maxtrain/cli/x.py:4", "maxtrain/cli/x.py:9", "maxtrain/cli/x.py:10",
                                                 "maxtrain/cli/x.py"], found


def test_functions_are_short():
  long = []
  for path in MODULES.values():
    rel = path.relative_to(REPO).as_posix()
    for node in ast.walk(parse(path)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (rel, node.name) not in LONG_ALLOWED:
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_FUNCTION_LINES:
          long.append(f"{rel}:{node.name} ({lines} lines)")
  assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_supervisor_help_does_not_import_jax():
  script = ("import runpy, sys\nsys.argv = ['maxtrain.launch', '--help']\n"
            "try:\n  runpy.run_module('maxtrain.launch', run_name='__main__')\nexcept SystemExit as e:\n"
            "  assert e.code in (0, None), e.code\n"
            "print('JAX_IMPORTED' if 'jax' in sys.modules else 'NO_JAX')\n")
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert "usage: python -m maxtrain.launch" in proc.stdout
  assert proc.stdout.strip().splitlines()[-1] == "NO_JAX"


def test_config_loading_does_not_import_jax():
  script = ("import sys\nfrom maxtrain import config\nconfig.load(['--config=configs/llama3_8b.py'])\n"
            "print('JAX_IMPORTED' if 'jax' in sys.modules else 'NO_JAX')\n")
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.stdout.strip().splitlines()[-1] == "NO_JAX", proc.stderr


def flat_keys(cfg, prefix=""):
  out = []
  for k, v in cfg.items():
    out += flat_keys(v, f"{prefix}{k}.") if hasattr(v, "items") else [prefix + k]
  return out


def test_every_key_is_documented_where_declared():
  docs = config_lib.key_docs()
  keys = flat_keys(config_lib.base_config())
  assert set(docs) == set(keys)
  assert [k for k in keys if not docs[k]] == []
  assert docs["model.d_ff"] == "SwiGLU hidden width."


@pytest.mark.parametrize("module", ["maxtrain.train", "maxtrain.compile"])
def test_help_lists_every_key_with_default_and_meaning(module):
  proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert f"python -m {module}" in proc.stdout
  cfg, docs = config_lib.base_config(), config_lib.key_docs()
  for key in flat_keys(cfg):
    value = cfg
    for part in key.split("."):
      value = value[part]
    assert f"  {key} = {value!r}\n      {docs[key]}" in proc.stdout, key


def test_readme_layout_matches_the_tree():
  readme = (REPO / "docs" / "architecture.md").read_text()
  tree = readme.split("# Layout", 1)[1].split("```", 2)[1]  # the tree drawing
  listed = set(re.findall(r"\b([a-z_0-9]+\.py)\b", tree))
  actual = {p.name for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
  assert actual - listed == set(), f"modules missing from docs/architecture.md's Layout: {sorted(actual - listed)}"
  configs_line = next(line for line in tree.splitlines() if line.startswith("configs/"))
  configs = {p.name for p in (REPO / "configs").glob("*.py")}
  assert set(re.findall(r"\b([a-z_0-9]+\.py)\b", configs_line)) == configs, "docs/architecture.md's Layout: configs/ differs"
  existing = actual | configs | {p.name for p in (REPO / "tools").glob("*.py")}
  assert listed - existing == set(), f"docs/architecture.md's Layout names files that do not exist: {sorted(listed - existing)}"


def test_the_attention_mask_value_is_defined_once():
  """One fill value for masked scores (models/attention/mask.py): no kernel or decode path spells its
  own (a second `MASK_VALUE`/`_NEG`, or a finfo(...).min / .max fill)."""
  definitions, fills = [], []
  for path in MODULES.values():
    rel = path.relative_to(REPO).as_posix()
    for node in ast.walk(parse(path)):
      if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        definitions += [f"{rel}:{t.id}" for t in targets if isinstance(t, ast.Name)
                        and re.search(r"MASK_VALUE|NEG|NEG_INF|MASK_FILL", t.id)]
      if isinstance(node, ast.Attribute) and node.attr in ("min", "max") and isinstance(node.value, ast.Call) \
          and getattr(node.value.func, "attr", getattr(node.value.func, "id", None)) == "finfo":
        fills.append(f"{rel}:{node.lineno}")
  assert definitions == ["maxtrain/models/attention/mask.py:MASK_VALUE"], definitions
  assert [f.split(":")[0] for f in fills] == ["maxtrain/models/attention/mask.py"], fills


def saved_config_reads(path: Path) -> list[int]:
  """Lines that read a checkpoint meta's config directly: `<...meta>.get("config")` or `<...meta>["config"]`."""
  def is_meta(node: ast.expr) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name.endswith("meta")

  lines = []
  for node in ast.walk(parse(path)):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
        and is_meta(node.func.value) and node.args and getattr(node.args[0], "value", None) == "config":
      lines.append(node.lineno)
    if isinstance(node, ast.Subscript) and is_meta(node.value) and getattr(node.slice, "value", None) == "config":
      lines.append(node.lineno)
  return lines


def test_a_saved_config_is_read_only_through_migrate(tmp_path):
  """Issue 42: config/migrate.py's `saved_config` is the one reader of a checkpoint's saved config (today's keys,
  an unknown one exit 2); no other module reads `meta["config"]` raw."""
  offenders = {path.relative_to(REPO).as_posix(): saved_config_reads(path) for path in MODULES.values()
               if path.relative_to(REPO).as_posix() != "maxtrain/config/migrate.py"}
  assert not {k: v for k, v in offenders.items() if v}, offenders
  sample = tmp_path / "x.py"
  sample.write_text('a = meta.get("config", {})\nb = restored.meta["config"]\nc = {"config": 1}\n')
  assert saved_config_reads(sample) == [1, 2]


def test_plan_validation_imports_no_component_above_it():
  """Issue 42: validating a config imports neither checkpoint storage (Orbax) nor the Prometheus server: their
  sections are checked by pure functions beside their keys (config/sections.py)."""
  imported = imports_of("maxtrain.program.plan", MODULES["maxtrain.program.plan"])
  assert not {m for m in imported if m.split(".")[1] in ("checkpoint", "monitor")}, imported


# The drills (config.faults.*, maxtrain/runtime/faults.py) stay off the production path: in these packages
# only the wrappers name them (docs/faults.md): the builder's in-graph wrapper and the loop's one wiring place.
DRILL_PACKAGES = ("program", "models", "loop", "posttrain")
DRILL_WRAPPERS = {"maxtrain.program.drills", "maxtrain.loop.drills"}
FAULT_NAMES = {"fault", "Faults"}  # the step's fault input, the host drills' class


def fault_mentions(module: str, path: Path) -> list[str]:
  """Where `module` imports the drills (any form, function-level included) or names a fault input."""
  found = [f"imports {dep}" for dep in sorted(imports_of(module, path)) if dep == "maxtrain.runtime.faults"]
  for node in ast.walk(parse(path)):
    name = node.id if isinstance(node, ast.Name) else node.arg if isinstance(node, ast.arg) else None
    if name in FAULT_NAMES:
      found.append(f"{name} (line {node.lineno})")
  return found


def test_no_fault_name_outside_the_drill_wrappers():
  offenders = {module: fault_mentions(module, path) for module, path in MODULES.items()
               if package_of(module) in DRILL_PACKAGES and module not in DRILL_WRAPPERS}
  offenders = {m: found for m, found in offenders.items() if found}
  assert not offenders, ("the drills named on the production path (wrap the step in program/drills.py, observe the "
                         f"loop's events from loop/drills.py): {offenders}")


def test_the_fault_check_would_catch_a_fault_input(tmp_path):
  sample = tmp_path / "x.py"
  sample.write_text("from maxtrain.runtime import faults\n\n\ndef step(state, batch, fault=None):\n"
                    "  from maxtrain.runtime.faults import Faults\n  rows, fault = faults.split(batch)\n")
  assert fault_mentions("maxtrain.program.x", sample) == ["imports maxtrain.runtime.faults", "fault (line 4)",
                                                           "fault (line 6)"]


# Parallelism reaches the model as values the builder hands it at construction (sharding/rules.py Parallel,
# models/stack.py): no ambient state steers the model's forward, nor a sharding function it calls.
NO_AMBIENT_STATE = ("maxtrain/models/", "maxtrain/sharding/")


def context_vars(path: Path) -> list[str]:
  """Imports of `contextvars` (any form, function-level included) and mentions of `ContextVar`."""
  found = [f"imports {m}" for m in sorted(module_imports(path)) if m.split(".")[0] == "contextvars"]
  for node in ast.walk(parse(path)):
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    if name == "ContextVar":
      found.append(f"ContextVar (line {node.lineno})")
  return found


def test_no_context_variable_steers_the_model():
  offenders = {rel: found for path in MODULES.values() if (rel := path.relative_to(REPO).as_posix()).startswith(
      NO_AMBIENT_STATE) and (found := context_vars(path))}
  assert not offenders, ("ambient state in models/ or sharding/ (the builder hands the model its layout and layer "
                         f"stack at construction: sharding/rules.py Parallel, models/stack.py): {offenders}")


def test_the_context_variable_check_would_catch_one(tmp_path):
  sample = tmp_path / "x.py"
  sample.write_text("import contextvars\n\n_ACTIVE = contextvars.ContextVar('rules', default=None)\n\n\n"
                    "def f():\n  from contextvars import ContextVar\n  return ContextVar('stack')\n")
  assert context_vars(sample) == ["imports contextvars", "ContextVar (line 3)", "ContextVar (line 8)"]


# Issue 42: the ConfigDict is the file and command-line format only; components take typed sections
# (config/schema.py), built once at load.
CONFIGDICT_PACKAGES = ("config", "cli")


def configdict_mentions(path: Path) -> list[str]:
  """Where the file imports ml_collections (any form) or names ConfigDict in code (docstrings aside)."""
  found = []
  for node in ast.walk(parse(path)):
    if isinstance(node, ast.Import):
      found += [f"import {a.name} (line {node.lineno})" for a in node.names if a.name.split(".")[0] == "ml_collections"]
    elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ml_collections":
      found.append(f"from {node.module} import (line {node.lineno})")
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    if name == "ConfigDict":
      found.append(f"ConfigDict (line {node.lineno})")
  return found


def test_no_configdict_outside_config_and_cli():
  offenders = {module: configdict_mentions(path) for module, path in MODULES.items()
               if package_of(module) not in CONFIGDICT_PACKAGES}
  offenders = {m: found for m, found in offenders.items() if found}
  assert not offenders, ("a ConfigDict outside config/ and cli/: take the typed section (config/schema.py: "
                         f"cfg.optimizer is a schema.Optimizer) or the typed Config: {offenders}")


def test_the_configdict_check_would_catch_one(tmp_path):
  sample = tmp_path / "x.py"
  sample.write_text('import ml_collections\nfrom ml_collections import config_dict\n\n\n'
                    'def make(opt_cfg: ml_collections.ConfigDict) -> None:\n  """Not a ConfigDict."""\n'
                    '  return config_dict.ConfigDict(opt_cfg)\n')
  assert configdict_mentions(sample) == ["import ml_collections (line 1)", "from ml_collections import (line 2)",
                                         "ConfigDict (line 5)", "ConfigDict (line 7)"]
