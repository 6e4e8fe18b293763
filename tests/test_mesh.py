"""Device layout of the two-level mesh: per-node axes (mesh.data/fsdp/tensor) x across-node axes
(mesh.dcn_data/dcn_fsdp), including a trn2.48xlarge node on 64 fake devices."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from maxtrain import config as config_lib
from maxtrain.errors import UserError
from maxtrain.sharding.mesh import make_mesh, resolve_layout
from maxtrain.program.plan import validate

REPO = Path(__file__).resolve().parent.parent


def ids(mesh) -> np.ndarray:
  """Device ids over the mesh axes after `pipeline` (size 1 here)."""
  assert mesh.devices.shape[0] == 1
  return np.vectorize(lambda d: d.id)(mesh.devices)[0]


def test_dcn_axes_are_the_slow_factor():
  # 2 granules of 4: the data axis = (granule, data within granule); tensor stays inside a granule.
  mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 2, "dcn_data": 2})
  assert dict(mesh.shape) == {"pipeline": 1, "data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
  np.testing.assert_array_equal(ids(mesh)[:, :, 0, 0], np.arange(8).reshape(2, 2, 2))
  # dcn_fsdp: the fsdp axis runs over granule 0's devices, then granule 1's.
  mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 1, "dcn_fsdp": 2})
  assert dict(mesh.shape) == {"pipeline": 1, "data": 2, "fsdp": 4, "expert": 1, "context": 1, "tensor": 1}
  expected = np.array([[0, 1, 4, 5], [2, 3, 6, 7]])  # [data, fsdp]: fsdp = (granule, fsdp within)
  np.testing.assert_array_equal(ids(mesh)[:, :, 0, 0, 0], expected)
  for granule in range(2):  # every tensor group and every granule's devices are one node's
    assert set(ids(mesh)[:, 2 * granule:2 * granule + 2].ravel()) == set(range(4 * granule, 4 * granule + 4))


def test_layout_fills_one_axis_and_rejects_bad_sizes():
  assert resolve_layout({"data": 1, "fsdp": 8, "tensor": 1, "dcn_data": -1}, 64).dcn == (1, 8, 1, 1, 1, 1)
  assert resolve_layout({"data": 1, "fsdp": -1, "tensor": 4, "dcn_fsdp": 2}, 64).ici == (1, 1, 8, 1, 1, 4)
  with pytest.raises(UserError, match="at most one"):
    resolve_layout({"data": 1, "fsdp": -1, "tensor": 1, "dcn_data": -1}, 8)
  with pytest.raises(UserError, match="not divisible"):
    resolve_layout({"data": 1, "fsdp": 3, "tensor": 1, "dcn_data": -1}, 8)
  with pytest.raises(UserError, match="mesh.dcn_fsdp=0"):
    resolve_layout({"data": 1, "fsdp": 8, "tensor": 1, "dcn_fsdp": 0}, 8)


def test_hardware_preset_then_overrides():
  cfg = config_lib.load(["--config=configs/llama3_8b.py", "--config.hardware=trn2.48xlarge", "--config.mesh.tensor=8",
                         "--config.mesh.fsdp=8"])
  assert (cfg.runtime.platform, cfg.model.compute_dtype, cfg.mesh.dcn_data) == ("neuron", "bfloat16", -1)
  assert (cfg.mesh.fsdp, cfg.mesh.tensor) == (8, 8)  # the command line wins over the preset
  cfg = config_lib.load(["--config=configs/llama3_70b.py", "--config.hardware=h100x8"])
  assert (cfg.mesh.dcn_fsdp, cfg.mesh.dcn_data) == (-1, 1)  # the model's own preset over the generic one
  # 8 nodes: FSDP across them, tensor parallelism over each node's 8 GPUs.
  assert validate(cfg, 64, require_data=False).mesh.describe().startswith("data=1 x fsdp=8 x tensor=8")
  with pytest.raises(UserError, match="h100x8"):
    config_lib.load(["--config=configs/llama3_8b.py", "--config.hardware=h100"])


TRN2_SCRIPT = """
import json, jax, numpy as np
from maxtrain import config as config_lib
from maxtrain.sharding.mesh import make_mesh
from maxtrain.program.plan import validate
out = {}
for nodes in (1, 2):
  cfg = config_lib.load(["--config=configs/llama3_8b.py", "--config.hardware=trn2.48xlarge"])
  plan = validate(cfg, 64 * nodes, require_data=False)
  # One sequence per batch shard per microbatch: the global batch of 64 over 16 / 32 shards.
  assert plan.batch.num_microbatches == 4 // nodes and plan.batch.per_microbatch == 1
  mesh = make_mesh(plan.mesh, jax.devices()[:64 * nodes])
  out[nodes] = {"shape": dict(mesh.shape), "ids": np.vectorize(lambda d: d.id)(mesh.devices)[0].tolist()}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_trn2_node_mesh_on_64_fake_devices():
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=128", "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-c", TRN2_SCRIPT], capture_output=True, text=True, env=env, cwd=REPO,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  one = out["1"]
  assert one["shape"] == {"pipeline": 1, "data": 1, "fsdp": 16, "expert": 1, "context": 1, "tensor": 4}
  grid = np.array(one["ids"])[0, :, 0, 0]  # [fsdp, tensor]
  for f in range(16):  # tensor groups: 4 consecutive NeuronCores (one Trainium2 chip at LNC=2)
    np.testing.assert_array_equal(grid[f], np.arange(4 * f, 4 * f + 4))
  two = out["2"]  # two nodes: data parallel across them, each node laid out as above
  assert two["shape"] == {"pipeline": 1, "data": 2, "fsdp": 16, "expert": 1, "context": 1, "tensor": 4}
  grid = np.array(two["ids"])
  np.testing.assert_array_equal(grid[0, :, 0, 0], np.arange(64).reshape(16, 4))
  np.testing.assert_array_equal(grid[1, :, 0, 0], np.arange(64, 128).reshape(16, 4))
