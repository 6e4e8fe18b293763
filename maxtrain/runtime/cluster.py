"""Where this process sits in a multi-process job: detected from the launcher's environment (SLURM
srun, Open MPI mpirun, a Kubernetes Indexed Job or JobSet) unless the config says it explicitly.

`detect(environ)` and `resolve(runtime_cfg, environ)` are pure functions of the environment mapping,
so every launcher can be tested with a plain dict.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import zlib
from typing import Mapping

from maxtrain.errors import UserError

log = logging.getLogger("maxtrain")
KINDS = ("auto", "none", "slurm", "openmpi", "kubernetes")
COORDINATOR_ENV = "MAXTRAIN_COORDINATOR"  # host or host:port of process 0 (Open MPI, Indexed Job)
NUM_PROCESSES_ENV = "MAXTRAIN_NUM_PROCESSES"  # process count of a Kubernetes job (pods know only their index)
PORT_BASE, PORT_SPAN = 20000, 10000  # derived ports stay below Linux's ephemeral range (32768+)


@dataclasses.dataclass(frozen=True)
class Cluster:
  kind: str  # slurm | openmpi | kubernetes | config (explicit keys) | none (one process)
  num_processes: int
  process_id: int
  local_process_id: int  # index among the processes on this host
  num_nodes: int
  coordinator: str  # host:port of process 0's coordination service; "" when it is unknown
  job_key: str = ""  # what the default port is derived from

  def describe(self) -> str:
    where = f", coordinator {self.coordinator}" if self.coordinator else ""
    return (f"{self.kind}: process {self.process_id} of {self.num_processes} (local {self.local_process_id}) "
            f"on {self.num_nodes} node(s){where}")


def expand_nodelist(nodelist: str) -> list[str]:
  """SLURM's compressed host list, e.g. `gpu[001-004,007],cpu5` -> gpu001 .. gpu004, gpu007, cpu5.
  Several bracket groups in one name expand as a product (`r[1-2]n[1-2]`), zero padding is kept."""
  hosts: list[str] = []
  for item in _split_top_level(nodelist.strip()):
    hosts += _expand_item(item)
  return hosts


def _split_top_level(text: str) -> list[str]:
  items, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    depth += ch == "["
    depth -= ch == "]"
    if ch == "," and depth == 0:
      items.append(text[start:i])
      start = i + 1
  items.append(text[start:])
  return [item for item in items if item]


def _expand_item(item: str) -> list[str]:
  match = re.search(r"\[([^\]]*)\]", item)
  if match is None:
    return [item]
  head, tail = item[:match.start()], item[match.end():]
  values = []
  for part in match.group(1).split(","):
    lo, _, hi = part.partition("-")
    if not lo.isdigit() or (hi and not hi.isdigit()):
      raise UserError(f"cannot parse SLURM node list {item!r}: {part!r} is not N or N-M")
    width = len(lo)
    values += [str(n).zfill(width) for n in range(int(lo), int(hi or lo) + 1)]
  return [head + v + rest for v in values for rest in _expand_item(tail)]


def default_port(job_key: str) -> int:
  """A coordinator port that every process of one job derives alike and that differs between jobs
  (two jobs sharing a node must not collide): PORT_BASE + crc32(job key) mod PORT_SPAN."""
  return PORT_BASE + zlib.crc32(job_key.encode()) % PORT_SPAN


def _int(environ: Mapping[str, str], name: str) -> int:
  try:
    return int(environ[name])
  except ValueError:
    raise UserError(f"environment variable {name}={environ[name]!r} is not an integer") from None


def _with_port(host: str, port: int) -> str:
  return host if ":" in host else f"{host}:{port}"


def _slurm(environ: Mapping[str, str], port: int) -> Cluster | None:
  # Only srun sets the SLURM_STEP_* variables: a batch script without srun is one process even when
  # SLURM_NTASKS counts more, and treating it as several would hang in jax.distributed.initialize.
  if "SLURM_JOB_ID" not in environ or "SLURM_STEP_NUM_TASKS" not in environ:
    return None
  nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
  hosts = expand_nodelist(nodelist) if nodelist else []
  key = f"slurm-{environ['SLURM_JOB_ID']}.{environ.get('SLURM_STEP_ID', '')}"
  nodes = environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES") or str(max(len(hosts), 1))
  return Cluster("slurm", _int(environ, "SLURM_STEP_NUM_TASKS"), _int(environ, "SLURM_PROCID"),
                 _int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0, int(nodes),
                 f"{hosts[0]}:{port or default_port(key)}" if hosts else "", key)


def _openmpi(environ: Mapping[str, str], port: int) -> Cluster | None:
  if "OMPI_COMM_WORLD_SIZE" not in environ:
    return None
  size, local_size = _int(environ, "OMPI_COMM_WORLD_SIZE"), environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
  nodes = -(-size // int(local_size)) if local_size else 1  # assumes the same processes on every node
  key = "openmpi-" + (environ.get("PMIX_NAMESPACE") or environ.get("OMPI_MCA_ess_base_jobid", ""))
  host = environ.get(COORDINATOR_ENV, "")
  return Cluster("openmpi", size, _int(environ, "OMPI_COMM_WORLD_RANK"),
                 _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK") if "OMPI_COMM_WORLD_LOCAL_RANK" in environ else 0,
                 nodes, _with_port(host, port or default_port(key)) if host else "", key)


def _kubernetes(environ: Mapping[str, str], port: int) -> Cluster | None:
  # A pod knows its index but not the job's size, so the count must be in the pod spec; without it
  # an Indexed Job is taken for what it often is, a set of independent single-process tasks.
  if "JOB_COMPLETION_INDEX" not in environ or NUM_PROCESSES_ENV not in environ:
    return None
  total, pod_index = _int(environ, NUM_PROCESSES_ENV), _int(environ, "JOB_COMPLETION_INDEX")
  host = environ.get(COORDINATOR_ENV, "")
  if "JOBSET_NAME" in environ:
    # JobSet: REPLICATED_JOB_REPLICAS jobs of total/replicas pods; pod (job j, index i) is process
    # j * pods_per_job + i. Pod hostnames are <jobset>-<replicated job>-<job index>-<pod index> under
    # the JobSet's headless service, whose name (the subdomain) defaults to the JobSet's name.
    name, replicated = environ["JOBSET_NAME"], environ.get("REPLICATED_JOB_NAME", "")
    replicas = _int(environ, "REPLICATED_JOB_REPLICAS") if "REPLICATED_JOB_REPLICAS" in environ else 1
    if replicas < 1 or total % replicas:
      raise UserError(f"{NUM_PROCESSES_ENV}={total} is not a multiple of REPLICATED_JOB_REPLICAS={replicas}: "
                      "every replicated job must run the same number of pods")
    job_index = _int(environ, "JOB_INDEX") if "JOB_INDEX" in environ else 0
    process_id, key = job_index * (total // replicas) + pod_index, f"jobset-{name}"
    host = host or f"{name}-{replicated}-0-0.{environ.get('JOBSET_SUBDOMAIN') or name}"
  else:
    process_id, key = pod_index, "k8s-" + environ.get("HOSTNAME", "").rpartition("-")[0]
  return Cluster("kubernetes", total, process_id, 0, total,
                 _with_port(host, port or default_port(key)) if host else "", key)


DETECTORS = {"slurm": _slurm, "openmpi": _openmpi, "kubernetes": _kubernetes}


def detect(environ: Mapping[str, str], kind: str = "auto", port: int = 0) -> Cluster | None:
  """The launcher's process layout, or None when the environment shows no multi-process launcher.
  `kind` restricts detection to one launcher ("auto" tries each); `port` overrides the derived
  coordinator port."""
  for name, detector in DETECTORS.items():
    if kind in ("auto", name):
      found = detector(environ, port)
      if found is not None:
        return found
  return None


def resolve(runtime_cfg, environ: Mapping[str, str]) -> Cluster:
  """The layout this process runs with: explicit config keys (runtime.num_processes > 0,
  runtime.process_id >= 0, runtime.coordinator) win over what the environment shows."""
  kind = runtime_cfg.cluster
  if kind not in KINDS:
    raise UserError(f"config.runtime.cluster={kind!r}: choose one of {', '.join(KINDS)}")
  found = None if kind == "none" else detect(environ, kind, runtime_cfg.coordinator_port)
  if found is None and kind not in ("auto", "none"):
    raise UserError(f"config.runtime.cluster={kind}: no {kind} job found in the environment ("
                    + {"slurm": "launch with srun: only srun sets SLURM_STEP_NUM_TASKS",
                       "openmpi": "launch with mpirun: it sets OMPI_COMM_WORLD_SIZE",
                       "kubernetes": f"needs JOB_COMPLETION_INDEX (an Indexed Job) and {NUM_PROCESSES_ENV}"}[kind]
                    + "). Use runtime.cluster=auto or none, or set runtime.num_processes/process_id/coordinator.")
  base = found or Cluster("none", 1, 0, 0, 1, "")
  explicit = {}
  if runtime_cfg.num_processes > 0:
    explicit["num_processes"] = runtime_cfg.num_processes
  if runtime_cfg.process_id >= 0:
    explicit["process_id"] = runtime_cfg.process_id
  if runtime_cfg.coordinator:
    explicit["coordinator"] = runtime_cfg.coordinator
  layout = dataclasses.replace(base, **explicit)
  if explicit and found is None:
    layout = dataclasses.replace(layout, kind="config", num_nodes=layout.num_processes)
  _check(layout)
  return layout


def _check(layout: Cluster) -> None:
  n, i = layout.num_processes, layout.process_id
  if n < 1:
    raise UserError(f"config.runtime.num_processes={n}: must be >= 1 (0 = detect)")
  if not 0 <= i < n:
    raise UserError(f"process id {i} is outside 0..{n - 1} ({layout.kind} layout with {n} processes): "
                    "set config.runtime.process_id (or leave it -1 to detect it)")
  if n > 1 and not re.fullmatch(r"[^\s:]+:\d+", layout.coordinator or ""):
    how = {"openmpi": f"export {COORDINATOR_ENV}=<host of rank 0> to every rank (mpirun -x)",
           "kubernetes": f"set {COORDINATOR_ENV}=<pod 0's DNS name> in the pod spec"}.get(layout.kind, "")
    raise UserError(f"{n} processes ({layout.kind}) need the coordinator's host:port, got "
                    f"{layout.coordinator or 'none'}: set config.runtime.coordinator=HOST:PORT"
                    + (f" or {how}" if how else ""))
