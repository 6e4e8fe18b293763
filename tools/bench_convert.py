"""Peak host memory of `python -m maxtrain.convert` both ways on a synthetic LLaMA checkpoint.

  python tools/bench_convert.py [--dir=/tmp/bench_convert] [--dtype=bfloat16] [--layers=16] [--keep]

Builds a Hugging Face `LlamaForCausalLM` directory of random weights (LLaMA 3.2 1B shapes by default:
d_model 2048, 16 layers, 32 heads / 8 kv heads, d_ff 8192, vocabulary 128256; a separate lm_head
unless --tied), then runs `from-hf` and `to-hf` each in its own subprocess and reads that process's
peak resident set (`os.wait4` ru_maxrss, which counts every page the process touched, mapped files
included). A third subprocess that only imports what the converter imports gives the baseline.
The exported files are compared byte for byte with the originals (tensor by tensor).

The synthetic checkpoint is written by a subprocess too: Linux keeps ru_maxrss across fork + exec,
so a child forked from a parent that had held the tensors would report the parent's size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes  # noqa: F401 - numpy learns bfloat16
import numpy as np

REPO = Path(__file__).resolve().parent.parent
IMPORTS = ("import jax, numpy, orbax.checkpoint, tensorstore; import maxtrain.interop.hf_import, "
           "maxtrain.interop.hf_export; jax.devices()")


def hf_config(args) -> dict:
  return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "hidden_size": args.d_model, "intermediate_size": args.d_ff, "num_hidden_layers": args.layers,
          "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads, "vocab_size": args.vocab,
          "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "tie_word_embeddings": args.tied, "torch_dtype": args.dtype, "bos_token_id": 0, "eos_token_id": 1}


def tensor_shapes(args) -> list[dict[str, tuple[int, ...]]]:
  """One dict per file: the embedding, each layer, the final norm and head."""
  d, f, h = args.d_model, args.d_ff, args.d_model // args.heads
  q, kv = args.heads * h, args.kv_heads * h
  files = [{"model.embed_tokens.weight": (args.vocab, d)}]
  for i in range(args.layers):
    p = f"model.layers.{i}."
    files.append({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                  p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                  p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                  p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                  p + "mlp.down_proj.weight": (d, f)})
  files.append({"model.norm.weight": (d,), **({} if args.tied else {"lm_head.weight": (args.vocab, d)})})
  return files


def build(hf_dir: Path, args) -> tuple[int, int]:
  """Writes the synthetic checkpoint; returns (parameters, largest tensor bytes)."""
  from safetensors.numpy import save_file

  hf_dir.mkdir(parents=True)
  rng, weight_map, count, largest = np.random.default_rng(0), {}, 0, 0
  files = tensor_shapes(args)
  for i, shapes in enumerate(files):
    name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
    tensors = {k: (rng.standard_normal(s, np.float32) * 0.02).astype(args.dtype) for k, s in shapes.items()}
    save_file(tensors, str(hf_dir / name), metadata={"format": "pt"})
    for k, v in tensors.items():
      weight_map[k], count, largest = name, count + v.size, max(largest, v.nbytes)
    del tensors
  (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
  (hf_dir / "config.json").write_text(json.dumps(hf_config(args)))
  return count, largest


def peak_rss(argv: list[str]) -> tuple[float, int]:
  """(seconds, peak RSS bytes) of one child process; exits if it fails."""
  t0 = time.monotonic()
  env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
  p = subprocess.Popen([sys.executable, *argv], env=env, cwd=REPO)
  _, status, usage = os.wait4(p.pid, 0)
  if os.waitstatus_to_exitcode(status) != 0:
    sys.exit(f"{argv} failed with {os.waitstatus_to_exitcode(status)}")
  return time.monotonic() - t0, usage.ru_maxrss * 1024  # Linux: KiB


def same_tensors(a: Path, b: Path) -> int:
  """Number of tensors compared; exits on the first that differs."""
  from maxtrain.interop.safetensors_io import Reader

  ra, rb = Reader(a), Reader(b)
  for name in ra.names():
    if not np.array_equal(ra.read(name).view(np.uint8), rb.read(name).view(np.uint8)):
      sys.exit(f"{name} differs after the round trip")
  return len(ra.names())


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--dir", default="/tmp/bench_convert")
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  p.add_argument("--layers", type=int, default=16)
  p.add_argument("--d-model", type=int, default=2048)
  p.add_argument("--d-ff", type=int, default=8192)
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--vocab", type=int, default=128256)
  p.add_argument("--tied", action="store_true")
  p.add_argument("--max-shard-size", default="2GB")
  p.add_argument("--block-size", default=None, help="convert's --block-size (default: its own)")
  p.add_argument("--keep", action="store_true", help="keep the directories (default: delete them)")
  p.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  root = Path(args.dir)
  if args.build_only:
    print(json.dumps(build(root / "hf", args)))
    return
  shutil.rmtree(root, ignore_errors=True)
  built = subprocess.run([sys.executable, __file__, "--build-only", *sys.argv[1:]], check=True, text=True,
                         stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
  count, largest = json.loads(built.stdout.splitlines()[-1])
  print(f"{count / 1e9:.3f}B parameters, {args.dtype}, largest tensor {largest / 2**20:.0f} MiB, blocks "
        f"{args.block_size or 'default'}; "
        f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}")
  rows = [("imports only", *peak_rss(["-c", IMPORTS]))]
  block = [f"--block-size={args.block_size}"] if args.block_size else []
  rows.append(("from-hf", *peak_rss(["-m", "maxtrain.convert", "from-hf", str(root / "hf"), str(root / "mt"), *block])))
  rows.append(("to-hf", *peak_rss(["-m", "maxtrain.convert", "to-hf", str(root / "mt"), str(root / "hf2"),
                                   f"--max-shard-size={args.max_shard_size}", *block])))
  checked = same_tensors(root / "hf", root / "hf2")
  print(f"round trip bitwise: {checked} tensors")
  base = rows[0][2]
  print("| direction | time | peak RSS | above imports | / largest tensor |\n| --- | --- | --- | --- | --- |")
  for name, seconds, rss in rows:
    print(f"| {name} | {seconds:.1f} s | {rss / 2**20:.0f} MiB | {(rss - base) / 2**20:.0f} MiB | "
          f"{(rss - base) / largest:.2f} |")
  if not args.keep:
    shutil.rmtree(root)


if __name__ == "__main__":
  main()
