"""Cost of checkpoint manifests (maxtrain.manifest): checksum throughput, write and verify time.

  python tools/bench_manifest.py [--file-gb 1] [--ckpt-mb 300] [--dir /tmp]

Prints, on this machine: GB/s of each available checksum over a file (from the page cache, and
cold: the file's pages dropped first with posix_fadvise, no root needed), then for a real Orbax
checkpoint of --ckpt-mb: save, manifest write, verify (1 thread and the default) and restore
times, so the restore overhead of verification can be read off.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
from pathlib import Path

import harness
from maxtrain.checkpoint import manifest


def _drop_cache(path: Path) -> None:
  """Evicts one file's pages from the page cache (so the next read comes from the disk)."""
  paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
  for p in paths:
    fd = os.open(p, os.O_RDONLY)
    try:
      os.fsync(fd)
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def _timed(fn, *args, **kwargs) -> float:
  """Wall seconds of one call (each measurement here is one pass over a file or a checkpoint)."""
  return harness.once(lambda: fn(*args, **kwargs))[0]


def bench_checksums(workdir: Path, file_gb: float) -> None:
  path = workdir / "blob"
  chunk = os.urandom(64 << 20)
  with open(path, "wb") as f:
    for _ in range(max(1, int(file_gb * 1e9) // len(chunk))):
      f.write(chunk)
  size = path.stat().st_size
  print(f"\nchecksum throughput, {size / 1e9:.2f} GB file (best of 2 warm, 1 cold), GB/s:")
  print(f"  {'algorithm':10s} {'in memory':>10s} {'file warm':>10s} {'file cold':>10s}")
  for algorithm in ["(read only)"] + manifest.available_algorithms():
    if algorithm == "(read only)":
      def run():
        with open(path, "rb", buffering=0) as f:
          while f.read(8 << 20):
            pass
      mem = float("nan")
    elif algorithm == "sha256+crc32c":  # reads the file itself: no in-memory figure
      mem = float("nan")
      run = lambda a=algorithm: manifest.file_checksum(path, a)  # noqa: E731
    else:
      h = manifest._hasher(algorithm)
      t = _timed(lambda: [h.update(chunk) for _ in range(8)])
      mem = 8 * len(chunk) / t / 1e9
      run = lambda a=algorithm: manifest.file_checksum(path, a)  # noqa: E731
    warm = size / min(_timed(run), _timed(run)) / 1e9
    _drop_cache(path)
    cold = size / _timed(run) / 1e9
    print(f"  {algorithm:10s} {mem:10.2f} {warm:10.2f} {cold:10.2f}")
  path.unlink()


def bench_checkpoint(workdir: Path, ckpt_mb: int) -> None:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import logging

  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  logging.getLogger("absl").setLevel(logging.ERROR)
  rng = np.random.default_rng(0)
  num_leaves = 12  # a few large leaves and shards, like params + two Adam moments
  n = ckpt_mb * (1 << 20) // 4 // num_leaves
  state = {f"leaf{i}": jax.numpy.asarray(rng.standard_normal(n, dtype=np.float32)) for i in range(num_leaves)}
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
  root = workdir / "ckpt"
  manager = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(create=True))
  def save():
    manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({"a": 1})))
    manager.wait_until_finished()

  save_s = _timed(save)
  manager.close()
  step = root / "1"
  files = [p for p in step.rglob("*") if p.is_file()]
  size = sum(p.stat().st_size for p in files)
  print(f"\ncheckpoint: {size / 1e6:.0f} MB in {len(files)} files ({num_leaves} leaves of {n * 4 / 1e6:.0f} MB), "
        f"algorithm {manifest.default_algorithm()}, {os.cpu_count()} CPUs")
  print(f"  orbax save (to finished on disk)  {save_s:7.3f} s")
  write_s = min(_timed(manifest.write, step) for _ in range(2))
  print(f"  manifest.write (warm)             {write_s:7.3f} s   {size / write_s / 1e9:.2f} GB/s")

  def restore():
    ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))

  restore()  # the first restore also pays JAX/Orbax start-up costs: not part of the comparison
  bench_algorithms(step, size)
  for label, cold in (("warm", False), ("cold", True)):
    for workers in (1, None):
      if cold:
        _drop_cache(step)
      t = _timed(manifest.verify, step, workers=workers)
      name = f"verify, {workers or 'default'} thread{'s' if workers != 1 else ''} ({label})"
      print(f"  {name:33s} {t:7.3f} s   {size / t / 1e9:.2f} GB/s")
    if cold:
      _drop_cache(step)
    restore_s = _timed(restore)
    print(f"  {'orbax restore (' + label + ')':33s} {restore_s:7.3f} s")
    if cold:  # what a resume does: verify from disk, then restore from the pages verify left cached
      # Interleaved, median of 3: restore time varies a lot on a shared machine.
      timed = harness.interleaved({"both": lambda: (manifest.verify(step), restore()), "alone": restore}, 3, warmup=0,
                                 before=lambda _: _drop_cache(step))
      both_s, alone_s = timed["both"].wall, timed["alone"].wall
      print(f"  verify + restore (cold, median 3) {both_s:7.3f} s   vs restore alone {alone_s:.3f} s: "
            f"+{both_s - alone_s:.3f} s (+{100 * (both_s - alone_s) / alone_s:.0f}%)")
  shutil.rmtree(root)


def bench_algorithms(step: Path, size: int) -> None:
  """Verify (warm, default threads, median of 7) with each algorithm's manifest: version 1's CRC-32C
  against version 2's keyed SHA-256, the cost of a checksum that tells every file apart."""
  for algorithm in manifest.available_algorithms():
    manifest.write(step, algorithm=algorithm)
    manifest.verify(step)
    t = sorted(_timed(manifest.verify, step) for _ in range(7))[3]
    print(f"  {'verify, ' + algorithm + ' (warm, median 7)':33s} {t:7.3f} s   {size / t / 1e9:.2f} GB/s")
  manifest.write(step)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--file-gb", type=float, default=1.0)
  parser.add_argument("--ckpt-mb", type=int, default=300)
  parser.add_argument("--dir", default=None, help="where to write the test files (default: a temp dir)")
  parser.add_argument("--step", default=None, help="a real checkpoint step directory: time verify with each "
                      "manifest version on a copy of it (e.g. the default run's runs/default/checkpoints/200)")
  args = parser.parse_args()
  import importlib.metadata as md

  versions = {p: md.version(p) for p in ("orbax-checkpoint", "jax", "google-crc32c", "xxhash")
              if _installed(p)}
  print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, {versions}; available: {manifest.available_algorithms()}")
  if args.step:
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
      step = Path(shutil.copytree(args.step, Path(d) / "step"))
      files = [f for f in step.rglob("*") if f.is_file()]
      size = sum(f.stat().st_size for f in files)
      print(f"checkpoint {args.step}: {size / 1e6:.1f} MB in {len(files)} files")
      bench_algorithms(step, size)
    return
  with tempfile.TemporaryDirectory(dir=args.dir) as d:
    bench_checksums(Path(d), args.file_gb)
    bench_checkpoint(Path(d), args.ckpt_mb)


def _installed(package: str) -> bool:
  import importlib.metadata as md

  try:
    md.version(package)
    return True
  except md.PackageNotFoundError:
    return False


if __name__ == "__main__":
  main()
