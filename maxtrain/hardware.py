"""Hardware presets: `--config.hardware=NAME` sets the keys below before the `--config.*`
overrides (which win), so one model config runs on a laptop, a GPU node or a Trainium node.

A preset describes ONE node; the node count comes from the launch (the `-1` DCN axis fills it).
A model config file may add or refine presets in a module-level `HARDWARE` dict of the same form
(its entries are applied over these), e.g. a smaller batch or full remat for a big model.

To add a preset: add an entry here (platform, per-node mesh, dtypes) and, where a model needs
more, an entry in that model's `HARDWARE`; check it with `python -m maxtrain.compile`.
"""

from __future__ import annotations

from typing import Any

Preset = dict[str, Any]  # dotted config key -> value

PRESETS: dict[str, Preset] = {
    # The CPU default: fp32 compute (bf16 is slower than fp32 on CPU), all devices on FSDP.
    "cpu": {
        "runtime.platform": "cpu",
        "model.compute_dtype": "float32",
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
  from maxtrain.errors import UserError

  model_presets = model_presets or {}
  if name not in PRESETS and name not in model_presets:
    known = sorted(set(PRESETS) | set(model_presets))
    raise UserError(f"config.hardware={name!r}: unknown hardware preset; choose one of {', '.join(known)}, "
                    "or add one to maxtrain/hardware.py (see its docstring)")
  return {**PRESETS.get(name, {}), **model_presets.get(name, {})}
