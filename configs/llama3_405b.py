"""LLaMA 3 405B (Meta's published shapes: 126 layers, d_model 16384, 128 query / 8 key-value heads,
SwiGLU 53248, vocabulary 128256, RoPE theta 500000) on GPU nodes, pipelined across nodes
(`mesh.dcn_pipeline`, docs/sharding.md), for a real tokenizer and token store. Check it fits:

  python -m maxtrain.compile --config=configs/llama3_405b.py --config.hardware=h200x8 --devices 144 \
      --device-memory-gb 131

`HARDWARE` refines the generic presets of maxtrain/config/hardware.py for this model (per node).
"""

from pathlib import Path

from maxtrain.config import load_file


def get_config():
  c, _ = load_file(Path(__file__).with_name("llama3_70b.py"))
  c.output_dir = "runs/llama3_405b"
  m = c.model
  m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.d_ff = 126, 16384, 128, 8, 53248
  c.data.batch_size = 1152  # 9.4M tokens per step at 8192 (Meta: 8M); 1152 = 9 stages x 128
  o = c.optimizer
  o.lr, o.adam_lr, o.warmup_steps = 8e-5, 8e-5, 8000
  return c


# fp32 parameters and Adam moments are 4.9 TB (16 B per parameter with the gradients, +4 B for the
# guarded update's copy). A layer is 3.2B parameters, too big to all-gather whole on one GPU (FSDP
# inside a node would gather 19 GiB per layer), so tensor parallelism splits every layer over the
# node's 8 GPUs (NVLink) and the pipeline splits the 126 layers into 9 stages of whole nodes: only
# stage-boundary activations cross InfiniBand, plus FSDP's gathers over the `dcn_fsdp` copies of a
# stage (the remaining nodes: 2 on 18 nodes). Each batch shard runs 9 sequences per accumulation step,
# one per pipeline microbatch; `pipeline.stage_remat` keeps one [T, D] stage input per iteration
# instead of 14 layers' inputs. repeats=1: with repeats > 1 the compiled step reshuffles the whole layer
# stack through every device (docs/sharding.md), so the bubble is (9-1)/(9+9-1) = 47%; more
# microbatches shrink it at the cost of more saved stage inputs. Compiled peak on 18 H200 nodes
# (144 devices): 104.4 GiB of 131 (BENCHMARKS.md).
_ACROSS_NODES = {"mesh.dcn_pipeline": 9, "mesh.dcn_data": 1, "mesh.dcn_fsdp": -1, "mesh.fsdp": 1, "mesh.tensor": 8,
                 "pipeline.repeats": 1, "pipeline.microbatches": 9, "pipeline.stage_remat": True,
                 "optimizer.microbatch_size": 9}
HARDWARE = {
    "h200x8": _ACROSS_NODES,  # 18 nodes (144 GPUs) or any multiple of 9
    # 80 GB per GPU: the H200 layout needs 104 GiB, so the H100 preset trains at 4096 tokens (Meta's first
    # 405B phase) on 36 nodes (dcn_fsdp=4 copies of each stage; BENCHMARKS.md).
    "h100x8": {**_ACROSS_NODES, "data.seq_len": 4096},
}
