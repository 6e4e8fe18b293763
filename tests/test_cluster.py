"""Multi-process layout detection from launcher environments (plain dicts, as srun / mpirun /
Kubernetes would set them), explicit config winning, and the launch templates' config keys."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from maxtrain.runtime import cluster
from maxtrain.config import base_config
from maxtrain.errors import UserError

REPO = Path(__file__).resolve().parent.parent


def runtime(**overrides):
  r = base_config().runtime
  for key, value in overrides.items():
    r[key] = value
  return r


def slurm_env(procid: int, job: str = "4242", **extra) -> dict:
  return {"SLURM_JOB_ID": job, "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8",
          "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid % 4), "SLURM_NNODES": "2",
          "SLURM_STEP_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[007-008]",
          "SLURM_STEP_NODELIST": "gpu[007-008]", **extra}


def test_expand_nodelist():
  assert cluster.expand_nodelist("gpu[001-004,007],cpu5") == ["gpu001", "gpu002", "gpu003", "gpu004", "gpu007", "cpu5"]
  assert cluster.expand_nodelist("node1") == ["node1"]
  assert cluster.expand_nodelist("r[1-2]n[08-09]") == ["r1n08", "r1n09", "r2n08", "r2n09"]
  assert cluster.expand_nodelist("a[9-11]-ib,b") == ["a9-ib", "a10-ib", "a11-ib", "b"]
  with pytest.raises(UserError, match="node list"):
    cluster.expand_nodelist("gpu[a-b]")


def test_slurm():
  layouts = [cluster.detect(slurm_env(i)) for i in range(8)]
  first = layouts[5]
  assert (first.kind, first.num_processes, first.process_id, first.local_process_id, first.num_nodes) == \
         ("slurm", 8, 5, 1, 2)
  host, port = first.coordinator.split(":")
  assert host == "gpu007" and cluster.PORT_BASE <= int(port) < cluster.PORT_BASE + cluster.PORT_SPAN
  assert {lay.coordinator for lay in layouts} == {first.coordinator}  # every rank finds the same one
  other_job = cluster.detect(slurm_env(0, job="4243"))
  assert other_job.coordinator != first.coordinator  # two jobs on one node do not share a port
  assert cluster.detect(slurm_env(0), port=31000).coordinator == "gpu007:31000"
  # The step's node list wins over the job's (a step may run on a subset of the allocation).
  step = cluster.detect(slurm_env(0, SLURM_STEP_NODELIST="gpu008"))
  assert step.coordinator.startswith("gpu008:")


def test_slurm_batch_script_without_srun_is_one_process():
  env = slurm_env(0)
  for key in [k for k in env if k.startswith("SLURM_STEP")]:
    del env[key]
  assert cluster.detect(env) is None
  assert cluster.resolve(runtime(), env).num_processes == 1
  with pytest.raises(UserError, match="srun"):
    cluster.resolve(runtime(cluster="slurm"), env)


def test_openmpi():
  env = {"OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
         "OMPI_COMM_WORLD_LOCAL_SIZE": "8", "PMIX_NAMESPACE": "prterun-head-311@1"}
  found = cluster.detect(env)
  assert (found.kind, found.num_processes, found.process_id, found.local_process_id, found.num_nodes,
          found.coordinator) == ("openmpi", 16, 9, 1, 2, "")
  with pytest.raises(UserError, match=cluster.COORDINATOR_ENV):  # mpirun does not name rank 0's host
    cluster.resolve(runtime(), env)
  with_host = cluster.resolve(runtime(), {**env, cluster.COORDINATOR_ENV: "head"})
  assert re.fullmatch(r"head:\d+", with_host.coordinator)
  assert cluster.resolve(runtime(), {**env, cluster.COORDINATOR_ENV: "head:7000"}).coordinator == "head:7000"


def test_kubernetes_indexed_job():
  env = {"JOB_COMPLETION_INDEX": "3", cluster.NUM_PROCESSES_ENV: "4", "HOSTNAME": "train-3",
         cluster.COORDINATOR_ENV: "train-0.train-svc:1234"}
  found = cluster.resolve(runtime(), env)
  assert (found.kind, found.num_processes, found.process_id, found.coordinator) == \
         ("kubernetes", 4, 3, "train-0.train-svc:1234")
  # Without a count an Indexed Job is a set of independent tasks (e.g. a sweep): one process each.
  assert cluster.detect({"JOB_COMPLETION_INDEX": "3"}) is None


def test_jobset():
  def pod(job_index: int, pod_index: int) -> dict:
    return {"JOBSET_NAME": "llama", "REPLICATED_JOB_NAME": "workers", "REPLICATED_JOB_REPLICAS": "2",
            "JOB_INDEX": str(job_index), "JOB_COMPLETION_INDEX": str(pod_index), cluster.NUM_PROCESSES_ENV: "8"}

  layouts = [cluster.resolve(runtime(), pod(j, i)) for j in range(2) for i in range(4)]
  assert [lay.process_id for lay in layouts] == list(range(8))
  assert {lay.num_processes for lay in layouts} == {8}
  coordinators = {lay.coordinator for lay in layouts}
  assert len(coordinators) == 1 and coordinators.pop().startswith("llama-workers-0-0.llama:")
  with pytest.raises(UserError, match="multiple of REPLICATED_JOB_REPLICAS"):
    cluster.detect({**pod(0, 0), cluster.NUM_PROCESSES_ENV: "7"})


def test_explicit_keys_win_and_none_ignores_the_environment():
  explicit = cluster.resolve(runtime(num_processes=2, process_id=1, coordinator="10.0.0.1:9999"), slurm_env(5))
  assert (explicit.num_processes, explicit.process_id, explicit.coordinator) == (2, 1, "10.0.0.1:9999")
  assert cluster.resolve(runtime(process_id=0), slurm_env(5)).process_id == 0
  assert cluster.resolve(runtime(cluster="none"), slurm_env(5)).num_processes == 1
  assert cluster.resolve(runtime(coordinator_port=40000), slurm_env(1)).coordinator == "gpu007:40000"
  single = cluster.resolve(runtime(), {})
  assert (single.kind, single.num_processes, single.process_id) == ("none", 1, 0)


def test_bad_layouts():
  with pytest.raises(UserError, match="outside 0..1"):
    cluster.resolve(runtime(num_processes=2, process_id=2, coordinator="h:1"), {})
  with pytest.raises(UserError, match="coordinator"):
    cluster.resolve(runtime(num_processes=2, process_id=0), {})
  with pytest.raises(UserError, match="runtime.cluster"):
    cluster.resolve(runtime(cluster="pbs"), {})


# Keys added on main at the same time as the templates (mesh over hosts, hardware presets).
KEYS_FROM_MAIN = {"hardware", "mesh.dcn_data", "mesh.dcn_fsdp"}


def config_keys(cfg, prefix=""):
  keys = set()
  for k, v in cfg.items():
    keys |= config_keys(v, f"{prefix}{k}.") if hasattr(v, "items") else {prefix + k}
  return keys


def test_launch_templates_use_real_config_keys():
  templates = sorted((REPO / "launch").iterdir())
  assert {t.name for t in templates} >= {"slurm_gpu.sbatch", "slurm_trn2.sbatch", "k8s_jobset.yaml"}
  known = config_keys(base_config()) | KEYS_FROM_MAIN
  for template in templates:
    text = template.read_text()
    used = set(re.findall(r"--config\.([A-Za-z0-9_.]+)=", text))
    assert used, f"{template.name} passes no --config.KEY=VALUE"
    assert used <= known, f"{template.name}: unknown config keys {sorted(used - known)}"
    for path in re.findall(r"--config=(\S+?\.py)", text):
      assert (REPO / path).is_file(), f"{template.name}: --config={path} does not exist"
    assert "maxtrain.train" in text


def test_jobset_template_parses():
  yaml = pytest.importorskip("yaml")
  docs = [d for d in yaml.safe_load_all((REPO / "launch" / "k8s_jobset.yaml").read_text()) if d]
  jobset = next(d for d in docs if d["kind"] == "JobSet")
  assert jobset["spec"]["network"]["enableDNSHostnames"] is True
  replicated = jobset["spec"]["replicatedJobs"][0]
  job, replicas = replicated["template"]["spec"], replicated.get("replicas", 1)
  assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"]
  container = job["template"]["spec"]["containers"][0]
  # What JobSet puts in each pod's annotations; the template maps them to env with fieldRefs.
  name = jobset["metadata"]["name"]
  layouts = []
  for job_index in range(replicas):
    annotations = {"jobset.sigs.k8s.io/jobset-name": name, "jobset.sigs.k8s.io/replicatedjob-name": replicated["name"],
                   "jobset.sigs.k8s.io/job-index": str(job_index),
                   "jobset.sigs.k8s.io/replicatedjob-replicas": str(replicas)}
    for pod_index in range(job["completions"]):
      environ = {"JOB_COMPLETION_INDEX": str(pod_index)}
      for e in container["env"]:
        environ[e["name"]] = e["value"] if "value" in e else \
            annotations[re.fullmatch(r"metadata\.annotations\['(.+)'\]", e["valueFrom"]["fieldRef"]["fieldPath"])[1]]
      layouts.append(cluster.resolve(runtime(), environ))
  assert [lay.process_id for lay in layouts] == list(range(len(layouts)))
  assert {lay.num_processes for lay in layouts} == {len(layouts)}  # MAXTRAIN_NUM_PROCESSES matches the pods
  assert {lay.coordinator.split(":")[0] for lay in layouts} == {f"{name}-{replicated['name']}-0-0.{name}"}


INIT_SCRIPT = """
import logging, sys
import jax
from maxtrain import config
from maxtrain.runtime import distributed
logging.basicConfig(level=logging.INFO)
cfg = config.load(sys.argv[1:])
distributed.initialize_distributed(cfg.runtime)
print("layout", jax.process_index(), jax.process_count(), jax.device_count(), flush=True)
"""


def test_detected_layout_starts_jax_distributed():
  """Two real processes that see only srun-style variables find each other through the detected
  coordinator (the first host of the node list, the configured port)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
  procs = [subprocess.Popen(
      [sys.executable, "-c", INIT_SCRIPT, f"--config.runtime.coordinator_port={port}"],
      env={**base, **slurm_env(i, SLURM_STEP_NUM_TASKS="2", SLURM_LOCALID=str(i), SLURM_STEP_NUM_NODES="1",
                               SLURM_STEP_NODELIST="127.0.0.1"),
           "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO) for i in range(2)]
  outs = [p.communicate(timeout=180)[0] for p in procs]
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, out[-2000:]
    assert f"layout {i} 2 4" in out
    assert f"cluster slurm: process {i} of 2 (local {i}) on 1 node(s), coordinator 127.0.0.1:{port}" in out
