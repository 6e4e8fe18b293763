"""The save and restore profile of the default run's train state, per tier and phase:

  python tools/bench_checkpoint.py [--config configs/default.py] [--rounds 5] [--s3]

Builds the config's program on this machine's devices (the default: 8 fake CPU devices when run under
XLA_FLAGS=--xla_force_host_platform_device_count=8, else what is there), initialises its state, then in
interleaved rounds saves it to the durable tier (Orbax, a temporary directory), to the local tier
(checkpoint/local.py) and, with --s3, to an s3:// durable tier served by a local moto server (the
upload is then timed too), and restores each. Prints the median seconds of every phase: the loop's
blocking device-to-host copy, serialisation and write (Orbax's are one phase), manifest, upload (MB/s),
verification and read on restore.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import tempfile
from pathlib import Path

import jax

import harness
from maxtrain import config as config_lib
from maxtrain.checkpoint import manifest
from maxtrain.checkpoint.identity import run_meta
from maxtrain.checkpoint.local import LocalTier
from maxtrain.checkpoint.storage import Checkpointer
from maxtrain.program import build
from maxtrain.program import state as state_lib


def _moto() -> None:
  """A moto S3 server on localhost, the standard AWS variables pointing at it, bucket `bench`."""
  import boto3
  from moto.server import ThreadedMotoServer

  server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
  server.start()
  host, port = server.get_host_and_port()
  os.environ.update({"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "bench",
                     "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"})
  boto3.client("s3").create_bucket(Bucket="bench")


def _trained_like(state, program):
  """The state with noise in every float leaf: a fresh state's optimizer moments are zeros, which Orbax's
  compression shrinks to nothing; a trained state's do not compress."""
  def noisy(tree):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    return jax.tree.unflatten(treedef, [x + 1e-3 * jax.random.normal(k, x.shape, x.dtype)
                                        if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x
                                        for x, k in zip(leaves, keys)])

  return jax.jit(noisy, out_shardings=program.state.shardings)(state)


class Bench:
  def __init__(self, cfg, workdir: Path, s3: bool):
    self.cfg = cfg
    self.program = build.program_for(cfg, jax.devices(), require_data=False)
    self.state = _trained_like(state_lib.initialize(self.program.state, self.program.mesh), self.program)
    jax.block_until_ready(self.state)
    self.mesh = dict(self.program.mesh.shape)
    self.stores = {"durable": Checkpointer(cfg.checkpoint, str(workdir / "durable"))}
    if s3:
      self.stores["s3"] = Checkpointer(cfg.checkpoint, "s3://bench/run", workdir / "staging")
    identity = {"output_dir": str(workdir), "checkpoint_dir": str(workdir / "durable"), "config_hash": "bench"}
    self.local = LocalTier(str(workdir / "local"), jax.process_index(), 2, identity)
    self.step = 0
    self.phases: dict[str, dict[str, list[float]]] = {}

  def _record(self, tier: str, **phases: float) -> None:
    for name, value in phases.items():
      self.phases.setdefault(tier, {}).setdefault(name, []).append(value)

  def orbax(self, tier: str) -> None:
    store = self.stores[tier]
    self.step += 1
    store.save(self.step, self.state, {"next": 0}, run_meta(self.cfg, self.mesh))
    done = store.wait()[0]
    self._record(tier, device_to_host_s=done.device_to_host_s, write_s=done.save_s - done.device_to_host_s - done.manifest_s,
                 manifest_s=done.manifest_s, save_s=done.save_s, mb=done.num_bytes / 1e6)
    if store.remote is not None:
      store.remote.wait()
      for _, num_bytes, seconds in store.remote.uploaded():
        self._record(tier, upload_s=seconds, upload_MB_per_s=num_bytes / 1e6 / seconds)
    path = store.path(self.step)
    verify_s = harness.once(lambda: manifest.verify(path))[0]
    store.reader.mark_verified(path)  # the read below is timed without a second verification
    read_s = harness.once(lambda: store.restore(path, self.program.state.abstract, self.program.state.shardings).state)[0]
    self._record(tier, restore_verify_s=verify_s, restore_read_s=read_s)

  def local_tier(self) -> None:
    self.step += 1
    self.local.save(self.step, self.state, {"next": 0}, {"mesh": self.mesh, "process_count": 1,
                                                         "identity": self.local.identity})
    done = self.local.wait()[0]
    self._record("local", device_to_host_s=done.blocking_s, **done.phases, save_s=done.save_s, mb=done.num_bytes / 1e6)
    path = self.local.path(self.step)
    verify_s = harness.once(lambda: manifest.verify(path))[0]
    read_s = harness.once(lambda: self.local.restore(path, self.program.state.abstract, self.program.state.shardings).state)[0]
    self._record("local", restore_verify_s=verify_s, restore_read_s=read_s)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="configs/default.py")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--s3", action="store_true", help="also an s3:// durable tier on a local moto server")
  args = parser.parse_args(argv)
  if args.s3:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request log
    _moto()
  cfg = config_lib.load([f"--config={args.config}"])
  with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as tmp:
    bench = Bench(cfg, Path(tmp), args.s3)
    variants = {"local": bench.local_tier, "durable": lambda: bench.orbax("durable")}
    if args.s3:
      variants["s3"] = lambda: bench.orbax("s3")
    harness.interleaved(variants, args.rounds, warmup=1)
    for store in bench.stores.values():
      store.close()
  print(f"checkpoint profile of {args.config}'s state on {jax.device_count()} x {jax.devices()[0].device_kind} "
        f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores; jax {jax.__version__}); "
        f"median of {args.rounds} rounds after 1 warm-up, seconds:")
  names = sorted({n for tier in bench.phases.values() for n in tier})
  order = [n for n in ("mb", "device_to_host_s", "serialise_s", "write_s", "manifest_s", "save_s", "upload_s",
                       "upload_MB_per_s", "restore_verify_s", "restore_read_s") if n in names]
  print(f"  {'tier':<8}" + "".join(f"{n.removesuffix('_s').replace('_per', '/s'):>15}" for n in order))
  for tier, phases in bench.phases.items():
    cells = [statistics.median(phases[n][1:] or phases[n]) if n in phases else float("nan") for n in order]
    print(f"  {tier:<8}" + "".join(f"{c:>15.4f}" for c in cells))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
