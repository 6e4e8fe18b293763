"""The tiny model every end-to-end test trains (compiles in about a second on one CPU core), and the
environment of the processes tests start."""

import os

from maxtrain.runtime import platform

TINY_MODEL = ["--config.model.num_layers=2", "--config.model.d_model=32", "--config.model.num_heads=4",
              "--config.model.num_kv_heads=4", "--config.model.d_ff=64", "--config.data.seq_len=32",
              "--config.data.batch_size=8", "--config.eval.batches=1"]

# Less LLVM effort for XLA:CPU in tests only (conftest sets it for pytest's processes, cpu_env for the ones
# tests start): half the CPU time of a cold compile (the tiny 8-device trainer: 40 -> 19 CPU s). The HLO
# passes are untouched, so optimised HLO, collectives and memory_analysis are the same; every bitwise
# comparison is between runs compiled alike. Never in the default run or tools/bench*.py.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# XLA:CPU aborts the process when a collective's threads do not all reach its rendezvous within a timeout; on this
# 2-core machine, with multi-process tests beside an 8-device test, device threads can be starved that long: wait
# instead. (The CI aborts of 2026-12-05 were deadlocks, not starvation: the pool out of threads,
# `platform.cpu_pool_env`, and two collectives run in opposite orders, aot/hlo_lint.py unordered_collective_loops.)
PATIENT_COLLECTIVES = ("--xla_cpu_collective_call_terminate_timeout_seconds=1200 "
                       "--xla_cpu_collective_timeout_seconds=1200")
XLA_DEFAULTS_ENV = "MAXTRAIN_TEST_XLA_DEFAULTS"  # set to 1: conftest leaves XLA's default code generation


def cpu_env(devices: int = 8, **extra: str) -> dict[str, str]:
  """os.environ for a test's subprocess: `devices` fake CPU devices, compiled with FAST_COMPILE_FLAGS."""
  return {**os.environ, "XLA_FLAGS": f"{FAST_COMPILE_FLAGS} {PATIENT_COLLECTIVES} "
                                                f"--xla_force_host_platform_device_count={devices}",
          "JAX_PLATFORMS": "cpu", **platform.cpu_pool_env(devices), **extra}
