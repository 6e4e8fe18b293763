"""The declaration of every config key: `base_config()`, each key on one line with its meaning in the
comment beside it (`key_docs` reads those comments back for `--help` and the docs test).

`configs/*.py` presets call `base_config()` and change a few keys.
"""

from __future__ import annotations

import ast
import contextvars
import difflib
import functools
import inspect
import io
import textwrap
import tokenize
from typing import Any

import ml_collections

from maxtrain.errors import UserError

# `model.*` values (dotted under model.) of the family whose published model a config file starts from: the
# loader (config/loader.py) sets them while the file runs, so its base_config() is that model's and whatever
# the file sets stays its own. Empty (llama, and every caller outside the loader): the keys as declared below.
FAMILY_BASE: contextvars.ContextVar[dict] = contextvars.ContextVar("family_base", default={})


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.hardware = "auto"  # Hardware preset applied before --config.* overrides: auto (detected), "" (none), cpu, h100x8, ...
  c.seed = 0  # All randomness (init, data order) derives from this.
  c.steps = 200  # Optimizer steps to train.
  c.output_dir = "runs/default"  # config.json, tensorboard/ and logs go here.
  c.log_every = 10  # Console line and TensorBoard scalars every N steps.

  c.model = m = ml_collections.ConfigDict()
  m.family = "llama"  # Model family (docs/models.md): llama | qwen2 (q/k/v biases) | qwen3 (qk-norm) | mistral (sliding window on every layer) | gemma2 (Gemma's norms, soft-capping, alternating windows) | gemma3 (Gemma 2's pieces, (1 + w) qk-norm, 5 local : 1 global windows, local RoPE base); see docs/models.md for all; a family's pieces are on whatever the keys below say; qwen3_moe, gpt_oss, deepseek_v3 default the keys below to their published model's (every key set in a file or on the command line wins).
  m.num_layers = 4  # Decoder blocks.
  m.d_model = 256  # Residual stream width.
  m.num_heads = 4  # Query heads; head_dim = d_model / num_heads unless model.head_dim is set.
  m.head_dim = 0  # Width of one attention head, independent of d_model / num_heads (Qwen3: 128); 0 = d_model / num_heads.
  m.qkv_bias = False  # Biases on the q, k and v projections (Qwen2); any family.
  m.qk_norm = False  # Per-head RMSNorm of q and k before RoPE (Qwen3); any family.
  m.attention_sinks = False  # A learned logit per head joining each softmax normaliser, no value (GPT-OSS); kernels dot, flash.
  m.o_bias = False  # A bias on the attention output projection (GPT-OSS); any family.
  m.sliding_window = 0  # Sliding-window attention: a query sees this many latest tokens (itself included) on the family's window layers (its pattern, or model.window_pattern's); 0 = off. Kernels dot, flash, blocked, cudnn skip keys outside it.
  m.window_pattern = 0  # Layer pattern of the window: layer i is global (full attention) iff (i + 1) % this == 0, the others local (Gemma 3: 6 = 5 local : 1 global; 2 alternates); 0 = the family's pattern; any family (layers then unscanned).
  m.rope_local_theta = 0.0  # RoPE base of the local (window-pattern) layers, unscaled (Gemma 3: 10000 beside a global rope_theta of 1e6); 0 = rope_theta and rope_scaling on every layer; any family.
  m.norm_one_plus = False  # RMSNorm as x / rms(x) * (1 + scale), the scale initialised to 0 (Gemma); any family.
  m.post_norms = False  # RMSNorm of the attention and MLP outputs before each residual add too (Gemma 2); any family.
  m.embed_scale = False  # Token embeddings times sqrt(d_model) (Gemma); any family.
  m.query_pre_attn_scalar = 0.0  # Attention scores scaled by this^-1/2 instead of head_dim^-1/2 (Gemma 2); 0 = head_dim.
  m.mlp_activation = "silu"  # The dense MLP's gate activation: silu (SwiGLU) | gelu_tanh (Gemma's GELU-tanh GLU); MoE experts keep theirs.
  m.attn_logit_softcap = 0.0  # Attention scores c * tanh(s / c) before the mask (Gemma 2: 50); 0 = off. Kernels dot and flash (forward and backward; auto runs flash where it would pick blocked or cudnn); decoding too.
  m.final_logit_softcap = 0.0  # Output logits c * tanh(z / c), in the loss (plain and chunked) and in generation (Gemma 2: 30); 0 = off.
  m.num_kv_heads = 2  # Key/value heads (grouped-query attention); divides num_heads.
  m.d_ff = 768  # SwiGLU hidden width.
  m.vocab_size = 384  # Embedding rows; >= the tokenizer's vocab (byte tokenizer: 259), padded for sharding.
  m.max_seq_len = 1024  # Longest sequence the model accepts (RoPE positions).
  m.rope_theta = 10000.0  # RoPE base frequency.
  m.rope_scaling = "none"  # RoPE frequency rescaling for long context: none | llama3 (LLaMA 3.1's rope_type) | linear (position interpolation: every frequency / rope_scaling_factor) | yarn (GPT-OSS, DeepSeek-V3).
  m.rope_scaling_factor = 8.0  # llama3: divisor of the low frequencies; linear: of every frequency; yarn: of the low ones (context extension factor).
  m.rope_low_freq_factor = 1.0  # llama3: wavelengths above original_max_len / this are fully rescaled.
  m.rope_high_freq_factor = 4.0  # llama3: wavelengths below original_max_len / this are kept.
  m.rope_original_max_len = 8192  # llama3: the context length the frequencies were first trained at.
  m.rope_beta_fast = 32.0  # yarn: dims turning more than this many times over rope_original_max_len keep their frequency.
  m.rope_beta_slow = 1.0  # yarn: dims turning fewer times than this are divided by rope_scaling_factor (a ramp between).
  m.rope_truncate = True  # yarn: the ramp's ends floored / ceiled to whole dims (GPT-OSS: False).
  m.rope_attention_factor = 0.0  # yarn: sin and cos are multiplied by this; 0 = 0.1 ln(rope_scaling_factor) + 1.
  m.norm_eps = 1e-5  # RMSNorm epsilon (imported models keep theirs: LLaMA 3 uses 1e-5, LLaMA 2 1e-6).
  m.tie_embeddings = False  # Reuse the input embedding as the output head.
  m.scan_layers = True  # Stack layers and lax.scan them: compile time independent of depth.
  m.scan_unroll = 1  # Layers per scan iteration (scan_layers): > 1 stacks fewer residuals (faster on CPU) but compiles k layer bodies.
  m.remat = "none"  # Activation checkpointing per layer: none | full | dots (save matmul outputs) | offload (save the residual and MLP input to host memory) | auto (the fastest that fits the target, from an AOT compile of each; docs/fitting.md).
  m.attention = "auto"  # Attention kernel: auto (cudnn on a GPU in bf16; else blocked for seq_len <= 1024, else flash) | dot (einsum reference, T x T scores) | flash (blockwise, linear memory) | blocked (query blocks, kept probabilities, T x T memory) | cudnn (NVIDIA, bf16/fp16) | nki (Trainium, not run here).
  m.attention_block_q = 128  # flash: query rows per block (measured on CPU: 128 best of 64-512).
  m.attention_block_kv = 128  # flash: key columns per block.
  m.param_dtype = "float32"  # Storage dtype of parameters.
  m.compute_dtype = "float32"  # Matmul dtype (bf16 on accelerators; fp32 is faster on CPU).
  m.mtp_layers = 0  # Multi-token prediction depths (DeepSeek-V3: 1): depth k predicts token t+k+1 through one more block of the family (models/mtp.py); 0 = off.
  m.mtp_loss_weight = 0.3  # Weight of the mean over depths of the MTP cross-entropy in the objective (DeepSeek-V3: 0.3, later 0.1).
  m.loss_chunk_tokens = -1  # Chunked cross-entropy, tokens per device per chunk (no full [B,T,V] logits); 0 = off; -1 = auto (2048 when vocab_size >= 4096).
  m.quantization = "none"  # Low-precision matmuls: none | fp8 (E4M3 forward, E5M2 gradients; H100/H200, CPU emulated) | int8 (forward only); docs/low_precision.md.
  m.quant_kinds = "attention,mlp,experts"  # Matmul kinds model.quantization applies to, of attention, mlp, experts, head.
  m.quant_min_dim = 128  # Matmuls whose contraction or output width is below this stay in compute_dtype (too small to gain).
  m.quant_margin = 0  # Powers of two of headroom between a tensor's amax and the format's max (current scaling).
  m.quant_saturate = True  # Clip scaled values to the format's range; False: overflow becomes NaN/Inf (the guards skip the step).
  m.moe = e = ml_collections.ConfigDict()  # Mixture of experts (maxtrain/models/moe.py); num_experts=0: dense.
  e.num_experts = 0  # Routed experts per MoE layer; 0 = every layer a dense SwiGLU MLP (the default).
  e.experts_per_token = 2  # Routed experts each token goes to (top-k).
  e.num_shared_experts = 0  # Experts every token goes to as well (DeepSeek), each expert_d_ff wide.
  e.expert_d_ff = 256  # SwiGLU hidden width of each routed and shared expert.
  e.first_dense_layers = 0  # The first k layers keep the dense model.d_ff MLP (DeepSeek-V3: 3).
  e.router = "softmax"  # softmax (Mixtral: top-k of the softmax, renormalised) | sigmoid (DeepSeek-V3: top-k sigmoid scores, normalised).
  e.norm_topk_prob = True  # Weights of the chosen experts renormalised to sum 1; False: the chosen scores as they are (Qwen-MoE's option).
  e.dispatch = "capacity"  # capacity (fixed slots per expert per sequence, overflow dropped) | dropless (sorted tokens, ragged_dot).
  e.capacity_factor = 1.25  # capacity: slots per expert and sequence = ceil(factor x seq_len x experts_per_token / num_experts).
  e.aux_loss_weight = 0.01  # Weight of the Switch/GShard load-balancing loss E x sum_e f_e P_e (1 when balanced); 0 = off.
  e.router_z_loss_weight = 0.001  # Weight of the router z-loss, mean logsumexp(router logits)^2 (ST-MoE); 0 = off.
  e.bias_update_rate = 0.0  # Auxiliary-loss-free balancing (DeepSeek-V3): per-step sign update of the routing bias; 0 = off.
  e.collapse_entropy = 0.5  # Routing collapse: a layer's load entropy / log(num_experts) below this at log steps ...
  e.collapse_steps = 100  # ... for this many steps emits a routing_collapse event and a warning; 0 = off.
  e.n_group = 1  # Group-limited routing (DeepSeek-V3): experts in this many groups, ...
  e.topk_group = 1  # ... a token's experts only from its topk_group best groups (a group's score: its two best experts).
  e.routed_scaling_factor = 1.0  # The routed experts' weights times this (DeepSeek-V3: 2.5).
  e.activation = "swiglu"  # Experts' activation: swiglu | clamped_swiglu (GPT-OSS: one fused, interleaved gate_up weight; dispatch=dropless).
  e.expert_bias = False  # Learned biases on the router logits and on each expert's matmuls (GPT-OSS; needs activation=clamped_swiglu).
  e.swiglu_alpha = 1.702  # clamped_swiglu: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).
  e.swiglu_limit = 7.0  # clamped_swiglu: the clamp of gate (above) and up (both sides).

  m.mla = a = ml_collections.ConfigDict()  # Multi-head latent attention (maxtrain/models/mla.py; DeepSeek-V3); kv_lora_rank=0: off.
  a.kv_lora_rank = 0  # Rank of the kv latent (DeepSeek-V3: 512); 0 = the usual GQA attention.
  a.q_lora_rank = 0  # Rank of the q latent (DeepSeek-V3: 1536); 0 = q straight from the residual.
  a.rope_head_dim = 64  # Width of the decoupled RoPE head shared by every head's key.
  a.nope_head_dim = 128  # Width of each head's q and k without RoPE.
  a.v_head_dim = 128  # Width of each head's value.
  a.rope_interleave = True  # The RoPE head's dims in interleaved pairs (Hugging Face DeepSeek's layout).
  a.latent_cache = False  # Decode from the compressed cache (kv_lora_rank + rope_head_dim values per token per layer; up-projections absorbed).
  a.softmax_mscale = 1.0  # The softmax scale times its square (YaRN's mscale_all_dim: 0.1 ln(factor) + 1 for DeepSeek-V3).

  c.fit = ml_collections.ConfigDict()
  c.fit.headroom = 0.1  # Share of device memory model.remat=auto leaves free (the compiled peak must stay under 1 - this).

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1  # Pure data parallel replicas.
  c.mesh.fsdp = -1  # Parameter-sharded data parallel; -1 takes the remaining devices.
  c.mesh.context = 1  # Context (sequence) parallel: each activation's length dim; attention all-gathers K/V.
  c.mesh.tensor = 1  # Tensor (model) parallel: heads, MLP and vocab dims.
  c.mesh.expert = 1  # Expert parallel: routed experts split over it, tokens sent to them by all-to-all; data parallel elsewhere.
  c.mesh.pipeline = 1  # Pipeline stages (circular pipeline over the layer stack, docs/sharding.md); 1 = no pipeline.
  # The five above lay out one granule (a node: NVLink/NeuronLink/ICI); these lay out the granules
  # (across the network). At most one of all ten may be -1.
  c.mesh.dcn_pipeline = 1  # Pipeline stages across nodes: only stage-boundary activations cross the network.
  c.mesh.dcn_data = 1  # Data-parallel replicas across nodes.
  c.mesh.dcn_fsdp = 1  # FSDP across nodes (parameters sharded over the network too).
  c.mesh.dcn_expert = 1  # Expert parallelism across nodes: the MoE all-to-alls cross the network (experts too many for one node).
  c.mesh.rules = "default"  # Sharding rule set (logical axis -> mesh axes), of maxtrain/sharding/rules.py RULE_SETS.
  c.pipeline = ml_collections.ConfigDict()
  c.pipeline.microbatches = 1  # Microbatches each forward pass streams through the stages (>= stages when pipelined).
  c.pipeline.repeats = 1  # Circular repeats: each stage holds this many non-adjacent layer groups; bubble (S-1)/(R*M+S-1).
  c.pipeline.schedule = "gpipe"  # gpipe (all forwards, then all backwards), 1f1b, interleaved_1f1b (repeats > 1), zb (zero-bubble ZB-H1), or auto (compiled and chosen; sharding/schedules.py).
  c.pipeline.stage_remat = False  # Save only each stage's input per iteration and recompute its layers in the backward (less memory, one more forward).

  c.data = d = ml_collections.ConfigDict()
  d.corpus = "python-stdlib"  # Embedded corpus, built and cached on first use; ignored when data.path is set.
  d.path = ""  # Token-store prefix from tools/index_data.py (reads PREFIX.train.* and PREFIX.val.*).
  d.tokenizer = "byte"  # "byte" or a path to a Hugging Face tokenizer.json: builds the embedded corpus; must match data.path's store headers.
  d.seq_len = 256  # Tokens per training sequence (documents are packed).
  d.batch_size = 16  # Global batch, in sequences, across all processes.
  d.sources = ""  # Mixture: comma-separated PREFIX[:WEIGHT] stores (weight 1 if left out; name = PREFIX's base name); replaces data.path.
  d.stages = ""  # From given steps on: ';'-separated STEP:key=value,... (source weights, seq_len, batch_size: a batch ramp); see docs/data.md.
  d.max_epochs = 0.0  # Warn (event data_repeat) when a source is read past this many epochs; 0 = never.
  d.stop_at_max_epochs = False  # Stop (exit 3) instead of warning when a source passes data.max_epochs.
  d.resume_new_batch_size = False  # Let a checkpoint resume with another data.batch_size: the same windows, batched anew.
  d.read_ahead = 4  # Train batches Grain prepares ahead of the step (host work overlaps the device); 0 = build each on demand.
  d.read_threads = 2  # Grain threads preparing those batches.

  c.optimizer = o = ml_collections.ConfigDict()
  o.name = "adamw"  # adamw | muon (Muon for hidden weight matrices, AdamW for embeddings, head, norms, biases).
  o.lr = 1.5e-3  # Peak learning rate: of every parameter (adamw), of the Muon matrices (muon).
  o.adam_lr = 1.5e-3  # Peak learning rate of the AdamW group when name=muon; unused by adamw.
  o.schedule = "cosine"  # cosine | wsd (warmup-stable-decay) | constant; every group follows the same shape.
  o.warmup_steps = 20  # Linear warmup from 0 at step 0 to the peak at step warmup_steps.
  o.min_lr_ratio = 0.1  # cosine and wsd decay to peak * min_lr_ratio (a ratio: each group has its own peak).
  o.decay_steps = 0  # Length of the LR schedule; 0 = steps. Set it to stop a run early on its planned schedule.
  o.decay_fraction = 0.2  # wsd: the last decay_fraction of the steps decay; the rest after warmup is flat.
  o.wsd_decay = "linear"  # wsd decay shape: linear | cosine.
  o.weight_decay = 0.1  # Decoupled weight decay, multiplied by the group's learning rate.
  o.no_decay = "embed,norm,bias"  # Parameter kinds without weight decay (of embed, head, norm, bias, matrix).
  o.clip_norm = 1.0  # Global gradient-norm clip; 0 disables.
  o.z_loss = 0.0  # Coefficient of the z-loss, mean log(Z)^2 of the softmax normaliser (PaLM: 1e-4); 0 disables.
  o.grad_accum_steps = 1  # Microbatches per step (scanned in the one jitted step): activation memory / k.
  o.microbatch_size = 0  # > 0: sequences per batch shard in each microbatch; sets grad_accum_steps for any node count.
  o.state_dtype = "float32"  # Dtype of optimizer moments (Adam mu and nu, Muon momentum).
  o.offload = "none"  # none | host: keep the optimizer moments in host memory (pinned_host) between steps, on the device only for the update (docs/optimizers.md).
  o.offload_groups = 16  # offload=host: the update moves the moments to the device in at most this many groups of parameters, one group at a time (device peak: the largest group's); 1: all at once.
  o.b1 = 0.9  # Adam first-moment decay.
  o.b2 = 0.95  # Adam second-moment decay.
  o.eps = 1e-8  # Adam epsilon.
  o.muon_momentum = 0.95  # Muon (Nesterov) momentum decay.
  o.muon_ns_steps = 5  # Newton-Schulz iterations orthogonalising the Muon momentum.
  o.muon_ns_coeffs = "3.4445,-4.7750,2.0315"  # a,b,c of the quintic step X <- aX + (bA + cA^2)X, A = XX^T.
  o.muon_ns_dtype = "float32"  # float32 | bfloat16: dtype of the Newton-Schulz iteration (BENCHMARKS.md: accuracy, speed).
  o.muon_consistent_rms = 0.0  # > 0: scale Muon updates to this RMS x sqrt(max dim) (Moonlight: 0.2); 0: sqrt(max(1, out/in)).

  c.checkpoint = k = ml_collections.ConfigDict()
  k.dir = ""  # Where checkpoints go; "" = <output_dir>/checkpoints.
  k.every_steps = 100  # Save every N steps (and always at the end and on preemption); 0: only those.
  k.max_to_keep = 3  # Newest checkpoints kept; 0 keeps all.
  k.keep_every = 0  # Also keep every checkpoint whose step is a multiple of this, forever; 0: none.
  k.resume = "auto"  # auto (newest complete checkpoint, if any) | never | a step number | a checkpoint path.
  k.async_save = True  # Write in the background; the loop blocks only for the device-to-host copy.
  k.verify = True  # Check a checkpoint against its manifest (sizes, checksums) before restoring it.
  k.branch = False  # resume=N while newer steps exist: move them aside (renamed, an event) and continue from N; else exit 2.
  k.resume_new_model = False  # Resume although a config.model key that changes the model's function (sliding_window, rope_*, family...) differs from the checkpoint's: a warning and an event; else exit 2.
  k.start_over_if_corrupt = False  # resume=auto and no checkpoint verifies: move them all aside and train from step 0; else exit 2.
  k.s3_connect_timeout_s = 10.0  # s3:// checkpoints: seconds to wait for a connection to the endpoint.
  k.s3_read_timeout_s = 60.0  # s3:// checkpoints: seconds to wait for a response (per read).
  k.s3_max_attempts = 5  # s3:// checkpoints: attempts per request (retries with backoff) before the request fails.
  k.init_from = ""  # Start a fresh run (step 0, new optimizer) from these parameters: a converted checkpoint or a Hugging Face dir.
  k.local_dir = ""  # The local tier: node-local disk or RAM disk, each process its own shards (<local_dir>/process_<i>); "" = off.
  k.local_every_steps = 0  # Save to the local tier every N steps (a step due in both tiers goes to the durable one); 0: never.
  k.local_max_to_keep = 2  # Newest local checkpoints of this run kept per process (short retention); 0 keeps all.
  k.every_minutes = 0.0  # The durable tier also saves when this many minutes have passed (converted to steps by the measured step time); 0: off.
  k.cadence = "fixed"  # fixed (the intervals above) | auto (each tier every sqrt(2 x save cost x mean time between failures), Young/Daly).
  k.mtbf_prior_minutes = 1440.0  # cadence=auto: the mean time between failures assumed before any is observed (counts as one interval).
  k.max_durable_lag = 2  # A checkpoint_behind event and a warning when more durable saves than this wait for upload.
  k.preemption_grace_s = 0.0  # Seconds from a stop signal to the kill (a spot VM's notice, Kubernetes' terminationGracePeriodSeconds): a stop saves only to the tiers whose measured save time fits in what is left, fastest first; 0: unknown, every tier.
  k.promote_local = True  # A run resumed from a local step (newer than the durable tier's) also saves it to the durable tier, in the background.

  c.runtime = ml_collections.ConfigDict()
  c.runtime.compile_cache_dir = ""  # Persistent XLA compile cache: "" = <maxtrain cache>/xla, "none" = off.
  c.runtime.num_processes = 0  # JAX processes of the job; 0 = detect (SLURM, Open MPI, Kubernetes; none found: 1).
  c.runtime.process_id = -1  # This process's index in 0..num_processes-1; -1 = detect (none found: 0).
  c.runtime.coordinator = ""  # host:port of process 0's coordinator service; "" = detect.
  c.runtime.cluster = "auto"  # Launcher to detect the layout from: auto | none | slurm | openmpi | kubernetes.
  c.runtime.init_timeout_s = 300.0  # Seconds for all processes to join the coordinator, then exit 1 naming its address.
  c.runtime.heartbeat_timeout_s = 100.0  # Seconds without heartbeats after which jax declares a process dead.
  c.runtime.shutdown_timeout_s = 300.0  # Seconds the processes wait for each other at a clean exit.
  c.runtime.coordinator_port = 0  # Port of a detected coordinator; 0 = derived from the job id (maxtrain/runtime/cluster.py).
  c.runtime.platform = "auto"  # auto (JAX picks, no presets) | cpu | gpu | neuron | tpu: sets the platform's flags and env.
  c.runtime.neuron_target = ""  # trn1 | trn2; "" = --target of $NEURON_CC_FLAGS, else trn2 (checked against the devices).
  c.runtime.neuron_lnc = 0  # Logical NeuronCore config, 1 or 2, for compiler and runtime alike; 0 = the target's default.
  c.runtime.xla_flags = ""  # Extra XLA flags ("--a=1 --b=2"); replace preset and $XLA_FLAGS flags of the same name.
  c.runtime.neuron_cc_flags = ""  # Extra Neuron compiler flags; replace preset and $NEURON_CC_FLAGS flags by name.
  c.runtime.check_memory = True  # Refuse (exit 2) a run whose estimated peak per device exceeds its memory (CPU: available RAM).
  c.runtime.env = ""  # Extra environment variables "KEY=VALUE,KEY=VALUE"; win over presets and the environment.

  c.mfu = ml_collections.ConfigDict()
  c.mfu.peak_flops = 0.0  # Peak FLOP/s per device for MFU; 0 = the device table, or measured on CPU.

  c.profile = ml_collections.ConfigDict()
  c.profile.start_step = -1  # First step traced by jax.profiler into <output_dir>/tensorboard; -1 = off.
  c.profile.num_steps = 3  # Steps in the trace.

  c.monitor = ml_collections.ConfigDict()
  c.monitor.prometheus_port = 0  # Serve Prometheus /metrics on this port (each process, its own host); 0 = off.
  c.monitor.prometheus_host = "127.0.0.1"  # Address the Prometheus endpoint binds: 127.0.0.1 (this host only); 0.0.0.0 = every interface.

  c.tracking = ml_collections.ConfigDict()  # Experiment tracking and OpenTelemetry (docs/evaluation.md).
  c.tracking.mlflow_uri = ""  # MLflow tracking URI (sqlite:///PATH/mlflow.db, file:///PATH/mlruns, http://HOST:5000); "" = off.
  c.tracking.mlflow_experiment = "maxtrain"  # MLflow experiment the run is logged under.
  c.tracking.otel_endpoint = ""  # OTLP/HTTP metrics endpoint (http://HOST:4318/v1/metrics) for the Prometheus gauges; "" = off.
  c.tracking.otel_interval_s = 30.0  # Seconds between OTLP exports.

  c.faults = f = ml_collections.ConfigDict()  # Fault injection for tests and drills; -1 = off.
  f.sigterm_at_step = -1  # Send SIGTERM to itself after this step (exercises preemption).
  f.kill_during_save_at_step = -1  # SIGKILL itself while this step's checkpoint is being written.
  f.corrupt_checkpoint_at_step = -1  # Flip a byte of this step's checkpoint once it is complete (bit rot).
  f.crash_at_step = -1  # Raise an exception after this step (exit 1, a crash).
  f.hang_at_step = -1  # Block forever after this step (the watchdog must fire).
  f.nan_at_step = -1  # Make this step's (GRPO: every update of this round's) loss and gradients NaN (in-graph).
  f.spike_at_step = -1  # Multiply this step's (GRPO: this round's) loss and gradients by spike_factor (in-graph).
  f.spike_factor = 100.0  # Loss and gradient multiplier of spike_at_step.
  f.process = -1  # The process the step faults above fire in (sigterm, kill, crash, hang, slow); -1 = every process.
  f.sigterm_process = -1  # The process sigterm_at_step fires in; -1 = as faults.process.
  f.slow_step_s = 0.0  # Sleep this long after every step (a straggler host); 0 = off.
  f.kill_at_step = -1  # SIGKILL itself after this step (kill -9: no exit record, no save).
  f.kill_every_steps = 0  # SIGKILL itself after every N steps of an attempt (crashes at a known rate), up to kill_times; 0 = off.
  f.kill_times = 0  # How many kill_every_steps kills in the whole run.
  f.rollout_hang_at_step = -1  # RL with an async rollout side: its producer blocks forever before the rollout of this round (post.sync_timeout_s must fire).
  f.rollout_die_at_step = -1  # RL with an async rollout side: its producer thread raises (a worker that dies) before the rollout of this round.
  f.publish_stall_at_step = -1  # RL with an async rollout side: the weight publish after this round never completes (post.sync_timeout_s must fire).

  c.guards = g = ml_collections.ConfigDict()
  g.max_consecutive_bad = 3  # Non-finite steps (GRPO: optimizer updates) in a row (each skipped in-graph) before a rollback.
  g.spike_window = 32  # Recorded losses (GRPO: gradient norms) the spike statistics use.
  g.spike_warmup = 20  # Recorded losses needed before spikes are detected.
  g.spike_zscore = 6.0  # A loss (GRPO: gradient norm) above mean + spike_zscore x std of the window is a spike (its update is skipped).
  g.spike_action = "skip"  # skip (just the update) | rollback (to the newest checkpoint, data skips ahead) | abort.
  g.max_rollbacks = 3  # Rollbacks allowed per run (counted across restarts), then abort.

  c.watchdog = ml_collections.ConfigDict()
  c.watchdog.timeout_s = 600.0  # Exit 76 with stack dumps when no step completes for this long; 0 = off.
  c.watchdog.startup_timeout_s = 1800.0  # Allowance before the first step (restore + compile).

  c.fleet = ml_collections.ConfigDict()
  c.fleet.straggler_threshold = 0.2  # Flag a process whose own step time exceeds the median by this fraction; 0 = off.
  c.fleet.straggler_min_s = 0.01  # ... and by at least this many seconds per step (ignores noise on fast steps).
  c.fleet.exchange_timeout_s = 60.0  # Process 0 waits this long for the others' step times at a log step, then skips it.

  c.post = p = ml_collections.ConfigDict()  # Post-training on the same program (docs/post_training.md).
  p.mode = ""  # "" = pretraining | sft (prompt/response fine-tuning) | rl (RL with a verifiable reward; grpo = rl with algorithm grpo).
  p.algorithm = "grpo"  # rl: grpo | dr_grpo | rloo | reinforce_pp | dapo | gspo | ppo (maxtrain/posttrain/algorithms; docs/post_training.md).
  p.data = "arithmetic"  # sft/rl examples: the embedded task "arithmetic" (no download) or a JSONL path of prompt/response (or chat messages).
  p.resume_new_data = False  # sft/rl: resume a checkpoint although post.data changed (its position then indexes the new data; an event records it).
  p.eval_prompts = 200  # Held-out prompts scored at every eval (sft: greedy exact match; rl: greedy mean reward); 0 = off.
  p.max_new_tokens = 6  # Tokens generated per completion (evals and RL rollouts), EOS included.
  p.reward = "maxtrain.data.arithmetic:reward"  # rl: module:function[:weight],... each (prompt, completion, meta) -> float; trained on their weighted sum.
  p.prompts_per_step = 8  # rl: prompts per rollout batch.
  p.group_size = 8  # rl: completions sampled per prompt (G); advantages are computed within each group.
  p.ppo_epochs = 1  # rl: passes over each rollout batch (old log-probs kept for the ratio).
  p.minibatches = 1  # rl: optimizer steps per pass; data.batch_size must be prompts_per_step * group_size / minibatches.
  p.clip_eps = -1.0  # rl: importance ratio clipped below at 1 - clip_eps (and above, unless clip_eps_high); -1 = the algorithm's default.
  p.clip_eps_high = -1.0  # rl: the upper clip 1 + clip_eps_high (DAPO's clip-higher 0.28); -1 = the algorithm's default (clip_eps but for dapo, gspo).
  p.kl_coef = -1.0  # rl: weight of the KL to the frozen reference (the initial parameters); -1 = the algorithm's default (grpo 0.02).
  p.overlong_buffer = -1  # rl: DAPO's soft length penalty over the last N of max_new_tokens (0 = off); -1 = the algorithm's default.
  p.max_draws = -1  # rl: prompt batches a DAPO round may draw to fill it with groups whose rewards differ; -1 = the algorithm's default.
  p.gamma = 1.0  # rl, ppo: GAE discount per token.
  p.lam = 0.95  # rl, ppo: GAE lambda (1 = Monte Carlo returns, 0 = one-step TD).
  p.value_clip = 0.2  # rl, ppo: the new value is clipped to old value +- value_clip in the value loss.
  p.critic_lr = 1e-2  # rl, ppo: Adam learning rate of the critic's value head (its weights on the features: 1/100 of it), constant.
  p.temperature = 1.0  # rl: rollout sampling temperature (1 = the policy itself).
  p.negate_reward = False  # rl: train on minus the reward (a control: the reward must drive learning).
  p.log_rollouts = False  # rl: append each round's prompts, completions and rewards to <output_dir>/rollouts.jsonl.
  p.continuous_batching = 0  # rl: rows of the rollout generator's decode batch with continuous batching (a completion that ends frees its row for the next prompt; rounded up to the batch shards); 0 = off: the round's prompts in one static batch.
  p.pack_updates = False  # rl: pack the update batch's completions into fewer rows (first-fit; document ids keep them apart): the same per-token loss over less padding (token-level losses only: not dr_grpo, gspo, ppo).
  p.rollout_devices = 0  # rl: the last N devices only generate rollouts, on a mesh of their own (fsdp over them; with several processes whole processes, the last ones); 0 = on the trainer's mesh.
  p.max_staleness = 0  # rl: policy versions a round's rollouts lag its update (round k trains on version k-1-N's); 0 = synchronous (bitwise today's run).
  p.correction = "none"  # rl: off-policy correction of the loss by the rollout's own log-probs: none | tis (truncated) | mis (masked) | decoupled (PPO, AReaL).
  p.is_cap = 2.0  # rl: the importance-weight cap of post.correction (tis: weights truncated at it; mis: tokens outside [1/cap, cap] masked; decoupled: above it masked).
  p.rollout_dtype = ""  # rl with rollout_devices: the rollout mesh's parameter and matmul dtype ("" = the trainer's model.*_dtype; bfloat16).
  p.sync_timeout_s = 300.0  # rl with rollout_devices or max_staleness: seconds a weight publish or a rollout batch may take before the run ends as a hang (exit 76).

  c.eval = ml_collections.ConfigDict()
  c.eval.every_steps = 50  # Eval loss on the validation store every N steps (and at the end); 0: end only.
  c.eval.batches = 4  # Validation batches (of data.batch_size) per eval.
  c.eval.tasks = ""  # lm-eval tasks run with each eval, comma-separated (e.g. pycode_mc,pycode_ppl); "" = none.
  c.eval.tasks_include_path = ""  # A folder of extra lm-eval YAML tasks for eval.tasks; "" = the shipped ones only.
  _set_model_keys(c, FAMILY_BASE.get())
  return c


def _set_model_keys(c: ml_collections.ConfigDict, values: dict) -> None:
  for key, value in values.items():
    *sections, leaf = key.split(".")
    node = c.model
    for section in sections:
      node = node[section]
    node[leaf] = value


def flat_keys(cfg: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  keys = []
  for k, v in cfg.items():
    if isinstance(v, ml_collections.ConfigDict):
      keys += flat_keys(v, f"{prefix}{k}.")
    else:
      keys.append(f"{prefix}{k}")
  return keys


def flat_items(tree: Any, prefix: str = "") -> dict[str, Any]:
  """Dotted key -> value of a config as a ConfigDict or a plain dict (a checkpoint's saved config)."""
  out = {}
  for k, v in tree.items():
    if hasattr(v, "items"):
      out.update(flat_items(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


@functools.cache
def declared_keys() -> frozenset[str]:
  """Every declared dotted key (a family's published model changes values, never keys)."""
  token = FAMILY_BASE.set({})
  try:
    return frozenset(flat_keys(base_config()))
  finally:
    FAMILY_BASE.reset(token)


def unknown_key(key: str, where: str = "", fix: str = "See the config keys in docs/config.md.") -> UserError:
  """The error for an undeclared dotted `key`, with the nearest declared ones (a misspelling's fix)."""
  close = difflib.get_close_matches(key, sorted(declared_keys()), n=3, cutoff=0.5)
  hint = f" Did you mean {' or '.join('config.' + c for c in close)}?" if close else ""
  return UserError(f"{where}unknown config key config.{key}.{hint} {fix}")


def check_known(section: Any, prefix: str, where: str = "") -> None:
  """UserError naming the first key of `section` (a ConfigDict or dict: the section at `prefix`, e.g. 'model'
  or 'model.moe') that is not declared: typed configs are built strictly, never dropping a key unread."""
  for key in sorted(flat_items(section, f"{prefix}." if prefix else "")):
    if key not in declared_keys():
      raise unknown_key(key, where)


@functools.cache
def key_docs() -> dict[str, str]:
  """Dotted key -> its one-line meaning: the comment on the line that declares it in `base_config`."""
  source = textwrap.dedent(inspect.getsource(base_config))
  comments = {tok.start[0]: tok.string.lstrip("# ").strip()
              for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
  prefixes, docs = {}, {}
  for node in ast.walk(ast.parse(source)):
    if not isinstance(node, ast.Assign):
      continue
    paths = [_dotted(t, prefixes) for t in node.targets]
    if isinstance(node.value, ast.Call):  # `c.model = m = ml_collections.ConfigDict()`: m is "model."
      section = next((p + "." for p in paths if p is not None), "")  # `c = ConfigDict()`: the root
      prefixes.update({t.id: section for t in node.targets if isinstance(t, ast.Name)})
      continue
    for path in paths:
      docs[path] = comments.get(node.lineno, "")
  return docs


def _dotted(target: ast.expr, prefixes: dict[str, str]) -> str | None:
  """`c.runtime.env` -> 'runtime.env'; `m.d_ff` -> 'model.d_ff' (m declared as the model section)."""
  parts = []
  while isinstance(target, ast.Attribute):
    parts.append(target.attr)
    target = target.value
  if not isinstance(target, ast.Name) or not parts:
    return None
  return prefixes.get(target.id, "") + ".".join(reversed(parts))
