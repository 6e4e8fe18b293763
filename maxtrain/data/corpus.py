"""Built-in corpora, tokenized once into a local cache.

`python-stdlib` is the running interpreter's standard library sources: about
30 MB of real, varied text that every machine already has, so a first run
needs no download.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from maxtrain.data.indexing import SourceFile, index_sources
from maxtrain.data.store import TokenStore
from maxtrain.data.tokenizer import load_tokenizer
from maxtrain.errors import UserError
from maxtrain.runtime.cache import cache_dir

CORPORA = ("python-stdlib",)
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def _stdlib_files(root: str) -> list[SourceFile]:
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
    for name in filenames:
      if name.endswith(".py"):
        path = os.path.join(dirpath, name)
        key = os.path.relpath(path, root).replace(os.sep, "/")
        files.append(SourceFile(path, key, os.path.getsize(path)))
  return sorted(files, key=lambda f: f.key)


def _short_hash(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()[:10]


def _is_current(directory: Path, fingerprint: dict) -> bool:
  for split in ("train", "val"):
    try:
      store = TokenStore.open(str(directory / f"corpus.{split}"))
    except UserError:
      return False
    if store.header.get("source") != fingerprint:
      return False
  return True


@contextlib.contextmanager
def _build_lock(path: Path):
  """Serializes builds on one host; other hosts rely on the atomic rename."""
  try:
    import fcntl
  except ImportError:  # Not POSIX: fall back to the rename race handling.
    yield
    return
  with open(path, "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def prepare_corpus(name: str, tokenizer_spec: str = "byte",
                   val_fraction: float = 0.01, seed: int = 0, *,
                   _root: str | None = None) -> tuple[str, str]:
  """Builds (or reuses) a cached built-in corpus; returns (train, val) prefixes.

  `_root` replaces the stdlib directory; it exists for tests.
  """
  if name not in CORPORA:
    raise UserError(
        f"unknown corpus {name!r}; known corpora: {', '.join(CORPORA)} (or "
        "index your own files with `python tools/index_data.py`)")
  root = os.path.abspath(_root or sysconfig.get_paths()["stdlib"])
  if not os.path.isdir(root):
    raise UserError(
        f"corpus {name!r}: the standard library directory {root!r} does not "
        "exist; index your own files with `python tools/index_data.py`")
  tokenizer = load_tokenizer(tokenizer_spec)
  files = _stdlib_files(root)
  if not files:
    raise UserError(f"empty corpus: no .py files under {root!r}")
  python = ".".join(map(str, sys.version_info[:3]))
  # Everything that changes the stores' contents; a mismatch means rebuild.
  fingerprint = {
      "corpus": name, "python": python, "stdlib": root,
      "num_files": len(files), "total_bytes": sum(f.size for f in files),
      "tokenizer": tokenizer.identity, "val_fraction": val_fraction,
      "seed": seed,
  }
  tag = (f"py{python}-{_short_hash(root)}-{_short_hash(tokenizer.identity)}"
         f"-val{val_fraction:g}-seed{seed}")
  parent = cache_dir() / "corpora"
  final = parent / f"{name}-{tag}"
  prefixes = (str(final / "corpus.train"), str(final / "corpus.val"))
  if _is_current(final, fingerprint):
    return prefixes
  parent.mkdir(parents=True, exist_ok=True)
  with _build_lock(parent / f".{name}-{tag}.lock"):
    if _is_current(final, fingerprint):  # Another process just built it.
      return prefixes
    print(f"maxtrain: tokenizing corpus {name!r} ({len(files)} files, "
          f"{fingerprint['total_bytes'] / 1e6:.1f} MB) into {final} "
          "(once; later runs reuse it)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-build-", dir=parent))
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache.
    try:
      summary = index_sources(files, str(tmp / "corpus"), tokenizer_spec,
                              val_fraction, seed=seed, source=fingerprint)
      _publish(tmp, final, fingerprint)
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
    print(f"maxtrain: corpus {name!r}: {summary['train_tokens']} train + "
          f"{summary['val_tokens']} val tokens in {summary['seconds']:.1f} s",
          file=sys.stderr)
  return prefixes


def _publish(tmp: Path, final: Path, fingerprint: dict) -> None:
  """Moves a finished build into place without ever exposing a partial one."""
  for _ in range(3):
    try:
      os.rename(tmp, final)
      return
    except OSError:
      if _is_current(final, fingerprint):
        return  # A concurrent build won; ours is discarded by the caller.
      # A stale build is in the way: move it aside, then retry the rename.
      stale = final.with_name(f".{final.name}-stale-{os.getpid()}-{time.time_ns()}")
      with contextlib.suppress(OSError):
        os.rename(final, stale)
        shutil.rmtree(stale, ignore_errors=True)
  raise UserError(
      f"could not move the corpus build into {final}; remove that directory "
      "and retry")

