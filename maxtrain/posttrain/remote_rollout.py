"""Asynchronous RL across hosts: `post.rollout_devices=N` in a job of several processes gives the last
N / (devices per process) processes to the rollout side. The trainer's processes run the Loop with the
`AsyncRlStepper` (its `RolloutSide` keeps the one queue, the versions, the staleness bound and the
timeouts: `async_rollout.py`); the rollout processes run no Loop, only `serve`: receive each published
version, sample the batches the trainer asks for, post them back.

Parameters: the trainer's processes and the rollout processes all call `jax.device_put` from the
trainer's parameter sharding onto the rollout mesh's (a cross-process transfer, jax's DCN socket transfer
on a port of each process: runtime/distributed.py transfer_address), in publish order. The transfer needs
the same sharding layout and device count on both sides; when the two meshes differ it goes through a
replicated copy (gathered on the trainer's devices; min(trainer, rollout devices) of its replicas, spread
over the trainer's processes, sent to as many rollout devices; spread on the rollout side's after).
Messages (the coordination service's key-value store, runtime/kv.py, keys `maxtrain/rl/...`): the first
trainer process posts `pub/<n>` (publish n is coming) and `req/<m>` (round, prompt position, version,
publish, restart), and `stop` (its exit code) when its run ends however it ends; the first rollout process
answers `ack/<n>` once publish n is in place and `batch/<restart>/<round>` with the rollout
(rollout.encode: bit for bit), or `died` with the error that ended it. Every wait is bounded: the
trainer's by post.sync_timeout_s (a publish or a batch past it is `rollout_stall` and exit 76); a rollout
process that fails ends the trainer's producer as the single-host contract says (`rollout_died`, the
error's exit code: a reward's error exit 2, anything else a crash); one killed outright is a stall (or jax's
own heartbeat ends the job). The rollout processes exit with the trainer's code. Batches travel as the
host data they are (tokens, texts, rewards).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxtrain.config import redact_text
from maxtrain.errors import Aborted, Preempted, Stalled, UserError
from maxtrain.inference import sampling as sampling_lib
from maxtrain.posttrain import rollout as rollout_lib
from maxtrain.posttrain.data import PromptData
from maxtrain.program.build import program_for, split_devices
from maxtrain.runtime.kv import KeyValue

log = logging.getLogger("maxtrain")
POLL_S = 1.0  # how often a wait looks at the stop flag and for the other side's `died` or `stop`


class _Ended:
  """Marks the errors a rollout process raises because the trainer ended (not a failure of its own)."""


_Crashed = type("TrainerCrashed", (RuntimeError, _Ended), {})
TRAINER_ENDED = {code: type(f"TrainerEnded{code}", (error, _Ended), {})
                 for code, error in ((2, UserError), (3, Aborted), (75, Preempted), (76, Stalled))}


def rollout_processes(cfg: Any) -> list[int]:
  """The processes of the rollout side (the last ones) in a multi-process job; [] on one process."""
  if jax.process_count() == 1:
    return []
  return sorted({d.process_index for d in split_devices(cfg, jax.devices())[1]})


def join_trainer_group(cfg: Any) -> bool:
  """On a trainer process of a job with rollout processes: agreement (barriers, stop steps, checkpoint saves)
  is among the trainer's processes only (runtime/kv.py KeyValue.group). True when this is a rollout process."""
  rollout = rollout_processes(cfg)
  if rollout:
    KeyValue.group = min(rollout)
  return jax.process_index() in rollout


def _spread(devices: list[Any], k: int) -> list[Any]:
  """The first k of `devices` taken round-robin over their processes (each process's first device, then
  each one's second, ...): every trainer process sends a share of the copies when k allows."""
  by_process: dict[int, list[Any]] = {}
  for d in devices:
    by_process.setdefault(d.process_index, []).append(d)
  order = sorted(devices, key=lambda d: (by_process[d.process_index].index(d), d.process_index))
  return order[:k]


def transfer_shardings(trainer: Any, rollout: Any) -> tuple[Any, Any, Any]:
  """(the trainer's gather, the trainer side's send, the rollout side's receive) sharding of each parameter
  for the cross-process device_put. When the two meshes lay a parameter out alike: the meshes' own (jax
  transfers shard to shard; gather is send). Else a replicated copy: gathered on the whole trainer mesh,
  then k = min(trainer, rollout devices) of its replicas (no copy: the shards already there) sent to k
  rollout devices, the rollout side spreading them after. jax's cross-process transfer needs device lists
  of one size on both sides (a 4-device trainer to a 2-device rollout mesh is refused: `CopyArrays only
  supports destination device list of the same size`). Every process decides it from the same programs."""
  def pair(t: NamedSharding, r: NamedSharding) -> tuple[NamedSharding, NamedSharding, NamedSharding]:
    if dict(t.mesh.shape) == dict(r.mesh.shape) and t.spec == r.spec:
      return t, t, r
    k = min(t.mesh.devices.size, r.mesh.devices.size)
    source = _spread(list(t.mesh.devices.flat), k)
    target = list(r.mesh.devices.flat)[:k]
    return (NamedSharding(t.mesh, PartitionSpec()), NamedSharding(Mesh(np.array(source), ("copies",)), PartitionSpec()),
            NamedSharding(Mesh(np.array(target), ("copies",)), PartitionSpec()))

  pairs = jax.tree.map(pair, trainer, rollout)
  first = lambda p: isinstance(p, tuple) and len(p) == 3 and isinstance(p[0], NamedSharding)  # noqa: E731
  return tuple(jax.tree.map(lambda p, i=i: p[i], pairs, is_leaf=first) for i in range(3))


def _to_send(x: jax.Array, gather: NamedSharding, send: NamedSharding) -> jax.Array:
  """x on the trainer mesh -> the array the cross-process transfer sends: the gathered copies on send's
  devices (this process's of them; a process holding none of them contributes nothing)."""
  x = jax.device_put(x, gather)
  if gather == send:
    return x
  mine = set(send.addressable_devices)
  return jax.make_array_from_single_device_arrays(x.shape, send,
                                                 [s.data for s in x.addressable_shards if s.device in mine])


class Link:
  """The trainer processes' end, for `RolloutSide`: `place` (publish a version), `wait` (its
  acknowledgement), `sample` (a batch from the rollout side), `restart` (a new producer)."""

  def __init__(self, trainer_program: Any, rollout_program: Any):
    self.kv = KeyValue.job()
    self.leader = jax.process_index() == 0  # posts the requests; every trainer process sends its shards
    self.dtypes = jax.tree.map(lambda a: a.dtype, rollout_program.state.abstract.params)
    self.gather, self.send, self.recv = transfer_shardings(trainer_program.state.shardings.params,
                                                           rollout_program.state.shardings.params)
    self.published = self.requests = self.restarts = 0

  def place(self, params: Any) -> int:
    """Sends `params` to the rollout processes (they receive publishes in order); returns the publish's number."""
    n, self.published = self.published, self.published + 1
    if self.leader:
      self.kv.set(f"rl/pub/{n}", str(n))
    cast = jax.tree.map(lambda x, d: x.astype(d), params, self.dtypes)
    jax.device_put(jax.tree.map(_to_send, cast, self.gather, self.send), self.recv)  # no shard here: what it sends
    return n

  def wait(self, n: int) -> None:
    """Returns once the rollout side holds publish n (the caller bounds it by post.sync_timeout_s)."""
    while self.kv.get(f"rl/ack/{n}", POLL_S) is None:
      self._check_alive()

  def restart(self) -> None:
    """A new producer (a start, a resume, a rollback): its batches are keyed apart from the last one's."""
    self.restarts += 1

  def sample(self, round_: int, position: int, version: int, publish: int, stopping: threading.Event) -> Any:
    """Round `round_`'s batch, sampled by the rollout side with publish `publish`; None once `stopping`."""
    if self.leader:
      m, self.requests = self.requests, self.requests + 1
      self.kv.set(f"rl/req/{m}", json.dumps({"round": round_, "position": position, "version": version,
                                             "publish": publish, "restart": self.restarts}))
    key = f"rl/batch/{self.restarts}/{round_}"
    while not stopping.is_set():
      value = self.kv.get(key, POLL_S)
      if value is not None:
        return rollout_lib.decode(json.loads(value))
      self._check_alive()
    return None

  def _check_alive(self) -> None:
    """A rollout process that failed says so (`died`); one killed outright leaves the wait to its timeout."""
    died = _try_get(self.kv, "rl/died")
    if died is not None:
      d = json.loads(died)
      error = UserError if d["kind"] == "user" else RuntimeError
      raise error(f"rollout process {d['process']}: {d['error']}")


def stop(cfg: Any, code: int) -> None:
  """On the first trainer process, when its run ends with exit `code`: the rollout processes end with it
  (serve). Nothing on a job without rollout processes."""
  if jax.process_index() == 0 and rollout_processes(cfg):
    try:
      KeyValue.job().set("rl/stop", str(code))
    except Exception as e:  # noqa: BLE001 - the coordinator is gone: the rollout processes' waits end them
      log.warning("could not tell the rollout processes to stop: %s", e)


def _forget(kv: KeyValue, key: str) -> None:
  """A batch every trainer process has taken: the request for round k comes once the trainer took round
  k - max_staleness - 1, so round k - max_staleness - 3 leaves the coordinator's memory (the rest is small)."""
  try:
    kv.delete(key)
  except Exception:  # noqa: BLE001 - never posted (a rollback's restart): nothing to forget
    pass


def _try_get(kv: KeyValue, key: str) -> str | None:
  try:
    return kv.client.key_value_try_get("maxtrain/" + key)
  except Exception:  # noqa: BLE001 - NOT_FOUND
    return None


class _Receiver:
  """A rollout process's publishes, in order, on a thread of its own (the main thread samples meanwhile)."""

  def __init__(self, cfg: Any, kv: KeyValue, leader: bool, trainer_program: Any, rollout_program: Any):
    self.kv, self.leader, self.keep = kv, leader, int(cfg.post.max_staleness) + 2
    _, self.send, self.recv = transfer_shardings(trainer_program.state.shardings.params,
                                                 rollout_program.state.shardings.params)
    self.final = rollout_program.state.shardings.params
    self.abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), rollout_program.state.abstract.params)
    self.versions: dict[int, Any] = {}
    self.cond, self.stop, self.errors = threading.Condition(), threading.Event(), []
    self.thread = threading.Thread(target=self._run, name="rollout-receive", daemon=True)
    self.thread.start()

  def get(self, n: int) -> Any:
    """Publish n's parameters on the rollout mesh, once here."""
    with self.cond:
      while n not in self.versions and not self.errors:
        self.cond.wait(POLL_S)
      self.check()
      return self.versions[n]

  def check(self) -> None:
    if self.errors:
      raise self.errors[0]

  def close(self) -> None:
    self.stop.set()
    self.thread.join(timeout=2 * POLL_S)

  def _run(self) -> None:
    n = 0
    try:
      while not self.stop.is_set():
        if self.kv.get(f"rl/pub/{n}", POLL_S) is None:
          continue
        sources = jax.tree.map(lambda a, s: jax.make_array_from_single_device_arrays(a.shape, s, [], dtype=a.dtype),
                               self.abstract, self.send)  # the trainer's shards: none of them here
        params = jax.device_put(jax.device_put(sources, self.recv), self.final)
        jax.block_until_ready(params)
        with self.cond:
          self.versions[n] = params
          for old in [v for v in self.versions if v < n - self.keep]:
            del self.versions[old]  # the trainer asks for publishes at most max_staleness + 1 behind
          self.cond.notify_all()
        if self.leader:
          self.kv.set(f"rl/ack/{n}", "1")
        n += 1
    except BaseException as e:  # noqa: BLE001 - handed to the main thread
      with self.cond:
        self.errors.append(e)
        self.cond.notify_all()


def serve(cfg: Any) -> dict:
  """A rollout process's whole run: versions in, batches out, until the trainer's `stop`. Returns {} (exit 0);
  an error is posted (`died`) for the trainer, then raised (this process's exit code)."""
  kv, me = KeyValue.job(), jax.process_index()
  leader = me == rollout_processes(cfg)[0]
  # A stop request (the launcher signals every process) is the trainer's to act on: it saves, then its
  # `stop` ends this process with the same code (75).
  signal.signal(signal.SIGTERM, lambda *_: log.warning("SIGTERM: this rollout process ends when the trainer stops"))
  try:
    trainer_program = program_for(cfg, jax.devices(), require_data=False)  # its shardings: the transfer's source
    rollout_program = rollout_lib.rollout_program(cfg)
    data = PromptData(cfg, rollout_program.batch_shardings)
    log.info("rollout process %d: the rollout side of %s on %d devices", me, cfg.post.mode,
             len(rollout_program.mesh.devices.flat))
    receiver = _Receiver(cfg, kv, leader, trainer_program, rollout_program)
    generator, m = None, 0
    try:  # the receiver's thread ends before this process does (one blocked in jaxlib at exit aborts it)
      while True:
        request = kv.get(f"rl/req/{m}", POLL_S)
        receiver.check()
        if request is None:
          code = _try_get(kv, "rl/stop")
          if code is None:
            continue
          break
        m, r = m + 1, json.loads(request)
        params = receiver.get(r["publish"])
        if generator is None:
          generator = sampling_lib.for_program(rollout_program, params)
        made = rollout_lib.sample(data, generator, params, r["position"], cfg.post, cfg.seed, cfg.data.seq_len)
        if leader:
          kv.set(f"rl/batch/{r['restart']}/{r['round']}", json.dumps(rollout_lib.encode(made)))
          _forget(kv, f"rl/batch/{r['restart']}/{r['round'] - int(cfg.post.max_staleness) - 3}")
    finally:
      receiver.close()
    log.info("rollout process %d: the trainer ended (exit %s) after %d rollout batches", me, code, m)
    if int(code) != 0:
      raise TRAINER_ENDED.get(int(code), _Crashed)(f"the trainer's process 0 ended with exit {code}: this "
                                                   "rollout process ends with it")
    return {}
  except BaseException as e:
    if not isinstance(e, _Ended):  # its own failure: the trainer's producer ends with it (rollout_died)
      kind = "user" if isinstance(e, UserError) else "crash"
      try:
        kv.set("rl/died", json.dumps({"process": me, "kind": kind,
                                      "error": redact_text(f"{type(e).__name__}: {e}")[:1000]}))
      except Exception:  # noqa: BLE001 - the coordinator is gone too: the trainer's own wait ends it
        pass
    raise
