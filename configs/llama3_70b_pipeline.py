"""LLaMA 3 70B (configs/llama3_70b.py) over several trn2.48xlarge nodes, the layer stack pipelined across
nodes (`mesh.dcn_pipeline`, docs/sharding.md): only the activations at stage boundaries cross the
network, while FSDP and tensor parallelism stay on each node's NeuronLink. Check it fits:

  python -m maxtrain.compile --config=configs/llama3_70b_pipeline.py --config.hardware=trn2.48xlarge \
      --devices 256 --device-memory-gb 24

4 nodes = 4 stages of 20 layers; 8, 12, ... nodes add FSDP copies of each stage across nodes
(`mesh.dcn_fsdp` fills them). `HARDWARE` refines the generic presets of maxtrain/config/hardware.py.

repeats=1 (bubble 3/7): with 2 repeats (bubble 3/11) XLA gathers the layer stack's shards to build each stage's
repeats, and the step needs 24.27 GiB, over the core's 24 (BENCHMARKS.md).
"""

from pathlib import Path

from maxtrain.config import load_file


def get_config():
  c, _ = load_file(Path(__file__).with_name("llama3_70b.py"))
  c.output_dir = "runs/llama3_70b_pipeline"
  return c


# 24 GiB per logical core (LNC=2). Each node is one stage: fsdp=16 x tensor=4 over its 64 cores. The
# 256 sequences give each of the 16 batch shards 16 per step: 4 accumulation steps of 4, one sequence
# per pipeline microbatch (M=4 >= 4 stages): bubble 3/7. Circular repeats would cut it (R=5: 3/23) but
# do not fit (module doc). GPipe order would keep every iteration's layer inputs
# (~12.5 GiB of bf16 per core); `pipeline.stage_remat` keeps only each iteration's stage input and
# recomputes the stage's 4 layers in the backward (one more forward of the layers). Context
# parallelism (the single-node trn2 preset's answer to 8192-token sequences) does not run under the
# pipeline. Compiled peak and estimate: BENCHMARKS.md.
HARDWARE = {
    "trn2.48xlarge": {"mesh.dcn_pipeline": 4, "mesh.dcn_data": 1, "mesh.dcn_fsdp": -1, "mesh.fsdp": 16,
                      "mesh.context": 1, "mesh.tensor": 4, "pipeline.repeats": 1, "pipeline.microbatches": 4,
                      "pipeline.stage_remat": True, "optimizer.microbatch_size": 4},
}
