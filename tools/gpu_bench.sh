#!/usr/bin/env bash
# GPU throughput check: LLaMA 3 8B widths at reduced depth, bf16, the default attention (`auto`: cuDNN on a
# GPU) and the chunked loss, on every GPU of this machine; prints tokens/s and MFU against the GPU's bf16
# dense peak (maxtrain/monitor/mfu.py: 989 TFLOP/s for an H100/H200 SXM). On one H200 (2026-12-04) it took
# 70 s for both precisions: 38.8% MFU bf16, 44.1% FP8 (BENCHMARKS.md, "First GPU run"). Check cuDNN's masking
# on the same machine with `python3 tools/gpu_attention_check.py`.
# Precisions: QUANT lists model.quantization values, each run in turn (default "none fp8": bf16, then
# FP8 matmuls for attention, MLP and experts: docs/low_precision.md); ROUNDS > 1 alternates them again, so
# the machine's drift shows as a spread rather than as a ratio. OFFLOAD lists optimizer.offload values
# (default "none"; "none host" adds the rows with the optimizer state in host memory, streamed through the
# device in optimizer.offload_groups groups, docs/optimizers.md), run for each precision; REMAT lists
# model.remat values (default "full", the preset's; "full offload" adds the rows with the residual and MLP input in host
# memory, docs/fitting.md), run for each precision and offload. OFFLOAD_CHECK=1 first runs
# tools/offload_memory_check.py (device and host bytes of offload off / all at once / streamed, and a bitwise
# check of two steps), about a minute on one H200.
#
#   tools/gpu_bench.sh                 # uses the python3 that has a CUDA jax
#   LAYERS=8 STEPS=20 tools/gpu_bench.sh
#   QUANT=fp8 tools/gpu_bench.sh       # FP8 only
#   QUANT=none OFFLOAD="none host" tools/gpu_bench.sh   # bf16, the optimizer state on the device, then in host memory
#   QUANT=none OFFLOAD="none host" REMAT="full offload" OFFLOAD_CHECK=1 tools/gpu_bench.sh   # issue 40's rows
#   QUANT=none WINDOW=4096 tools/gpu_bench.sh           # Mistral's 4096-token sliding window on every layer
#   ATTENTION=flash tools/gpu_bench.sh                  # another model.attention than auto (cuDNN on a GPU)
#
# Dependencies: a CUDA jax must already be importable (`pip install -U "jax[cuda12]"` or the
# machine's image); maxtrain's other pure-Python dependencies come from wheels in $WHEELS
# (default .gpu_wheels/, made with `tools/gpu_bench.sh --download` on a machine with PyPI), so it
# also runs on a machine that reaches no package index.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.gpu_wheels}
PY=${PY:-python3}

if [[ "${1:-}" == "--download" ]]; then
  # Wheels for CPython 3.12 on x86_64 Linux (the accelerator images' Python), no compiled jax.
  "$PY" -m pip download -q -d "$WHEELS" --only-binary=:all: --python-version 3.12 \
      --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
      grain array-record ml-collections tensorboardX google-crc32c platformdirs portpicker --no-deps
  ls "$WHEELS"
  exit 0
fi

missing=$("$PY" - <<'EOF'
import importlib.util
need = {"grain": "grain", "ml_collections": "ml-collections", "tensorboardX": "tensorboardX",
        "google_crc32c": "google-crc32c", "platformdirs": "platformdirs", "array_record": "array-record",
        "portpicker": "portpicker"}
print(" ".join(p for m, p in need.items() if importlib.util.find_spec(m) is None))
EOF
)
if [[ -n "$missing" ]]; then
  if [[ -d "$WHEELS" ]]; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/maxtrain_deps "$WHEELS"/*.whl
    export PYTHONPATH="/tmp/maxtrain_deps:${PYTHONPATH:-}"
  else
    "$PY" -m pip install -q $missing
  fi
fi
"$PY" -c "import jax; d = jax.devices(); assert d[0].platform == 'gpu', d; print(len(d), 'x', d[0].device_kind)"

export PYTHONPATH=".:${PYTHONPATH:-}"
num_gpus=$("$PY" -c 'import jax; print(jax.device_count())')
read -r -a quants <<< "${QUANT:-none fp8}"
read -r -a offloads <<< "${OFFLOAD:-none}"
read -r -a remats <<< "${REMAT:-full}"
if [[ "${OFFLOAD_CHECK:-0}" == 1 ]]; then
  echo "== tools/offload_memory_check.py"
  "$PY" tools/offload_memory_check.py --groups 1,16 --config.model.compute_dtype=bfloat16
fi
for round in $(seq 1 "${ROUNDS:-1}"); do
  for quant in "${quants[@]}"; do
    for offload in "${offloads[@]}"; do
      for remat in "${remats[@]}"; do
        echo "== round $round: model.quantization=$quant optimizer.offload=$offload model.remat=$remat"
        "$PY" tools/bench.py --steps "${STEPS:-10}" --config=configs/llama3_8b.py --config.hardware= \
            --config.runtime.platform=gpu --config.model.compute_dtype=bfloat16 \
            --config.model.quantization="$quant" --config.optimizer.offload="$offload" --config.model.remat="$remat" \
            --config.model.num_layers="${LAYERS:-4}" --config.model.attention="${ATTENTION:-auto}" \
            --config.model.sliding_window="${WINDOW:-0}" --config.data.corpus=python-stdlib --config.data.tokenizer=byte \
            --config.data.seq_len=8192 --config.data.batch_size="$((2 * num_gpus))" \
            --config.mesh.fsdp=-1 --config.optimizer.microbatch_size=0 --config.optimizer.grad_accum_steps=1
      done
    done
  done
done
