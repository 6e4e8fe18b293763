"""DeepSeek-V3 (671B parameters, 37B active per token) on H200 nodes: `model.family=deepseek_v3` alone is the
published model (61 layers, d_model 7168, MLA with q/kv latents 1536/512 and a 64-dim RoPE head, the first 3
layers dense (18432), then 256 routed experts of 2048 with 8 per token in groups of 32 (4 of 8 groups compete)
plus a shared expert, vocabulary 129280, YaRN RoPE factor 40): the family's defaults (docs/models.md), so
this file sets only how it trains. Check it fits:

  python -m maxtrain.compile --config=configs/deepseek_v3_671b.py --config.hardware=h200x8 --devices 256 \
      --device-memory-gb 131

`HARDWARE` refines the generic presets of maxtrain/config/hardware.py for this model (per node): a pipeline of
2 stages of 16 nodes each (`mesh.dcn_pipeline=2`): stage 0 holds MoE layers 4-32, stage 1 layers 33-61, so only
one microbatch's [T, D] activations cross between the two halves. Inside a stage each node's 8 GPUs split the
256 routed experts (`mesh.expert=8`, 32 per GPU, tokens sent by all-to-all over NVLink) and the stage's 16 nodes
shard every parameter FSDP-style (`mesh.dcn_fsdp`). The 3 dense first layers run before the pipeline on every
stage (docs/sharding.md, "MoE layers under the pipeline": 58 MoE layers split 29 + 29; 61 would not split). Each
batch shard runs its 8 sequences as the pipeline's 8 microbatches (bubble (2-1)/(8+2-1) = 11%), one step without
accumulation; `pipeline.stage_remat` keeps one [T, D] input per stage iteration. gpipe, because the preset keeps
DeepSeek's small balance loss: its gradient needs the whole batch's expert loads, which 1f1b does not have when it
runs the first backward (exit 2 with 1f1b unless model.moe.aux_loss_weight=0). Capacity dispatch: XLA on a stock
GPU build lowers dropless dispatch's `ragged_dot` densely over every expert (docs/fitting.md). The fp32 state is
20 B a parameter (weights, two Adam moments, the guarded update's copy), 13.4 TB, so 32 nodes is about the
fewest: docs/fitting.md has the estimate and the compiled figures.
"""

from maxtrain.config import base_config


def get_config():
  c = base_config()
  c.output_dir = "runs/deepseek_v3_671b"
  m = c.model
  m.family = "deepseek_v3"  # every shape the published model's (the family's defaults)
  m.max_seq_len = 4096  # pretraining length (DeepSeek: 4K, then YaRN extension to 128K)
  m.remat, m.compute_dtype, m.attention = "full", "bfloat16", "flash"
  e = m.moe
  # Expert parallelism sends tokens by fixed-capacity all-to-all (capacity dispatch); DeepSeek's aux-loss-free
  # balancing (bias speed 0.001) and a small balance loss keep the load even enough for 1.25 x capacity.
  e.dispatch, e.capacity_factor = "capacity", 1.25
  e.aux_loss_weight, e.router_z_loss_weight, e.bias_update_rate = 1e-4, 0.0, 1e-3
  c.data.corpus = ""  # needs a real token store: set data.path
  c.data.seq_len, c.data.batch_size = 4096, 1024
  o = c.optimizer
  o.lr, o.adam_lr, o.warmup_steps, o.min_lr_ratio, o.weight_decay = 2.2e-4, 2.2e-4, 2000, 0.1, 0.1
  c.steps = 100_000
  c.checkpoint.every_steps = 250
  c.eval.every_steps, c.eval.batches = 1000, 16
  return c


HARDWARE = {
    "h200x8": {"mesh.fsdp": 1, "mesh.expert": 8, "mesh.dcn_pipeline": 2, "mesh.dcn_data": 1, "mesh.dcn_fsdp": -1,
               "pipeline.microbatches": 8, "pipeline.stage_remat": True, "optimizer.microbatch_size": 8},
    "cpu": {"data.batch_size": 8},
}
