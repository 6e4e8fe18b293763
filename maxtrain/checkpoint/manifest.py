"""Checkpoint integrity: a manifest of every file in a finished checkpoint step directory.

Orbax's atomic rename says a save finished, not that its bytes are still the ones written. A
truncated file or a cut JSON item makes restore crash; a flipped byte in an array data file restores
silently (zarr2 chunks carry no checksum; OCDBT checksums only its own tree nodes). So once a step
directory is complete, one process writes `maxtrain_manifest.json` beside its items: every file's
relative path, size and checksum. `verify` checks a step directory against it before anything is
restored, and `move_aside` renames a bad step so that Orbax no longer lists it (nothing is deleted).

Checksum (version 2): SHA-256 (hashlib; SHA-NI makes it ~1 GB/s a core) of the file's relative path and
size, then its bytes. Version 1 used CRC-32C (else xxh3-64, else zlib CRC-32) of the bytes alone, and
a CRC cannot tell apart files that end in their own CRC (OCDBT manifests and data files do): the CRC
of any such file of a given length is one constant, so a same-size file swapped in from another step
passed. No CRC prefixed or seeded with the path helps (the constant only shifts), so version 2 uses a
non-linear hash; keying it with the path and size also catches a file moved to another name.
Version 1 manifests are still read and checked as written. The manifest names its algorithm, and
`verify` uses that one. Figures: `tools/bench_manifest.py`, BENCHMARKS.md.

Files on disk that the manifest does not list are reported, not an error (unless `strict`): they are
not part of what was saved, nothing Orbax restores reads a file it did not write, and a filesystem
or a person may add some (`.nfs*` files, notes); the caller should log them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import time
import zlib
from pathlib import Path
from typing import Callable

from maxtrain.errors import UserError

log = logging.getLogger("maxtrain")
MANIFEST_NAME = "maxtrain_manifest.json"
FORMAT = "maxtrain-checkpoint-manifest"
VERSION = 2  # 1: unkeyed checksums (CRC-32C, xxh3-64 or CRC-32); 2: keyed SHA-256
_CHUNK_BYTES = 1 << 20  # measured: 1-4 MiB is fastest here (8 MiB chunks fall out of cache: 30% slower)
_BLOCK_BYTES = 1 << 16  # sha256+crc32c: one CRC per block (64 KiB: reads stay fast, the SHA-256 of the last is cheap)
_TMP_PREFIX = f".{MANIFEST_NAME}.tmp-"


class CorruptCheckpoint(UserError):
  """A step directory that does not match its manifest (or whose manifest is unreadable).

  A UserError: an explicit resume of a corrupt step is exit 2, since a restart fails the same way.
  """

  def __init__(self, step_dir: Path, first_bad_file: str, reason: str):
    self.step_dir, self.first_bad_file, self.reason = Path(step_dir), first_bad_file, reason
    super().__init__(f"checkpoint {step_dir} is corrupt: {first_bad_file}: {reason}")

  def __reduce__(self):  # picklable with its fields (it may cross a process boundary)
    return type(self), (self.step_dir, self.first_bad_file, self.reason)


class UnsupportedManifest(UserError):
  """A manifest this installation cannot check (a newer format, or its checksum library missing).

  Not a corruption: the step must not be moved aside for it.
  """


@dataclasses.dataclass(frozen=True)
class Verification:
  verified: bool  # False: the step has no manifest (saved before manifests existed); nothing checked
  num_files: int = 0
  num_bytes: int = 0
  seconds: float = 0.0
  extra_files: tuple[str, ...] = ()  # on disk but not in the manifest (see the module docstring)


# ---- checksums ------------------------------------------------------------------------------------


def _crc32c() -> Callable[[bytes, int], int] | None:
  try:
    import google_crc32c
  except ImportError:
    return None
  if google_crc32c.implementation != "c":
    return None  # its pure-Python fallback runs at a few MB/s: slower than zlib by ~1000x
  return lambda data, crc: google_crc32c.extend(crc, data)


def _xxh3() -> Callable[[], object] | None:
  try:
    import xxhash
  except ImportError:
    return None
  return xxhash.xxh3_64


def _hasher(algorithm: str):
  """An object with update(bytes) and hexdigest(), or None if the algorithm is not installed."""
  if algorithm == "sha256":
    return hashlib.sha256()
  if algorithm == "sha256+crc32c":  # not incremental (file_checksum reads the file itself)
    return None if _crc32c() is None else hashlib.sha256()
  if algorithm == "crc32c":
    extend = _crc32c()
    return None if extend is None else _Crc(extend)
  if algorithm == "xxh3_64":
    new = _xxh3()
    return None if new is None else new()
  if algorithm == "crc32":
    return _Crc(lambda data, crc: zlib.crc32(data, crc))
  return None


class _Crc:
  def __init__(self, extend: Callable[[bytes, int], int]):
    self._extend, self._crc = extend, 0

  def update(self, data: bytes) -> None:
    self._crc = self._extend(data, self._crc)

  def hexdigest(self) -> str:
    return f"{self._crc:08x}"


ALGORITHMS = ("sha256+crc32c", "sha256", "crc32c", "xxh3_64", "crc32")  # in order of preference
KEYED = ("sha256+crc32c", "sha256")  # the file's path and size go in first (version 2); the others are version 1's


def available_algorithms() -> list[str]:
  return [a for a in ALGORITHMS if _hasher(a) is not None]


def default_algorithm() -> str:
  return available_algorithms()[0]  # crc32 (stdlib) is always there


def _key(name: str, size: int) -> bytes:
  """What a keyed checksum reads before the file's bytes: a file counts only at its own path and size."""
  return f"maxtrain-file\0{name}\0{size}\0".encode()


def _blocked(f, key: bytes, extend: Callable[[bytes, int], int]) -> tuple[int, str]:
  """SHA-256 of `key`, the CRC-32C of each block but the last, then the last block's bytes: CRC-32C
  speed (a 64 KiB block holds no self-checksum unless a format puts one exactly there), and a file
  that ends in its own CRC (which makes its CRC a constant) is told apart by its last block's SHA-256."""
  h, size, crcs = hashlib.sha256(key), 0, bytearray()
  block = f.read(_BLOCK_BYTES)
  while block:
    following = f.read(_BLOCK_BYTES)
    size += len(block)
    if following:
      crcs += extend(block, 0).to_bytes(4, "little")
      if len(crcs) >= 4096:
        h.update(crcs)
        crcs.clear()
    else:
      h.update(crcs)
      h.update(block)
    block = following
  return size, h.hexdigest()


def file_checksum(path: Path, algorithm: str, key: bytes = b"") -> tuple[int, str]:
  """(bytes read, hex checksum) of `key` then a file, read in chunks (never whole into memory)."""
  if algorithm == "sha256+crc32c":
    with open(path, "rb", buffering=0) as f:
      return _blocked(f, key, _crc32c())
  h = _hasher(algorithm)
  if key:
    h.update(key)
  size = 0
  with open(path, "rb", buffering=0) as f:
    if algorithm == "crc32c":  # google_crc32c takes only immutable buffers: a fresh bytes per chunk
      while chunk := f.read(_CHUNK_BYTES):
        h.update(chunk)
        size += len(chunk)
    else:
      buf = bytearray(_CHUNK_BYTES)
      view = memoryview(buf)
      while n := f.readinto(buf):
        h.update(view[:n])
        size += n
  return size, h.hexdigest()


def _checksum_all(step_dir: Path, names: list[str], algorithm: str, workers: int | None,
                  sizes: dict[str, int] | None = None) -> dict:
  """{name: (bytes read, checksum) or OSError}, files in parallel (reads and all the checksums release
  the GIL). `sizes`: the sizes keyed checksums take (the manifest's when verifying)."""
  workers = workers or min(8, os.cpu_count() or 1)

  def one(name):
    try:
      key = _key(name, sizes[name]) if algorithm in KEYED else b""
      return file_checksum(step_dir / name, algorithm, key)
    except OSError as e:
      return e

  if workers <= 1 or len(names) <= 1:
    return {n: one(n) for n in names}
  # Largest files first so that one big file does not start last and run alone.
  order = sorted(names, key=lambda n: -_size_or_zero(step_dir / n))
  with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="ckpt-checksum") as pool:
    return dict(zip(order, pool.map(one, order)))


def _size_or_zero(path: Path) -> int:
  try:
    return path.stat().st_size
  except OSError:
    return 0


# ---- the manifest ---------------------------------------------------------------------------------


def _files(step_dir: Path) -> list[str]:
  """Relative POSIX paths of the regular files under step_dir, sorted, without the manifest."""
  out = []
  for root, dirs, files in os.walk(step_dir):
    dirs.sort()
    for name in files:
      rel = (Path(root) / name).relative_to(step_dir).as_posix()
      if rel != MANIFEST_NAME and not rel.startswith(_TMP_PREFIX):
        out.append(rel)
  return sorted(out)


def write(step_dir: Path, *, algorithm: str | None = None, workers: int | None = None) -> Path:
  """Writes the manifest of a finished step directory, atomically; returns its path.

  Call it once per step, on one process (process 0), after the save is complete on disk (Orbax
  finalized it: all processes' shards are written and the directory renamed), and before anything
  copies the step elsewhere. It must be the last file written into the step.
  """
  step_dir = Path(step_dir)
  algorithm = algorithm or default_algorithm()
  if _hasher(algorithm) is None:
    raise ValueError(f"checksum {algorithm!r} is not available here (available: {available_algorithms()})")
  names = _files(step_dir)
  sizes = {n: (step_dir / n).stat().st_size for n in names}
  sums = _checksum_all(step_dir, names, algorithm, workers, sizes)
  files = {}
  for name in names:
    result = sums[name]
    if isinstance(result, OSError):
      raise result
    read, checksum = result
    if read != sizes[name] or (step_dir / name).stat().st_size != read:
      raise RuntimeError(f"{step_dir / name} changed while its checksum was taken: the step is still being "
                         "written (the manifest must be written after the save is complete)")
    files[name] = {"size": read, "checksum": checksum}
  manifest = {"format": FORMAT, "version": VERSION if algorithm in KEYED else 1, "algorithm": algorithm,
              "created": time.time(),
              "num_bytes": sum(f["size"] for f in files.values()), "files": files}
  path = step_dir / MANIFEST_NAME
  tmp = step_dir / f"{_TMP_PREFIX}{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(manifest, f, indent=1, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)  # atomic: a reader sees no manifest or the whole one
  _fsync_dir(step_dir)
  return path


def _fsync_dir(directory: Path) -> None:
  fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _read_manifest(step_dir: Path, path: Path) -> dict:
  def bad(reason):
    return CorruptCheckpoint(step_dir, MANIFEST_NAME, reason)

  try:
    manifest = json.loads(path.read_bytes())
  except OSError as e:
    raise bad(f"unreadable manifest ({e.strerror})") from None
  except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
    raise bad(f"unreadable manifest (not valid JSON: {e})") from None
  if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
    raise bad(f"unreadable manifest (not a {FORMAT} file)")
  version = manifest.get("version")
  if not isinstance(version, int):
    raise bad("unreadable manifest (no integer 'version')")
  if version > VERSION:
    raise UnsupportedManifest(f"{path}: manifest version {version} is newer than this maxtrain reads "
                              f"({VERSION}); upgrade maxtrain to verify it, or set checkpoint.verify=False")
  algorithm = manifest.get("algorithm")
  if algorithm not in ALGORITHMS or (algorithm in KEYED) != (version >= 2):
    raise bad(f"unreadable manifest (unknown checksum algorithm {algorithm!r})")
  if _hasher(algorithm) is None:
    package = {"crc32c": "google-crc32c", "xxh3_64": "xxhash"}.get(algorithm, algorithm)
    raise UnsupportedManifest(f"{path}: its checksums are {algorithm}, which needs the {package} package: "
                              f"pip install {package} (or set checkpoint.verify=False)")
  files = manifest.get("files")
  if not isinstance(files, dict):
    raise bad("unreadable manifest (no 'files' table)")
  for name, entry in files.items():
    if (not isinstance(entry, dict) or not isinstance(entry.get("size"), int)
        or not isinstance(entry.get("checksum"), str)):
      raise bad(f"unreadable manifest (bad entry for {name!r})")
    if Path(name).is_absolute() or ".." in Path(name).parts:
      raise bad(f"unreadable manifest (entry {name!r} is outside the step directory)")
  return manifest


def verify(step_dir: Path, *, strict: bool = False, workers: int | None = None) -> Verification:
  """Checks every file of a step directory against its manifest.

  Returns Verification(verified=False) when there is no manifest (a checkpoint saved before
  manifests existed: the caller should say so). Raises CorruptCheckpoint naming the first bad file
  (in path order) for a missing file, a size or checksum mismatch, an unreadable manifest, or with
  `strict`, a file the manifest does not list; UnsupportedManifest if it cannot be checked here.
  Sizes are all checked before any file is read, so a missing or truncated file fails at once.
  """
  t0 = time.monotonic()
  step_dir = Path(step_dir)
  path = step_dir / MANIFEST_NAME
  if not path.exists():
    if not step_dir.is_dir():
      raise CorruptCheckpoint(step_dir, ".", "the step directory does not exist")
    return Verification(verified=False)
  manifest = _read_manifest(step_dir, path)
  expected = manifest["files"]
  names = sorted(expected)
  for name in names:
    try:
      size = (step_dir / name).stat().st_size
    except FileNotFoundError:
      raise CorruptCheckpoint(step_dir, name, "missing") from None
    except OSError as e:
      raise CorruptCheckpoint(step_dir, name, f"unreadable ({e.strerror})") from None
    if size != expected[name]["size"]:
      raise CorruptCheckpoint(step_dir, name, f"size {size} bytes, manifest says {expected[name]['size']}")
  extra = tuple(sorted(set(_files(step_dir)) - set(expected)))
  if strict and extra:
    raise CorruptCheckpoint(step_dir, extra[0], "not in the manifest (strict verification)")
  sums = _checksum_all(step_dir, names, manifest["algorithm"], workers, {n: expected[n]["size"] for n in names})
  bad = []
  for name in names:
    result = sums[name]
    if isinstance(result, OSError):
      bad.append((name, f"unreadable ({result.strerror})"))
    elif result[0] != expected[name]["size"]:
      bad.append((name, f"size changed while reading ({result[0]} bytes read)"))
    elif result[1] != expected[name]["checksum"]:
      bad.append((name, f"{manifest['algorithm']} checksum {result[1]}, manifest says {expected[name]['checksum']}"))
  if bad:
    name, reason = bad[0]
    more = f" (and {len(bad) - 1} more files)" if len(bad) > 1 else ""
    raise CorruptCheckpoint(step_dir, name, reason + more)
  return Verification(verified=True, num_files=len(names), num_bytes=sum(e["size"] for e in expected.values()),
                      seconds=time.monotonic() - t0, extra_files=extra)


# ---- quarantine -----------------------------------------------------------------------------------


def check(step_dir: Path) -> Verification:
  """`verify`, logged: what every reader of a checkpoint calls before reading it. Raises CorruptCheckpoint
  (a UserError naming the file); a step without a manifest (saved before manifests) is read with a warning."""
  result = verify(step_dir)
  if not result.verified:
    log.warning("checkpoint %s has no manifest (saved before manifests, or the process died between the save "
                "and its manifest): restoring it unverified", step_dir)
    return result
  log.info("checkpoint %s verified: %d files, %.1f MB in %.2fs%s", step_dir, result.num_files, result.num_bytes / 1e6,
           result.seconds, f"; files not in the manifest: {', '.join(result.extra_files)}"
           if result.extra_files else "")
  return result


def move_aside(step_dir: Path, why: str = "corrupt") -> Path:
  """Renames a step directory to `<step>.<why>-<UTC time>` beside it (corrupt, incomplete, branched);
  returns the new path.

  Nothing is deleted. Orbax lists only directories whose name is a step number, so the renamed one
  is no longer a step (nor a temporary directory Orbax would clean up). Call it on one process.
  """
  step_dir = Path(step_dir)
  stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
  for n in range(1000):
    target = step_dir.with_name(f"{step_dir.name}.{why}-{stamp}" + (f"-{n}" if n else ""))
    if target.exists():
      continue
    try:
      os.rename(step_dir, target)  # same directory: atomic, never copies
    except OSError:
      if target.exists():  # lost a race for this name: take the next one
        continue
      raise
    return target
  raise RuntimeError(f"cannot find a free name to move {step_dir} aside")
