"""Entry point: Hugging Face checkpoints in and out (maxtrain/interop/; the families of docs/models.md).

  python -m maxtrain.convert from-hf HF_DIR OUT [--config=BASE.py] [--vocab-multiple=128] [--dtype=keep]
                                  [--block-size=8MB]
  python -m maxtrain.convert to-hf CHECKPOINT OUT [--max-shard-size=2GB] [--dtype=keep] [--block-size=8MB]
                                 [--process-index=I --num-processes=N]  (default: from SLURM/MPI/k8s env)

Exit codes: 0 done, 2 unsupported or bad input (one line naming the field or file).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from maxtrain.cli import shell
from maxtrain.runtime import cluster

UNITS = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "B": 1}
BLOCK_HELP = "the most of one tensor held at once (fp32 bytes); peak memory is a few blocks above the imports"


def parse_size(text: str) -> int:
  for unit, scale in UNITS.items():
    if text.upper().endswith(unit):
      return int(float(text[:-len(unit)]) * scale)
  return int(text)


def parser() -> argparse.ArgumentParser:
  p = shell.ArgumentParser(prog="python -m maxtrain.convert", description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="command", required=True)
  a = sub.add_parser("from-hf", help="a Hugging Face directory of a registered family (docs/models.md) -> converted checkpoint + config.py")
  a.add_argument("hf_dir")
  a.add_argument("out")
  a.add_argument("--config", default=None, help="base maxtrain config preset for the written config.py")
  a.add_argument("--vocab-multiple", type=int, default=128, help="pad the vocabulary up to a multiple of this")
  a.add_argument("--dtype", default="keep", help="keep | float32 | bfloat16: stored parameter dtype")
  a.add_argument("--block-size", default="8MB", help=BLOCK_HELP)
  b = sub.add_parser("to-hf", help="a run / checkpoint step / converted checkpoint -> a Hugging Face directory")
  b.add_argument("checkpoint")
  b.add_argument("out")
  b.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (a bigger tensor gets its own)")
  b.add_argument("--dtype", default="keep", help="keep | float32 | bfloat16")
  b.add_argument("--block-size", default="8MB", help=BLOCK_HELP)
  b.add_argument("--process-index", type=int, default=None, help="this process's share of the files (i of n)")
  b.add_argument("--num-processes", type=int, default=None, help="processes sharing the export (default: the "
                 "launcher's, detected as for training, else 1)")
  return p


def process_share(args: argparse.Namespace) -> tuple[int, int]:
  """(index, count) of this process among those exporting together."""
  if args.num_processes is None and args.process_index is None:
    found = cluster.detect(os.environ)
    return (found.process_id, found.num_processes) if found else (0, 1)
  return args.process_index or 0, args.num_processes or 1


def convert(invocation: shell.Invocation) -> None:
  args = invocation.args
  if args.command == "from-hf":
    from maxtrain.interop.hf_import import from_hf  # jax only after the flags: --help without it

    summary = from_hf(args.hf_dir, args.out, vocab_multiple=args.vocab_multiple, dtype=args.dtype,
                      base_config=args.config, block_bytes=parse_size(args.block_size))
    print(f"converted {summary['parameters'] / 1e6:.2f}M parameters ({summary['bytes'] / 1e6:.1f} MB) in "
          f"{summary['seconds']:.1f}s to {args.out}; train with --config={args.out}/config.py")
  else:
    from maxtrain.interop.hf_export import to_hf  # jax only after the flags: --help without it

    index, count = process_share(args)
    summary = to_hf(args.checkpoint, args.out, max_shard_bytes=parse_size(args.max_shard_size), dtype=args.dtype,
                    block_bytes=parse_size(args.block_size), process_index=index, process_count=count)
    print(f"wrote {summary['tensors']} tensors ({summary['bytes'] / 1e6:.1f} MB) in {summary['files']} files in "
          f"{summary['seconds']:.1f}s to {args.out}")


# `--config` here is from-hf's base preset for the written config.py, not the run's config: not split off.
COMMAND = shell.Command(name="maxtrain.convert", prog="python -m maxtrain.convert", parser=parser, config=False)


def main(argv: Sequence[str] | None = None) -> int:
  return shell.run(COMMAND, convert, argv)

if __name__ == "__main__":
  sys.exit(main())
