"""Compiled temp memory per device of the pipelined train step (XLA's memory_analysis) next to the same
model without the pipeline, by remat policy, with the bubble: the figures of BENCHMARKS.md's pipeline
memory section.

  python tools/pipeline_memory.py [--config.key=value ...]

Runs on 8 fake CPU devices (set here): 8 layers, d_model 256, d_ff 1024, 64 tokens, batch 16, M=8;
pipeline=4 x fsdp=2 with repeats 1 and 2 against fsdp=8. Extra --config.* flags apply to every row.
Only compiles (nothing runs), so any checkout's maxtrain can be measured the same way.
"""

from __future__ import annotations

import os
import platform
import sys

from maxtrain.runtime.platform import fake_cpu_devices

fake_cpu_devices(8)  # before jax starts its backend
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import harness  # noqa: E402
from maxtrain.config import loader as config_lib  # noqa: E402

MODEL = ["--config.model.num_layers=8", "--config.model.d_model=256", "--config.model.num_heads=4",
         "--config.model.num_kv_heads=4", "--config.model.d_ff=1024", "--config.model.vocab_size=512",
         "--config.data.seq_len=64", "--config.data.batch_size=16"]
MESHES = {
    "fsdp=8 (no pipeline)": ["--config.mesh.fsdp=8"],
    "pipeline=4 x fsdp=2, R=1, M=8": ["--config.mesh.pipeline=4", "--config.mesh.fsdp=2",
                                      "--config.pipeline.microbatches=8"],
    "pipeline=4 x fsdp=2, R=2, M=8": ["--config.mesh.pipeline=4", "--config.mesh.fsdp=2",
                                      "--config.pipeline.microbatches=8", "--config.pipeline.repeats=2"],
}


def main(extra: list[str]) -> None:
  print(f"jax {jax.__version__}, {platform.processor() or platform.machine()}, {jax.device_count()} CPU devices")
  print(f"{'mesh':32} {'remat':6} {'temp MiB':>9} {'args MiB':>9}  bubble")
  for name, mesh in MESHES.items():
    for remat in ("none", "full"):
      cfg = config_lib.load(MODEL + mesh + [f"--config.model.remat={remat}"] + extra)
      program, memory = harness.compiled_memory(cfg)
      bubble = "-" if program.plan.pipeline is None else f"{program.plan.pipeline.bubble:.3f}"
      print(f"{name:32} {remat:6} {memory.temp_size_in_bytes / 2**20:9.1f} "
            f"{memory.argument_size_in_bytes / 2**20:9.1f}  {bubble}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
