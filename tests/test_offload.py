"""optimizer.offload=host: the optimizer state in host memory (pinned_host), on the device for the update only.
Same losses as without offload, bitwise resume across an offload on/off change, the state's memory space in
the compiled step, and the device bytes it frees (maxtrain/optim/offload.py)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from maxtrain import config as config_lib
from maxtrain.aot import compile as compile_lib
from maxtrain.aot.estimate import estimate
from maxtrain.cli import train
from maxtrain.errors import UserError
from maxtrain.optim import offload, optimizer as optim
from maxtrain.program import build
from test_checkpoint import TINY, assert_bitwise_equal, losses, restore_raw

SMALL = ["--config.hardware=cpu", "--config.model.num_layers=2", "--config.model.d_model=64",
         "--config.model.num_heads=4", "--config.model.num_kv_heads=2", "--config.model.d_ff=128",
         "--config.data.seq_len=64", "--config.data.batch_size=8", "--config.mesh.fsdp=8"]


@pytest.fixture(scope="module")
def reports():
  return {o: compile_lib.compile_train_step(config_lib.load(SMALL + [f"--config.optimizer.offload={o}"]), 8)
          for o in ("none", "host")}


def _opt_state(cfg):
  program = build.program_for(cfg, jax.devices(), require_data=False)
  return program, program.state.abstract.opt_state, program.state.shardings.opt_state


def test_offloaded_state_moves_between_memory_spaces_in_the_step(reports):
  report = reports["host"]
  program, opt_state, shardings = _opt_state(report.cfg)
  n = len(jax.tree.leaves(opt_state))
  assert n > 10 and all(s.memory_kind == "pinned_host" for s in jax.tree.leaves(shardings))
  assert all(s.memory_kind in (None, "device") for s in jax.tree.leaves(program.state.shardings.params))
  # The step takes and returns the optimizer state (and nothing else) in host memory ...
  lowered = report.lowered.as_text()
  host_args = re.findall(r"%(arg\d+): tensor<[^>]*> \{mhlo.memory_kind = \"pinned_host\"", lowered)
  assert len(host_args) == n
  # ... the compiled program keeps exactly those buffers in memory space 5 (host) at its entry and exit ...
  params, outputs, aliased = compile_lib.entry_buffers(report.compiled.as_text())
  assert sum(host for _, host in params) == n and sum(host for _, host in outputs) == n
  assert not any(host for _, host in compile_lib.entry_buffers(reports["none"].compiled.as_text())[0])
  # ... and moves each of them to the device for the update, then back: XLA:CPU lowers a device_put inside a
  # jit to nothing (one RAM), so the same step is lowered for a GPU (no GPU needed to lower).
  with jax.set_mesh(program.mesh):
    gpu = program.train_step.trace(program.abstract_state(), program.abstract_batch()).lower(
        lowering_platforms=("cuda",)).as_text()
  _assert_streamed_in_groups(gpu, host_args, program)


def _assert_streamed_in_groups(gpu: str, host_args: list[str], program) -> None:
  """The update moves every host argument to the device exactly once, one group of parameters at a time:
  group g's moments reach their move to the device only through an optimization barrier that also takes
  group g-1's new moments, already moved back to host memory (so the copies in wait for the copies out),
  and each barrier passes those moments on to the step's outputs (XLA cannot prune them from it)."""
  # What moves to the device: entry arguments (group 0), barrier results (the other groups); the step's outputs
  # are annotated with their memory kinds too, but those are computed values.
  moved = re.findall(r"annotate_device_placement\(%(arg\d+|\d+#\d+)\) \{[^}]*_xla_buffer_placement = \"device\"", gpu)
  to_host = set(re.findall(r"%(\S+) = stablehlo.custom_call @annotate_device_placement\(%[^)]+\) "
                           r"\{[^}]*_xla_buffer_placement = \"pinned_host\"", gpu))
  barriers = re.findall(r"%(\d+):(\d+) = stablehlo.optimization_barrier ([^:]+) :", gpu)
  through = {}  # barrier result -> barrier operand
  for name, count, operands in barriers:
    for i, operand in enumerate(o.strip().lstrip("%") for o in operands.split(",")):
      through[f"{name}#{i}"] = operand
  sources = sorted(through.get(o, o) for o in moved)
  assert sources == sorted(host_args)  # each host argument moved in once, directly (group 0) or via a barrier
  sizes = [x.size for x in jax.tree.leaves(program.state.abstract.params)]
  groups = offload.stream_groups(sizes, program.cfg.optimizer.offload_groups)
  assert len(groups) > 2 and len(barriers) == len(groups) - 1
  owners = jax.tree.leaves(offload.state_owners(program.state.abstract.opt_state, program.state.abstract.params))
  per_group = [sum(1 for o in owners if o in g) for g in groups]
  previous_out = 0
  for g, (name, count, operands) in enumerate(barriers, start=1):
    names = [o.strip().lstrip("%") for o in operands.split(",")]
    ins = [o for o in names if o.startswith("arg")]
    outs = [o for o in names if o in to_host]
    assert len(ins) == per_group[g] and len(outs) == per_group[g - 1] and len(names) == len(ins) + len(outs)
    assert all(re.search(rf"%{name}#{i}\b", gpu[gpu.index(f"%{name}:{count} ="):]) for i in range(len(ins), len(names)))
    assert gpu.index(f"%{name}:{count} =") > previous_out
    previous_out = gpu.index(f"%{name}:{count} =")


def test_offload_moves_the_optimizer_state_bytes_from_device_to_host(reports):
  none, host = reports["none"].memory, reports["host"].memory
  _, opt_state, shardings = _opt_state(reports["host"].cfg)
  opt_bytes = offload.sharded_bytes(opt_state, shardings)
  print(f"per device: optimizer state {opt_bytes / 2**20:.2f} MiB; device peak {none.peak / 2**20:.2f} -> "
        f"{host.peak / 2**20:.2f} MiB, host {none.host / 2**20:.2f} -> {host.host / 2**20:.2f} MiB")
  assert none.host == 0 and host.host_arguments == opt_bytes and host.host == opt_bytes
  assert none.arguments - host.arguments == opt_bytes
  # XLA:CPU: the moved copies are the same buffers (one RAM), so the temporaries stay within a few scalars of
  # the step without offload (the streamed update's groups are separate fusions) and the peak falls by the state.
  assert abs(host.temporaries - none.temporaries) < 0.01 * opt_bytes
  assert abs((none.peak - host.peak) - opt_bytes) < 0.01 * opt_bytes
  # The arithmetic estimate moves the same bytes (its optimizer state is the moments; the step counters
  # that optax keeps beside them are a few int32s it counts with the step's other scalars).
  e_none, e_host = (estimate(reports[o].cfg, 8) for o in ("none", "host"))
  assert e_host.host == pytest.approx(opt_bytes, abs=64) and e_none.host == 0
  assert e_none.peak - e_host.peak == e_host.host
  text = reports["host"].describe()
  assert re.search(rf"^  arguments +{host.arguments / 2**30:.3f} GiB  host +{opt_bytes / 2**30:.3f} GiB", text, re.M)
  assert "offload host" in text


@pytest.mark.slow
def test_offload_trains_the_same_losses_and_resumes_bitwise_across_on_and_off(store, tmp_path):
  base = TINY + ["--config.mesh.fsdp=8", f"--config.data.path={store}"]

  def run(name, steps, *extra):
    assert train.main(base + [f"--config.output_dir={tmp_path / name}", f"--config.steps={steps}", *extra]) == 0

  run("a", 8)  # offload off throughout; checkpoints at 4 and 8
  run("b", 4, "--config.optimizer.offload=host", "--config.optimizer.decay_steps=8")  # on ...
  run("b", 8)  # ... resumed with it off
  run("c", 8, "--config.optimizer.offload=host", f"--config.checkpoint.resume={tmp_path / 'a/checkpoints/4'}")  # off -> on
  a = losses(tmp_path / "a")
  assert sorted(a) == list(range(1, 9))
  assert losses(tmp_path / "b") == a  # steps 1-4 offloaded, 5-8 not: bitwise the same floats
  assert {s: v for s, v in losses(tmp_path / "c").items()} == {s: a[s] for s in range(5, 9)}
  final = restore_raw(tmp_path / "a/checkpoints", 8)
  for other in ("b", "c"):
    assert_bitwise_equal(final, restore_raw(tmp_path / other / "checkpoints", 8))


def test_local_tier_restores_into_host_memory_and_back(tmp_path):
  from maxtrain.checkpoint.local import LocalTier

  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  on_device = {"mu": NamedSharding(mesh, P("fsdp"))}
  on_host = offload.host_shardings(on_device)
  identity = {"output_dir": str(tmp_path / "run"), "checkpoint_dir": str(tmp_path / "run/checkpoints"),
              "config_hash": "h"}
  tier = LocalTier(str(tmp_path), 0, keep=2, identity=identity)
  values = np.arange(64, dtype=np.float32)
  for step, shardings in ((2, on_host), (4, on_device)):
    tier.save(step, {"mu": jax.device_put(values * step, shardings["mu"])}, {},
              {"mesh": {"fsdp": 8}, "process_count": 1, "identity": identity})
  tier.wait()
  abstract = {"mu": jax.ShapeDtypeStruct((64,), np.float32)}
  for step, shardings in ((2, on_device), (4, on_host)):  # saved in one memory, restored into the other
    restored = tier.restore(tier.path(step), abstract, shardings).state
    assert restored["mu"].sharding == shardings["mu"]
    np.testing.assert_array_equal(np.asarray(restored["mu"]), values * step)
  tier.close()


def test_bad_offload_and_neuron_are_refused_before_compiling():
  with pytest.raises(UserError, match=r"optimizer.offload='disk': choose one of none, host"):
    build.program_for(config_lib.load(SMALL + ["--config.optimizer.offload=disk"]), jax.devices(), require_data=False)
  cfg = config_lib.load(SMALL + ["--config.optimizer.offload=host"])
  with pytest.raises(UserError, match="not supported on Neuron"):
    offload.check_devices(cfg.optimizer, jax.devices(), "neuron")
  offload.check_devices(cfg.optimizer, jax.devices(), "cpu")  # XLA:CPU has pinned_host


# ---- model.remat=offload and auto ------------------------------------------------------------------------


@pytest.mark.slow
def test_remat_offload_trains_the_same_losses_as_no_remat(store, tmp_path):
  base = TINY + ["--config.mesh.fsdp=8", f"--config.data.path={store}", "--config.steps=4"]
  for name, remat in (("none", "none"), ("offload", "offload")):
    assert train.main(base + [f"--config.output_dir={tmp_path / name}", f"--config.model.remat={remat}"]) == 0
  assert losses(tmp_path / "offload") == losses(tmp_path / "none")  # bitwise: the same floats at every step
  assert_bitwise_equal(restore_raw(tmp_path / "none/checkpoints", 4), restore_raw(tmp_path / "offload/checkpoints", 4))


def test_remat_offload_sends_the_named_activations_to_host():
  program = build.program_for(config_lib.load(SMALL + ["--config.model.remat=offload"]), jax.devices(),
                              require_data=False)
  with jax.set_mesh(program.mesh):  # lowered for a GPU: XLA:CPU's lowering drops the placement (one RAM)
    gpu = program.train_step.trace(program.abstract_state(), program.abstract_batch()).lower(
        lowering_platforms=("cuda",)).as_text()
  to_host = re.findall(r"_xla_buffer_placement = \"pinned_host\"\}\} : \(tensor<([0-9x]+)xf32>\)", gpu)
  to_device = re.findall(r"_xla_buffer_placement = \"device\"\}\} : \(tensor<([0-9x]+)xf32>\)", gpu)
  activation = "8x64x64"  # [B, T, D]: the residual and the MLP input of the layer
  assert to_host.count(activation) == 2 and to_device.count(activation) >= 2


def _compile_candidate(calls):
  def compile_fn(trial):
    calls.append(trial.model.remat)
    program = build.program_for(trial, jax.devices(), require_data=False)
    with jax.set_mesh(program.mesh):
      return program.lower().compile(), program.plan
  return compile_fn


def test_remat_auto_picks_the_fastest_policy_that_fits_and_caches(tmp_path, monkeypatch):
  from maxtrain.program import fit

  monkeypatch.setenv("MAXTRAIN_CACHE", str(tmp_path))
  cfg = config_lib.load(SMALL + ["--config.model.remat=auto", "--config.model.scan_unroll=1"])
  cfg.hardware = "test-device"
  monkeypatch.setitem(fit.TARGETS, "test-device", fit.Target("test device", 2**40, 1e12, 50e9, "test"))
  calls = []
  remat, table, candidates = fit.choose_remat(cfg, jax.devices(), _compile_candidate(calls))
  print(table)
  assert calls == list(fit.CANDIDATES)
  rows = {c.remat: c for c in candidates}
  assert set(rows) == set(fit.CANDIDATES) and all(f"  {c.remat:<8} {c.device_peak / 2**20:8.3f} MiB" in table for c in candidates)
  # Everything fits a 1 TiB device: no recompute and no transfer is fastest.
  assert remat == "none" and re.search(r"^  none .* <- chosen$", table, re.M)
  assert rows["full"].step_seconds > rows["dots"].step_seconds > rows["none"].step_seconds
  assert rows["offload"].host > 0 == rows["none"].host and rows["offload"].moved == 2 * rows["offload"].host
  assert rows["full"].device_peak < rows["none"].device_peak and rows["offload"].device_peak < rows["none"].device_peak
  # A device between the smallest peak and none's: the fastest of those under it, from the cache (no compile).
  fitting = [k for k, c in rows.items() if c.device_peak < rows["none"].device_peak]
  memory = (max(rows[k].device_peak for k in fitting) + rows["none"].device_peak) / 2
  monkeypatch.setitem(fit.TARGETS, "test-device", fit.Target("test device", int(memory), 1e12, 50e9, "test"))
  cfg.fit.headroom = 0.0
  remat, table, _ = fit.choose_remat(cfg, jax.devices(), _compile_candidate(calls))
  assert calls == list(fit.CANDIDATES)  # cached
  assert remat == min(fitting, key=lambda k: rows[k].step_seconds) and re.search(r"^  none .*\(does not fit\)$", table, re.M)
  monkeypatch.setitem(fit.TARGETS, "test-device", fit.Target("test device", 1000, 1e12, 50e9, "test"))
  with pytest.raises(UserError, match="no remat policy fits"):
    fit.choose_remat(cfg, jax.devices(), _compile_candidate(calls))
  cfg.fit.headroom = 1.0
  with pytest.raises(UserError, match=r"fit.headroom=1.0: must be in \[0, 1\)"):
    fit.choose_remat(cfg, jax.devices(), _compile_candidate(calls))


def test_remat_auto_under_a_pipeline_leaves_offload_out(tmp_path, monkeypatch):
  """Under the pipeline the offloaded activations' bytes are not modelled (counted for every layer on every device,
  llama3_405b's offload row read a negative device peak), so auto compiles none, dots and full only."""
  from maxtrain.program import fit

  monkeypatch.setenv("MAXTRAIN_CACHE", str(tmp_path))
  cfg = config_lib.load(SMALL + ["--config.model.remat=auto", "--config.mesh.pipeline=2", "--config.mesh.fsdp=4",
                                 "--config.pipeline.microbatches=2"])
  cfg.hardware = "test-device"
  monkeypatch.setitem(fit.TARGETS, "test-device", fit.Target("test device", 2**40, 1e12, 50e9, "test"))
  calls = []
  _, table, candidates = fit.choose_remat(cfg, jax.devices(), _compile_candidate(calls))
  assert calls == ["none", "dots", "full"] and [c.remat for c in candidates] == calls and "offload" not in table
  assert all(c.device_peak > 0 for c in candidates)


def test_ppo_with_an_offloaded_optimizer_state_is_refused():
  """PPO's critic rides in the optimizer state; offloaded, its value head would run on host arrays (a
  traceback at the first rollout before this check): exit 2 naming both keys, before compiling."""
  from maxtrain.program.plan import validate

  cfg = config_lib.load(["--config=configs/rl.py", "--config.post.algorithm=ppo", "--config.optimizer.offload=host"])
  with pytest.raises(UserError, match=r"post.algorithm=ppo with optimizer.offload=host: the critic"):
    validate(cfg, 8, require_data=False)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_streamed_update_is_the_update_bitwise(name):
  """The streamed update (each group's tx.update with zeros for the other groups' state) gives the plain
  update's state bit for bit, for Adam's two moments and Muon's momentum, in several groups, and
  every state leaf goes with its parameter's group. The updates too for AdamW; under Muon XLA:CPU fuses the
  groups' programs differently and an update can round apart (Newton-Schulz amplifies it to ~1e-6 of the
  update's scale), while the state, which carries over steps, stays bitwise."""
  from test_optim import opt_config, random_params

  params = random_params()
  plain = optim.make(opt_config(name=name, warmup_steps=2), total_steps=10).tx
  state = plain.init(params)
  owners = jax.tree.leaves(offload.state_owners(state, params))
  assert sorted(set(owners)) == [-1, *range(len(jax.tree.leaves(params)))]  # counters, and every parameter
  # Not streamed: the step counters and Muon's Newton-Schulz coefficients, a few numbers each.
  assert all(np.size(x) <= 3 for x, o in zip(jax.tree.leaves(state), owners) if o < 0)
  reference = jax.jit(lambda g, s, p: plain.update(g, s, p, skip=jnp.bool_(False)))
  for groups in (4,):  # several groups (1 is the same code with one)
    streamed = offload.streamed(plain, groups)
    update = jax.jit(lambda g, s, p: streamed.update(g, s, p, skip=jnp.bool_(False)))
    s_ref = s_ours = state
    for step in range(2):  # the second from moments that are not zeros
      grads = random_params(seed=10 + step)
      (u_ref, s_ref), (u_ours, s_ours) = reference(grads, s_ref, params), update(grads, s_ours, params)
      for a, b in zip(jax.tree.leaves(s_ours), jax.tree.leaves(s_ref), strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
      for a, b in zip(jax.tree.leaves(u_ours), jax.tree.leaves(u_ref), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if name == "adamw":
          assert np.array_equal(a, b)
        else:
          # test_optim's tolerance between two compilations of Muon (Newton-Schulz amplifies a rounding)
          np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.max(np.abs(b)))
