"""Where maxtrain caches what it can rebuild: the embedded corpus, the measured CPU peak and the
persistent XLA compilation cache. No jax import at module level: the corpus builder and the
platform setup (which must run before JAX starts its backend) use it too."""

from __future__ import annotations

import os
from pathlib import Path

from maxtrain.errors import require_writable_dir


def cache_dir() -> Path:
  """`$MAXTRAIN_CACHE`, else the per-user cache directory."""
  if os.environ.get("MAXTRAIN_CACHE"):
    return Path(os.environ["MAXTRAIN_CACHE"])
  import platformdirs  # Deferred: only needed without $MAXTRAIN_CACHE.

  return Path(platformdirs.user_cache_dir("maxtrain"))


def compile_cache_path(setting: str) -> Path | None:
  """`runtime.compile_cache_dir`: "" = `<maxtrain cache>/xla`, "none" = off, else a directory."""
  if setting == "none":
    return None
  return Path(setting) if setting else cache_dir() / "xla"


def configure_compile_cache(setting: str) -> Path | None:
  """Persistent XLA compilation cache: a restarted or resumed run reuses the compiled step instead of
  compiling it again (on this CPU: first step 22 s -> 5 s after start for the test model). Entries
  are keyed by the program, compile options, backend and jax version, so a hit is the same
  executable."""
  import jax

  path = compile_cache_path(setting)
  if path is None:
    return None
  require_writable_dir(path, f"config.runtime.compile_cache_dir={setting or str(path)!r}: {path}",
                       "choose one this process can write, or 'none' to turn the cache off")
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  return path
