"""LLaMA 3 8B (configs/llama3_8b.py) for a long-context phase at 131072 tokens per sequence, the
sequence split over the devices of a node by context parallelism (`mesh.context`; attention
all-gathers keys and values, maxtrain/sharding/context_attention.py):

  python -m maxtrain.compile --config=configs/llama3_8b_128k.py --config.hardware=h200x8 --devices 8 \
      --device-memory-gb 131

Each GPU holds 16384 tokens of every sequence (one sequence per microbatch over the node's 8 GPUs).
RoPE is plain (theta 500000): LLaMA 3.1's long-context frequency scaling is not a key on this
branch; continue from a checkpoint of the 8K run either way (resume reshards onto the new mesh).

`HARDWARE` refines the generic presets of maxtrain/config/hardware.py for this model (per node).
"""

from pathlib import Path

from maxtrain.config import load_file


def get_config():
  c, _ = load_file(Path(__file__).with_name("llama3_8b.py"))
  c.output_dir = "runs/llama3_8b_128k"
  c.model.max_seq_len = c.data.seq_len = 131072
  c.data.batch_size = 8  # 1M tokens per step
  c.optimizer.microbatch_size = 1
  c.steps = 1000
  return c


# The node's devices all on the sequence (context), parameters FSDP-sharded over them through the
# context axis (rules: embed -> fsdp x context); nodes data-parallel (the generic presets'
# dcn_data=-1). Peak per device: BENCHMARKS.md.
_CONTEXT_NODE = {"mesh.fsdp": 1, "mesh.context": 8, "optimizer.microbatch_size": 1}
HARDWARE = {
    "h100x8": _CONTEXT_NODE,
    "h200x8": _CONTEXT_NODE,
    # 16 chips x tensor=4 cores each: the sequence over the 16 chips (8192 tokens per core).
    "trn2.48xlarge": {"mesh.fsdp": 1, "mesh.context": 16, "optimizer.microbatch_size": 1},
    "cpu": {"data.batch_size": 8, "mesh.fsdp": 1, "mesh.context": -1},
}
