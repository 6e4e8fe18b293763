"""Per-stage activation memory of the pipeline schedules as the microbatches grow: the compiled step's
temporaries (XLA's memory_analysis; one SPMD program, so each stage's) and, from the schedule table
(maxtrain/sharding/schedules.py), the bubble and the microbatches each stage holds. BENCHMARKS.md's and
docs/sharding.md's schedule tables.

  python tools/pipeline_schedules.py [--microbatches 4,8,16] [--rows 4] [--widths small|70b|405b]
                                    [--schedules gpipe,gpipe+stage_remat,1f1b,zb,interleaved_1f1b] [--config.key=value ...]

Runs on 8 fake CPU devices (set here): pipeline=4 x fsdp=2, 4 layers (one per stage; interleaved_1f1b: 8 layers,
two groups per stage), 64 tokens, `model.remat=none`; widths: small (d_model 256, d_ff 1024), or LLaMA 3 70B's /
405B's (d_model, heads, d_ff; vocabulary 1024: the layers' activations are the point). A microbatch is `--rows`
sequences (batch rows x M: the microbatch fixed, so what a schedule holds per microbatch shows as M grows;
`--rows 0`: batch 32 whatever M). Only compiles (nothing runs, nothing is allocated).
"""

from __future__ import annotations

import argparse
import os
import platform

from maxtrain.runtime.platform import fake_cpu_devices

fake_cpu_devices(8)  # before jax starts its backend
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from maxtrain.config import loader as config_lib  # noqa: E402
from maxtrain.program import build as build_lib  # noqa: E402
from maxtrain.sharding import schedules  # noqa: E402

MODEL = ["--config.model.num_layers=4", "--config.data.seq_len=64", "--config.mesh.pipeline=4", "--config.mesh.fsdp=2",
         "--config.model.remat=none"]
WIDTHS = {  # d_model, query heads, kv heads, d_ff, vocabulary
    "small": (256, 4, 4, 1024, 512), "70b": (8192, 64, 8, 28672, 1024), "405b": (16384, 128, 8, 53248, 1024)}
VARIANTS = {"gpipe": ["--config.pipeline.schedule=gpipe"],
            "gpipe+stage_remat": ["--config.pipeline.schedule=gpipe", "--config.pipeline.stage_remat=true"],
            "1f1b": ["--config.pipeline.schedule=1f1b"], "zb": ["--config.pipeline.schedule=zb"],
            "interleaved_1f1b": ["--config.pipeline.schedule=interleaved_1f1b", "--config.pipeline.repeats=2",
                                 "--config.model.num_layers=8"]}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--microbatches", default="4,8,16")
  parser.add_argument("--rows", type=int, default=4, help="sequences per microbatch (0: batch 32 for every M)")
  parser.add_argument("--widths", default="small", choices=sorted(WIDTHS))
  parser.add_argument("--schedules", default="gpipe,gpipe+stage_remat,1f1b,zb")
  args, extra = parser.parse_known_args()
  d, n, k, f, v = WIDTHS[args.widths]
  widths = [f"--config.model.d_model={d}", f"--config.model.num_heads={n}", f"--config.model.num_kv_heads={k}",
            f"--config.model.d_ff={f}", f"--config.model.vocab_size={v}"]
  print(f"jax {jax.__version__}, {platform.processor() or platform.machine()}, {jax.device_count()} CPU devices")
  print(f"widths {args.widths}: d_model {d}, heads {n}/{k}, d_ff {f}, vocabulary {v}")
  print(f"{'schedule':20} {'M':>3} {'temp MiB':>9} {'bubble':>7}  held microbatches per stage")
  for m in (int(x) for x in args.microbatches.split(",")):
    for name in args.schedules.split(","):
      variant = VARIANTS[name]
      batch = args.rows * m if args.rows else 32
      cfg = config_lib.load(MODEL + widths + variant + [f"--config.pipeline.microbatches={m}", f"--config.data.batch_size={batch}"]
                            + extra)
      program = build_lib.program_for(cfg, jax.devices(), require_data=False)
      memory = program.lower().compile().memory_analysis()
      tab = schedules.table(program.plan.pipeline)
      print(f"{name:20} {m:3d} {memory.temp_size_in_bytes / 2**20:9.2f} {schedules.bubble(tab):7.4f}  "
            f"{[int(x) for x in schedules.held(tab)]}", flush=True)


if __name__ == "__main__":
  main()
