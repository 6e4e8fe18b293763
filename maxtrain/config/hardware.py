"""Hardware presets: `--config.hardware=NAME` sets the keys below before the `--config.*`
overrides (which win), so one model config runs on a laptop, a GPU node or a Trainium node.
`hardware=auto` (the default) picks the preset of the machine's accelerators (`detect`).

A preset describes ONE node; the node count comes from the launch (the `-1` DCN axis fills it).
A model config file may add or refine presets in a module-level `HARDWARE` dict of the same form
(its entries are applied over these), e.g. a smaller batch or full remat for a big model.

To add a preset: add an entry here (platform, per-node mesh, dtypes) and, where a model needs
more, an entry in that model's `HARDWARE`; check it with `python -m maxtrain.compile`.
"""

from __future__ import annotations

import functools
import glob
import shutil
import subprocess
from pathlib import Path
from typing import Any

from maxtrain.errors import UserError

Preset = dict[str, Any]  # dotted config key -> value

PRESETS: dict[str, Preset] = {
    # The CPU default: fp32 compute (bf16 is slower than fp32 on CPU), all devices on FSDP. Four
    # layers per scan iteration: XLA:CPU otherwise zero-fills and copies every layer's stacked
    # residuals (1.1-1.4x faster default step, BENCHMARKS.md "Where the step's time goes").
    "cpu": {
        "runtime.platform": "cpu",
        "model.compute_dtype": "float32",
        "model.scan_unroll": 4,
        "mesh.data": 1, "mesh.fsdp": -1, "mesh.tensor": 1, "mesh.dcn_data": 1, "mesh.dcn_fsdp": 1,
    },
    # 8 x H100/H200 SXM per node (NVLink inside, InfiniBand/RoCE across): FSDP over the node's 8 GPUs,
    # data parallel across nodes. bf16 matmuls, fp32 parameters and optimizer state.
    "h100x8": {
        "runtime.platform": "gpu",
        "model.compute_dtype": "bfloat16",
        "mesh.data": 1, "mesh.fsdp": 8, "mesh.tensor": 1, "mesh.dcn_data": -1, "mesh.dcn_fsdp": 1,
    },
    "h200x8": {
        "runtime.platform": "gpu",
        "model.compute_dtype": "bfloat16",
        "mesh.data": 1, "mesh.fsdp": 8, "mesh.tensor": 1, "mesh.dcn_data": -1, "mesh.dcn_fsdp": 1,
    },
    # trn2.48xlarge: 16 Trainium2 chips = 64 logical NeuronCores at LNC=2 (JAX devices). Tensor
    # parallelism over 4 consecutive cores, FSDP over the 16 groups; data parallel across nodes.
    "trn2.48xlarge": {
        "runtime.platform": "neuron",
        "runtime.neuron_target": "trn2",
        "model.compute_dtype": "bfloat16",
        "mesh.data": 1, "mesh.fsdp": 16, "mesh.tensor": 4, "mesh.dcn_data": -1, "mesh.dcn_fsdp": 1,
    },
}


def preset(name: str, model_presets: dict[str, Preset] | None = None) -> Preset:
  """The keys of preset `name`: the generic entry, then the model config's own entry over it."""
  model_presets = model_presets or {}
  if name not in PRESETS and name not in model_presets:
    known = sorted(set(PRESETS) | set(model_presets))
    raise UserError(f"config.hardware={name!r}: unknown hardware preset; choose one of {', '.join(known)}, "
                    "auto, or add one to maxtrain/config/hardware.py (see its docstring)")
  return {**PRESETS.get(name, {}), **model_presets.get(name, {})}


# GPU name (as nvidia-smi prints it) -> preset, for a node of exactly 8 such GPUs.
GPU_PRESETS = {"H100": "h100x8", "H200": "h200x8"}
# EC2 instance type (the DMI product name on Nitro instances) -> preset.
INSTANCE_PRESETS = {"trn2.48xlarge": "trn2.48xlarge"}
DMI_PRODUCT = "/sys/devices/virtual/dmi/id/product_name"


def choose(gpus: list[str], neuron_devices: int, instance_type: str) -> tuple[str, str]:
  """(preset name or "" for none, the reason) from what the machine has: GPU names, the number of
  Neuron devices, the instance type. A pure function of its inputs (`detect` gathers them)."""
  if gpus:
    kinds = sorted(set(gpus))
    found = f"{len(gpus)} x {', '.join(kinds)}"
    matches = [p for key, p in GPU_PRESETS.items() if len(kinds) == 1 and key in kinds[0]]
    if matches and len(gpus) == 8:
      return matches[0], f"{found} (nvidia-smi): preset {matches[0]}"
    return "", (f"{found} (nvidia-smi): no preset for this node (presets: {', '.join(GPU_PRESETS.values())}); "
                "JAX picks the platform, set --config.hardware and mesh.* for a tuned layout")
  if neuron_devices:
    found = f"{neuron_devices} Neuron devices (/dev/neuron*) on {instance_type or 'an unknown instance type'}"
    if instance_type in INSTANCE_PRESETS:
      return INSTANCE_PRESETS[instance_type], f"{found}: preset {INSTANCE_PRESETS[instance_type]}"
    return "", f"{found}: no preset for it; set --config.hardware and runtime.neuron_* keys"
  return "cpu", "no NVIDIA GPU (nvidia-smi) and no Neuron device (/dev/neuron*): preset cpu"


@functools.cache
def detect() -> tuple[str, str]:
  """The preset for this machine, found without starting JAX: its flags (XLA_FLAGS, the Neuron
  compiler's) must be set before the backend starts, so JAX cannot be asked. The trainer checks the
  devices JAX then sees against the preset's platform (`runtime/platform.py` check_devices)."""
  gpus: list[str] = []
  if shutil.which("nvidia-smi"):
    try:
      out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30, check=False)
      gpus = [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
      gpus = []
  neuron = len([p for p in glob.glob("/dev/neuron*") if p[len("/dev/neuron"):].isdigit()])
  try:
    instance = Path(DMI_PRODUCT).read_text().strip()
  except OSError:
    instance = ""
  return choose(gpus, neuron, instance)
