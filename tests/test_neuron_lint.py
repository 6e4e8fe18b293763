"""The train steps of the default and preset configs lower to HLO the Neuron compiler accepts, and
the lint really catches each construct Neuron rejects."""

import jax
import jax.numpy as jnp
import pytest

from maxtrain import config as config_lib
from maxtrain.program import build as program_lib
from maxtrain.runtime import platform
from maxtrain.aot.hlo_lint import neuron_problems
from maxtrain.program.plan import validate

# Reduced depth; real widths and vocabularies. The trn2 node's tensor=4 groups on 8 devices.
TRN2_ON_8 = ["--config.hardware=trn2.48xlarge", "--config.mesh.fsdp=2", "--config.mesh.context=1", "--config.mesh.tensor=4",
             "--config.mesh.dcn_data=1", "--config.model.num_layers=2", "--config.data.seq_len=512",
             "--config.data.batch_size=8"]
ON_NEURON = ["--config=configs/default.py", "--config.runtime.platform=neuron"]
CONFIGS = {
    "default": ON_NEURON,
    "default muon, grad accumulation, z-loss": ON_NEURON + ["--config.optimizer.name=muon",
                                                            "--config.optimizer.grad_accum_steps=2",
                                                            "--config.optimizer.z_loss=1e-4"],
    "llama3_8b on trn2": ["--config=configs/llama3_8b.py", *TRN2_ON_8],
    "llama3_70b on trn2": ["--config=configs/llama3_70b.py", *TRN2_ON_8],
    # Context parallelism: attention under shard_map, all-gathers, a shard-dependent block-pair list.
    "llama3_8b on trn2, context=2": ["--config=configs/llama3_8b.py", *TRN2_ON_8, "--config.mesh.fsdp=1",
                                     "--config.mesh.context=2"],
    # MoE: fp32 router, top-k, capacity slots (integer scatter, gathers), the router-bias update.
    "moe, sigmoid router, bias": ["--config=configs/moe.py", "--config.runtime.platform=neuron",
                                  "--config.model.moe.router=sigmoid", "--config.model.moe.bias_update_rate=1e-3"],
    # Expert parallelism: all-to-all and FSDP all-gathers under shard_map.
    "moe on trn2, expert=2": ["--config=configs/moe.py", *TRN2_ON_8, "--config.mesh.fsdp=1", "--config.mesh.expert=2",
                              "--config.model.num_kv_heads=4"],
}


def lowered_step_and_init(args, prng_impl=None):
  """HLO of the train step and of the state's initialisation, lowered with the PRNG the config's
  platform preset selects (rbg on Neuron) unless `prng_impl` is given."""
  cfg = config_lib.load(args)
  prng_impl = prng_impl or platform.compose(cfg.runtime, {}).jax_config.get("jax_default_prng_impl", "threefry2x32")
  with jax.default_prng_impl(prng_impl):
    return _lower(cfg)


def _lower(cfg):
  program = program_lib.build(cfg, validate(cfg, jax.device_count(), require_data=False))
  lowered = program.lower()  # the trainer's step, lowered as `python -m maxtrain.compile` does
  with jax.set_mesh(program.mesh):
    init = jax.jit(program.state.init, out_shardings=program.state.shardings).lower().as_text(dialect="hlo")
  return lowered.as_text(dialect="hlo"), init


@pytest.mark.parametrize("name", CONFIGS)
def test_train_step_and_init_pass_the_neuron_lint(name):
  step, init = lowered_step_and_init(CONFIGS[name])
  # Scanned layers / microbatches / flash's pair loop: static loops are allowed, and must reach the lint.
  # The default and MoE configs have none: their layers are unrolled and at T <= 1024 `auto` attention
  # is `blocked`, which has no loop.
  assert " while(" in step or name in ("default", "moe, sigmoid router, bias")
  assert ("all-to-all(" in step) == ("expert=" in name)  # expert parallelism is in the linted program
  assert neuron_problems(step) == []
  assert neuron_problems(init) == []


def test_default_prng_is_flagged():
  _, init = lowered_step_and_init(CONFIGS["default"], prng_impl="threefry2x32")
  assert {p.kind for p in neuron_problems(init)} == {"threefry PRNG"}


def test_lint_catches_each_rejected_construct():
  def f(x, key):
    y = jax.lax.cond(x.sum() > 0, lambda: x * 2, lambda: x)
    jax.debug.print("{}", x.sum())
    n = jax.lax.while_loop(lambda c: c[0] < c[1], lambda c: (c[0] + 1, c[1]), (0, x.astype(jnp.int32)[0]))
    static = jax.lax.fori_loop(0, 3, lambda i, a: a + 1, x)  # allowed
    i = jnp.argmax(x)
    m = jnp.ones((2, 2), jnp.int32) @ jnp.ones((2, 2), jnp.int32)
    f8 = x.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return y, n, static, i, m, f8, jax.random.normal(key, (64, 8))

  hlo = jax.jit(f).lower(jnp.ones(3), jax.random.key(0)).as_text(dialect="hlo")
  kinds = sorted(p.kind for p in neuron_problems(hlo))
  assert kinds == sorted(["conditional", "host callback", "dynamic while loop", "variadic reduce", "integer matmul",
                          "f8e4m3fn", "threefry PRNG"])
  assert [p.kind for p in neuron_problems(hlo, check_prng=False)].count("threefry PRNG") == 0


def test_a_scan_inside_shard_map_passes_the_neuron_lint():
  """The pipeline's loop (sharding/pipeline.py) runs inside a shard_map body, where shardy wraps the loop
  bound in a Sharding custom-call: still a compile-time trip count, not a dynamic while loop."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, PartitionSpec as P

  from maxtrain.aot import hlo_lint

  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("pipeline", "fsdp"))
  body = lambda x: jax.lax.scan(lambda c, _: (c * 2, None), x, None, length=7)[0]
  staged = jax.shard_map(body, in_specs=P("pipeline"), out_specs=P("pipeline"), axis_names={"pipeline"})
  with jax.set_mesh(mesh):
    hlo = jax.jit(staged).lower(jnp.ones((8, 4))).as_text(dialect="hlo")
  assert " while(" in hlo and 'custom_call_target="Sharding"' in hlo
  assert hlo_lint.neuron_problems(hlo) == []


def test_pipeline_schedules_lower_without_conditionals_on_neuron():
  """zb (sharding/schedules.py) runs one op per stage per tick by a while loop of 0 or 1 trips per op; on Neuron
  (runtime.platform=neuron, set by the trn2 preset) it runs every op masked instead, and the pipelined trn2 step
  passes the lint. The same step for another platform has the dynamic while loops the lint rejects."""
  args = ["--config=configs/llama3_70b.py", *TRN2_ON_8, "--config.mesh.fsdp=1", "--config.mesh.pipeline=2",
          "--config.pipeline.microbatches=2", "--config.pipeline.schedule=zb", "--config.optimizer.microbatch_size=8"]
  neuron = config_lib.load(args)
  assert neuron.runtime.platform == "neuron"
  step, _ = _lower(neuron)
  assert " while(" in step and neuron_problems(step) == []
  elsewhere, _ = _lower(config_lib.load(args + ["--config.runtime.platform=cpu"]))
  assert "dynamic while loop" in {p.kind for p in neuron_problems(elsewhere)}
