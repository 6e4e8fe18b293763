"""Test setup: 8 fake CPU devices and the tests' XLA:CPU compile effort (tiny.py), set before jax is
imported anywhere."""

import os

from maxtrain.runtime import platform
from tiny import FAST_COMPILE_FLAGS, PATIENT_COLLECTIVES, XLA_DEFAULTS_ENV

# XLA_DEFAULTS_ENV=1: XLA's default code generation, for a test whose assertion needs it (test_compile).
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "" if os.environ.get(XLA_DEFAULTS_ENV) else
                                    FAST_COMPILE_FLAGS, PATIENT_COLLECTIVES,
                                    "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.update(platform.cpu_pool_env(8))  # the pools the trainer's preset sizes (in-process runs compose the same)
# Every process a test starts (`python tools/x.py`, `python -m maxtrain.X`) imports this checkout's maxtrain,
# not whichever checkout the editable install points at (a script's sys.path[0] is its own folder).
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH", "")) if p)

import jax  # noqa: E402
import pytest  # noqa: E402

# Reference comparisons are in fp32 at tight tolerances: matmuls must not drop to bf16 passes.
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
  """The controller measures the CPU peak once before any worker starts, while the machine is as quiet as it
  gets: trainers read MFU's peak from that cache. Measured under the workers' own load, it would read
  contended and every trainer start would measure again (~1 s each; monitor/mfu.py)."""
  if not hasattr(config, "workerinput"):
    from maxtrain.monitor import mfu

    mfu.cpu_peak()


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
  assert jax.device_count() == 8, "tests expect 8 fake CPU devices (XLA_FLAGS set too late?)"


@pytest.fixture(scope="session")
def store(tmp_path_factory) -> str:
  """A small token store (train + val) from this repository's own Python sources."""
  from pathlib import Path

  from maxtrain.data.indexing import index_files

  prefix = tmp_path_factory.mktemp("store") / "code"
  index_files([str(Path(__file__).resolve().parent.parent / "maxtrain")], str(prefix), val_fraction=0.2,
              workers=1, progress=False)
  return str(prefix)
