"""Platform environment composition (presets < process environment < config, flags merged by name),
Neuron LNC/target consistency, device-kind checks, and what needs a real process: that this jaxlib
accepts the GPU preset's flags, that apply() acts before the backend starts, and that asking for a
platform whose plugin is missing exits 2 before compiling."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from maxtrain.runtime import cluster, flags, platform
from maxtrain.config import base_config
from maxtrain.errors import UserError

REPO = Path(__file__).resolve().parent.parent
PY312 = Path("/work/venv312/bin/python")  # the other pinned stack (py3.12, jax 0.12), where installed


def runtime(**overrides):
  r = base_config().runtime
  r.compile_cache_dir = "/cache/xla"
  for key, value in overrides.items():
    r[key] = value
  return r


def compose(environ=None, **overrides) -> platform.PlatformEnv:
  return platform.compose(runtime(**overrides), environ or {})


def xla_flags(text: str) -> dict:
  return {f.name: f.value for f in flags.parse(text, "test")}


def neuron_cc(penv) -> dict:
  return {f.name: f.value for f in flags.parse(penv.env["NEURON_CC_FLAGS"], "test", platform._neuron_normalize)}


def test_flag_parsing_and_merge_by_name():
  assert flags.tokenize("--a=1  --b='x y' -c") == ["--a=1", "--b='x y'", "-c"]
  parsed = flags.parse("--model-type transformer -O1 --lnc 2 --x=1", "t", platform._neuron_normalize)
  assert [(f.name, f.value) for f in parsed] == [("--model-type", "transformer"), ("--optlevel", "1"),
                                                 ("--logical-nc-config", "2"), ("--x", "1")]
  merged = flags.merge([("preset", "--a=1 --b=2 --c=3"), ("environment", "--b=20 --d=4"), ("config", "--c=30 --b=200")])
  assert flags.render(merged) == "--a=1 --b=200 --c=30 --d=4"  # replaced in place, new ones appended
  assert flags.find(merged, "--b").replaced == "environment"
  with pytest.raises(UserError, match="quote"):
    flags.tokenize("--a='x")


def test_gpu_preset_and_override_by_flag_name():
  user = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_force_host_platform_device_count=8"
  penv = compose({"XLA_FLAGS": user}, platform="gpu",
                 xla_flags="--xla_gpu_all_gather_combine_threshold_bytes=1 --xla_dump_to=/tmp/d")
  got = xla_flags(penv.env["XLA_FLAGS"])
  assert got["--xla_gpu_enable_latency_hiding_scheduler"] == "false"  # the environment beats the preset
  assert got["--xla_gpu_all_gather_combine_threshold_bytes"] == "1"  # the config beats the preset
  assert got["--xla_force_host_platform_device_count"] == "8" and got["--xla_dump_to"] == "/tmp/d"
  preset = xla_flags(" ".join(platform.GPU_XLA_FLAGS))
  untouched = set(preset) - {"--xla_gpu_enable_latency_hiding_scheduler", "--xla_gpu_all_gather_combine_threshold_bytes"}
  assert all(got[name] == preset[name] for name in untouched)
  assert len(penv.env["XLA_FLAGS"].split()) == len(preset) + 2  # each flag once
  # The config beats the environment for the same flag.
  both = compose({"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}, platform="gpu",
                 xla_flags="--xla_gpu_enable_triton_gemm=false")
  assert xla_flags(both.env["XLA_FLAGS"])["--xla_gpu_enable_triton_gemm"] == "false"
  assert penv.env["JAX_PLATFORMS"] == "cuda" and penv.jax_config["jax_platforms"] == "cuda"
  assert any("--xla_gpu_enable_latency_hiding_scheduler=false: environment, replacing preset gpu" in s
             for s in penv.sources)


def test_env_precedence():
  name = "XLA_PYTHON_CLIENT_MEM_FRACTION"
  assert compose(platform="gpu").env[name] == platform.GPU_ENV[name]
  kept = compose({name: "0.5"}, platform="gpu")
  assert name not in kept.env and any(s.startswith(f"{name}=0.5: environment") for s in kept.sources)
  config = compose({name: "0.5"}, platform="gpu", env=f"{name}=0.7,NCCL_PROTO=Simple,LL128,NCCL_DEBUG=WARN")
  assert config.env[name] == "0.7"
  assert config.env["NCCL_PROTO"] == "Simple,LL128" and config.env["NCCL_DEBUG"] == "WARN"
  for bad in ("XLA_FLAGS=--a=1", "JAX_PLATFORMS=cpu", "NEURON_LOGICAL_NC_CONFIG=1"):
    with pytest.raises(UserError, match="config.runtime"):
      compose(env=bad)
  with pytest.raises(UserError, match="runtime.env"):
    compose(env="no-equals-sign")
  with pytest.raises(UserError, match="runtime.platform"):
    compose(platform="cuda")


def test_nothing_leaks_between_gpu_and_neuron():
  environ = {"NEURON_RT_LOG_LEVEL": "INFO", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  gpu = compose(environ, platform="gpu")
  assert not [k for k in gpu.env if k.startswith(("NEURON", "FI_"))]
  assert "jax_default_prng_impl" not in gpu.jax_config
  neuron = compose(environ, platform="neuron", num_processes=2, process_id=0, coordinator="h:1")
  assert "XLA_FLAGS" not in neuron.env and not set(platform.GPU_ENV) & set(neuron.env)
  assert not [s for s in neuron.sources if "xla_gpu" in s]
  assert neuron.env["FI_PROVIDER"] == "efa"  # the multi-node Neuron variables are there
  assert not [k for k in compose(environ, platform="tpu").env if k.startswith(("NEURON", "XLA_PYTHON", "CUDA"))]


def test_jax_platforms():
  assert compose({"JAX_PLATFORMS": "cpu"}, platform="neuron").env["JAX_PLATFORMS"] == "neuron"
  assert compose({"JAX_PLATFORMS": "neuron,cpu"}, platform="neuron").env["JAX_PLATFORMS"] == "neuron,cpu"
  auto = compose({"JAX_PLATFORMS": "cpu"})
  assert auto.env == {} and auto.jax_config == {}  # auto: whatever JAX picks, nothing set
  assert compose(xla_flags="--xla_dump_to=/d").env == {"XLA_FLAGS": "--xla_dump_to=/d"}
  tpu = compose({"XLA_FLAGS": "--xla_dump_to=/d"}, platform="tpu", xla_flags="--xla_tpu_enable_foo=true")
  assert tpu.env["LIBTPU_INIT_ARGS"] == "--xla_tpu_enable_foo=true" and "XLA_FLAGS" not in tpu.env


def test_cpu_pools_get_threads_for_every_fake_device():
  """XLA:CPU's pools: 4 threads per fake device (a collective holds its thread; with max(cores, devices) threads
  a pipeline step hung with every thread blocked), from XLA_FLAGS or runtime.xla_flags; the environment's own
  PJRT_NPROC wins; one device or another platform: nothing set."""
  eight = "--xla_force_host_platform_device_count=8"
  for penv in (compose({"XLA_FLAGS": eight}, platform="cpu"), compose(xla_flags=eight),
               compose({"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}, xla_flags=eight)):
    assert penv.env[platform.CPU_POOL_ENV] == "32", penv.env
    assert any(s.startswith("PJRT_NPROC=32: preset cpu") for s in penv.sources)
  assert platform.CPU_POOL_ENV not in compose({"XLA_FLAGS": eight, "PJRT_NPROC": "12"}).env
  assert platform.CPU_POOL_ENV not in compose({"XLA_FLAGS": "--xla_dump_to=/d"}).env
  assert platform.CPU_POOL_ENV not in compose({"XLA_FLAGS": eight}, platform="gpu").env
  with pytest.raises(UserError, match="device_count=eight: the device count must be an integer"):
    compose({"XLA_FLAGS": "--xla_force_host_platform_device_count=eight"})


def test_tools_get_fake_devices_with_the_presets_pools():
  env = {"XLA_FLAGS": "--xla_dump_to=/d"}
  assert platform.fake_cpu_devices(8, env) == 8
  assert env == {"XLA_FLAGS": "--xla_dump_to=/d --xla_force_host_platform_device_count=8", "PJRT_NPROC": "32"}
  mine = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "PJRT_NPROC": "6"}  # the caller's count and pools
  assert platform.fake_cpu_devices(8, mine) == 4 and mine["PJRT_NPROC"] == "6"


def test_this_test_process_has_the_cpu_pools_the_preset_sizes():
  """The tests' backend (conftest) runs with the trainer's pools: 32 intra-op threads for 8 devices."""
  import jax

  jax.devices()
  names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
  assert sum(n.endswith("XLAEigen") for n in names) == 32, sorted(set(names))


def test_neuron_defaults():
  trn2 = compose(platform="neuron")
  cc = neuron_cc(trn2)
  assert cc["--target"] == "trn2" and cc["--logical-nc-config"] == "2" and cc["--optlevel"] == "1"
  assert cc["--model-type"] == "transformer" and cc["--distribution-strategy"] == "llm-training"
  assert cc["--auto-cast"] == "none"
  assert trn2.env["NEURON_LOGICAL_NC_CONFIG"] == "2" and (trn2.neuron_target, trn2.neuron_lnc) == ("trn2", 2)
  assert trn2.jax_config == {"jax_platforms": "neuron", "jax_default_prng_impl": "rbg"}
  assert trn2.env["NEURON_COMPILE_CACHE_URL"] == "/cache/xla/neuron"
  assert "NEURON_COMPILE_CACHE_URL" not in compose(platform="neuron", compile_cache_dir="none").env
  assert not [k for k in trn2.env if k.startswith(("NEURON_PJRT", "NEURON_RT_ROOT", "FI_"))]  # one process
  trn1 = compose(platform="neuron", neuron_target="trn1")
  assert neuron_cc(trn1)["--target"] == "trn1" and "--logical-nc-config" not in neuron_cc(trn1)
  assert "NEURON_LOGICAL_NC_CONFIG" not in trn1.env and trn1.neuron_lnc == 1
  # --target from the exported NEURON_CC_FLAGS decides when the config does not; its LNC default follows.
  exported = compose({"NEURON_CC_FLAGS": "--target=trn1 --verbose=info"}, platform="neuron")
  assert (exported.neuron_target, exported.neuron_lnc) == ("trn1", 1) and "--verbose" in neuron_cc(exported)
  assert compose({"NEURON_CC_FLAGS": "--target=trn1"}, platform="neuron", neuron_target="trn2").neuron_target == "trn2"


def test_neuron_lnc_consistency():
  def lnc(penv):
    return neuron_cc(penv)["--logical-nc-config"], penv.env["NEURON_LOGICAL_NC_CONFIG"]

  assert lnc(compose(platform="neuron", neuron_lnc=1)) == ("1", "1")
  # One user statement, anywhere, sets both the compiler and the runtime.
  assert lnc(compose({"NEURON_LOGICAL_NC_CONFIG": "1"}, platform="neuron")) == ("1", "1")
  assert lnc(compose({"NEURON_CC_FLAGS": "-lnc 1"}, platform="neuron")) == ("1", "1")
  assert lnc(compose(platform="neuron", neuron_cc_flags="--lnc=1")) == ("1", "1")
  # The config beats the environment, for both.
  assert lnc(compose({"NEURON_LOGICAL_NC_CONFIG": "1", "NEURON_CC_FLAGS": "--lnc=1"}, platform="neuron",
                     neuron_lnc=2)) == ("2", "2")
  with pytest.raises(UserError, match="NEURON_LOGICAL_NC_CONFIG=1 vs .*logical-nc-config=2"):
    compose({"NEURON_LOGICAL_NC_CONFIG": "1", "NEURON_CC_FLAGS": "--logical-nc-config=2"}, platform="neuron")
  with pytest.raises(UserError, match="conflicting"):
    compose(platform="neuron", neuron_lnc=2, neuron_cc_flags="-lnc 1")
  with pytest.raises(UserError, match="trn1 only 1"):
    compose(platform="neuron", neuron_target="trn1", neuron_lnc=2)
  with pytest.raises(UserError, match="neuron_lnc"):
    compose(platform="neuron", neuron_lnc=4)
  with pytest.raises(UserError, match="trn1, trn2"):
    compose({"NEURON_CC_FLAGS": "--target=inf2"}, platform="neuron")


def test_neuron_multi_process_variables_follow_the_detected_cluster():
  env = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3",
         "SLURM_LOCALID": "0", "SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_NODELIST": "trn2-[01-04]"}
  layout = cluster.resolve(runtime(), env)
  penv = compose(env, platform="neuron")
  host, port = layout.coordinator.split(":")
  assert penv.env["NEURON_RT_ROOT_COMM_ID"] == f"{host}:{int(port) + 1}" and host == "trn2-01"
  assert penv.env["NEURON_PJRT_PROCESSES_NUM_DEVICES"] == "64,64,64,64"  # trn2.48xlarge at LNC 2
  assert penv.env["NEURON_PJRT_PROCESS_INDEX"] == "3"
  assert (penv.env["FI_PROVIDER"], penv.env["FI_EFA_USE_DEVICE_RDMA"]) == ("efa", "1")
  lnc1 = compose(env, platform="neuron", neuron_lnc=1)
  assert lnc1.env["NEURON_PJRT_PROCESSES_NUM_DEVICES"] == "128,128,128,128"
  mine = compose({**env, "NEURON_PJRT_PROCESSES_NUM_DEVICES": "32,32,32,32"}, platform="neuron")
  assert "NEURON_PJRT_PROCESSES_NUM_DEVICES" not in mine.env  # the exported value stays


def test_device_kinds():
  assert platform.parse_device_kind("NC_v3d") == ("trn2", 2)
  assert platform.parse_device_kind("NC_v3") == ("trn2", 1)
  assert platform.parse_device_kind("NC_v2") == ("trn1", 1)
  assert platform.parse_device_kind("NVIDIA H100 80GB HBM3") is None
  composed = compose(platform="neuron").env  # trn2, LNC 2
  platform.check_devices("neuron", "neuron", "NC_v3d", composed)
  with pytest.raises(UserError, match="neuron_lnc=1"):
    platform.check_devices("neuron", "neuron", "NC_v3", composed)
  with pytest.raises(UserError, match="neuron_target=trn1"):
    platform.check_devices("neuron", "neuron", "NC_v2", composed)
  with pytest.raises(UserError, match="unknown Neuron device kind"):
    platform.check_devices("auto", "neuron", "NC_v9", composed)
  with pytest.raises(UserError, match="platform=gpu but JAX started on cpu"):
    platform.check_devices("gpu", "cpu", "cpu", {})
  platform.check_devices("auto", "cpu", "cpu", composed)


def test_plugin_guard():
  installed = platform.installed_plugins()
  assert not any("neuron" in n for n in installed), "this test expects a machine without the Neuron plugin"
  with pytest.raises(UserError, match=r"jax-neuronx.*pip\.repos\.neuron\.amazonaws\.com"):
    platform.require_plugin("neuron", installed)
  platform.require_plugin("neuron", {"libneuronxla"})
  platform.require_plugin("gpu", {"xla_cuda12", "jax_cuda12_plugin"})
  with pytest.raises(UserError, match="jax\\[tpu\\]"):
    platform.require_plugin("tpu", {"xla_cuda12"})
  for name in ("auto", "cpu"):
    platform.require_plugin(name, set())


def clean_env(**extra) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  return {**env, "PYTHONPATH": str(REPO), **extra}


def test_this_jaxlib_accepts_the_gpu_preset_flags():
  """XLA registers every flag (GPU ones too) on CPU builds and aborts on an unknown one at backend
  start: start a CPU backend with exactly the composed GPU flags, on each Python/jaxlib here."""
  xla = compose(platform="gpu").env["XLA_FLAGS"]
  has_jax = list(PY312.parent.parent.glob("lib/python3.12/site-packages/jax/__init__.py"))
  pythons = [sys.executable] + ([str(PY312)] if has_jax else [])
  procs = [subprocess.Popen([py, "-c", "import jax; print(jax.__version__, jax.devices()[0].platform)"],
                            env=clean_env(JAX_PLATFORMS="cpu", XLA_FLAGS=xla), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for py in pythons]
  for py, proc in zip(pythons, procs):
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0 and out.strip().endswith("cpu"), f"{py}: {out[-2000:]}"
  bad = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True, text=True,
                       env=clean_env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_gpu_no_such_flag=true"), timeout=120)
  assert bad.returncode != 0 and "Unknown flag" in bad.stderr  # the check above can fail


APPLY_SCRIPT = """
import jax, logging, sys
logging.basicConfig(level=logging.INFO)
from maxtrain import config
from maxtrain.runtime import platform
cfg = config.load(sys.argv[1:])
penv = platform.apply(cfg.runtime)
print("devices", jax.device_count(), jax.devices()[0].platform)
platform.apply(cfg.runtime)  # what is already in effect may be applied again
print("again ok")
try:
  platform.apply(config.load(sys.argv[1:] + ["--config.runtime.xla_flags=--xla_force_host_platform_device_count=5"]).runtime)
except RuntimeError as e:
  print("late:", e)
"""


def test_apply_takes_effect_after_jax_import_and_refuses_after_backend_start():
  out = subprocess.run([sys.executable, "-c", APPLY_SCRIPT, "--config.runtime.platform=cpu",
                        "--config.runtime.xla_flags=--xla_force_host_platform_device_count=3"],
                       capture_output=True, text=True, env=clean_env(), timeout=120, cwd=REPO)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "devices 3 cpu" in out.stdout and "again ok" in out.stdout
  assert "late: platform.apply after the JAX backend started" in out.stdout and "(XLA_FLAGS)" in out.stdout
  assert "XLA_FLAGS --xla_force_host_platform_device_count=3: config.runtime.xla_flags" in out.stderr


def test_missing_plugin_exits_2_before_compiling(tmp_path):
  runs = {name: subprocess.Popen([sys.executable, "-m", "maxtrain.train", f"--config.runtime.platform={name}",
                                  f"--config.output_dir={tmp_path / name}"],
                                 env=clean_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
          for name in ("neuron", "gpu")}
  for name, proc in runs.items():
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err[-2000:]
    assert f"config.runtime.platform={name} needs" in err
    assert ("pip.repos.neuron.amazonaws.com" if name == "neuron" else "jax[cuda12]") in err
    assert not (tmp_path / name).exists()  # stopped before the trainer made its output dir


def test_hardware_auto_chooses_the_preset_of_the_machine(monkeypatch, caplog):
  """hardware=auto (the default): the preset follows the accelerators' kind and count, with the reason
  logged; an explicit hardware wins; no shipped config pins one."""
  import logging

  from maxtrain import config as config_lib
  from maxtrain.config import hardware

  h100 = "NVIDIA H100 80GB HBM3"
  assert hardware.choose([h100] * 8, 0, "")[0] == "h100x8"
  assert hardware.choose(["NVIDIA H200"] * 8, 0, "p5en.48xlarge")[0] == "h200x8"
  name, reason = hardware.choose([h100] * 4, 0, "")  # a node shape no preset describes
  assert name == "" and f"4 x {h100}" in reason and "--config.hardware" in reason
  assert hardware.choose([h100] * 4 + ["NVIDIA H200"] * 4, 0, "")[0] == ""  # mixed kinds
  assert hardware.choose([], 64, "trn2.48xlarge") == ("trn2.48xlarge", "64 Neuron devices (/dev/neuron*) on "
                                                      "trn2.48xlarge: preset trn2.48xlarge")
  assert hardware.choose([], 16, "")[0] == ""
  assert hardware.choose([], 0, "")[0] == "cpu"
  # What detect() found decides the keys (this machine has no GPU: its finding is stood in for).
  monkeypatch.setattr(hardware, "detect", lambda: ("h100x8", "8 x H100 (nvidia-smi): preset h100x8"))
  with caplog.at_level(logging.INFO, logger="maxtrain"):
    cfg = config_lib.load(["--config=configs/llama3_8b.py"])
  assert (cfg.hardware, cfg.runtime.platform, cfg.model.compute_dtype, cfg.mesh.fsdp) == ("h100x8", "gpu", "bfloat16", 8)
  assert "hardware=auto: 8 x H100 (nvidia-smi): preset h100x8" in caplog.text
  cfg = config_lib.load(["--config=configs/llama3_8b.py", "--config.hardware=cpu"])
  assert (cfg.hardware, cfg.runtime.platform, cfg.model.compute_dtype) == ("cpu", "cpu", "float32")
  for path in sorted((REPO / "configs").glob("*.py")):
    assert config_lib.load_file(path)[0].hardware == "auto", path
