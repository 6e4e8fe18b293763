"""Asynchronous RL (`post.rollout_devices`, `post.max_staleness`): rollouts made by a producer thread on a
rollout mesh of their own (the last post.rollout_devices devices; with 0, on the trainer's devices), a
bounded number of policy versions behind the update that trains on them.

Versions: version v is the policy after v rounds (the checkpoint's step / updates a round). After round
k the trainer publishes version k onto the rollout mesh (`jax.device_put` onto its parameter sharding,
awaited within post.sync_timeout_s). The interleaving is fixed, so a run is a function of its config:
round k trains on the prompt batch sampled by version max(floor, k - 1 - max_staleness), floor being the
version the attempt (or a rollback) started from. max_staleness=0 is the synchronous order (each round
samples with the parameters it trains); with max_staleness=S the producer samples round k + S's batch
while the trainer trains round k, on disjoint devices (JAX dispatch releases the GIL: both run at once).

The queue holds at most S + 1 rounds. A batch whose version lags the trainer's by more than S (or was made
by versions a rollback abandoned) is dropped, counted (`rl/dropped_rollouts`, event `rollout_drop`) and
never trained on. Exact resume: the data state records the batches made (or started) by versions
older than the checkpoint's (`PromptData.in_flight`), with their round, prompt position and version;
a resumed run trains on those and samples the later ones with its own parameters, as the run that never
stopped did. Faults: a publish, or the wait for a batch, that takes over post.sync_timeout_s is an event
(`rollout_stall`) and exit 76 (`errors.Stalled`); an exception in the producer ends the run as it would
have in a synchronous round (a reward's UserError is exit 2, anything else a crash). Across hosts the
rollout side is processes of their own (`remote_rollout.py`): the same queue, with a `Link` that places,
acknowledges and samples remotely.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import jax

from maxtrain.config import redact_text
from maxtrain.errors import Stalled, UserCodeExit, UserError
from maxtrain.inference import sampling as sampling_lib
from maxtrain.monitor import events as ev
from maxtrain.posttrain import remote_rollout, rollout as rollout_lib
from maxtrain.posttrain.rollout import decode, encode
from maxtrain.posttrain.rl import Outcome, RlStepper, completion_tokens
from maxtrain.program import state as state_lib

log = logging.getLogger("maxtrain")


@dataclasses.dataclass
class Made:
  """A rollout batch the producer made for round `round` from prompt batch `position` with version `version`."""
  round: int
  position: int
  version: int
  rollout: rollout_lib.Rollout
  encoded: dict  # its JSON form, made once by the producer (the data state is read every round)

  def state(self) -> dict:
    return {"round": self.round, "position": self.position, "version": self.version, "rollout": self.encoded}

  @classmethod
  def from_state(cls, d: dict) -> "Made":
    return cls(int(d["round"]), int(d["position"]), int(d["version"]), decode(d["rollout"]), d["rollout"])


class RolloutSide:
  """The producer thread, the published versions and the queue of rollout batches (module docstring)."""

  def __init__(self, data: Any, place: Callable[[Any], Any], generator_for: Callable[[Any], Any], post: Any,
               seed: int, seq_len: int, observers: Any, events: Any, startup_s: float = 0.0, link: Any = None):
    """`link`: the rollout side is processes of their own (remote_rollout.Link: it places, acknowledges and
    samples); None: the producer samples here, on the devices `place` puts the parameters on."""
    self.data, self.place, self.generator_for, self.post, self.link = data, place, generator_for, post, link
    self.seed, self.seq_len, self.observers, self.events = seed, seq_len, observers, events
    self.staleness, self.timeout = int(post.max_staleness), float(post.sync_timeout_s)
    self.startup_s, self.first = float(startup_s), True
    self.cond = threading.Condition()
    self.items: collections.deque[Made] = collections.deque()
    self.versions: dict[int, Any] = {}
    self.thread: threading.Thread | None = None
    self.stopping = threading.Event()
    self.error: BaseException | None = None
    self.floor = self.trainer_version = self.next_round = self.next_position = 0
    self.producer_idle_s = self.producer_busy_s = 0.0  # since the last round read them
    self.dropped = 0  # batches never trained on, this attempt

  # --- the trainer's side -------------------------------------------------------------------------
  def restart(self, params: Any, version: int, round_: int, position: int, restored: list[dict]) -> None:
    """(Re)starts the producer after the trainer's `version` (a fresh start, a resume, a rollback): the
    restored batches first (the checkpoint's), then rounds from there, sampled at position onwards."""
    self.close()
    made = [Made.from_state(d) for d in restored]
    # A resume with a smaller post.max_staleness (or other rounds): only the batches this run would have
    # made itself, in order, are kept; the rest are dropped (and counted), never trained on.
    keep = 0
    while (keep < len(made) and made[keep].round == round_ + keep
           and made[keep].round - 1 - made[keep].version <= self.staleness):
      keep += 1
    self.trainer_version = version
    self._drop(made[keep:])
    made = made[:keep]
    self.stopping, self.error, self.first = threading.Event(), None, True
    self.items = collections.deque(made)
    self.floor = self.trainer_version = version
    self.next_round = round_ + len(made)
    self.next_position = made[-1].position + 1 if made else position
    self.versions = {}
    if self.link is not None:
      self.link.restart()
    self._publish(params, version)
    self.thread = threading.Thread(target=self._produce, name="rollout-producer", daemon=True)
    self.thread.start()

  def publish(self, params: Any, version: int) -> float:
    """Version `version` onto the rollout side; returns the seconds it took (Stalled past the timeout)."""
    return self._publish(params, version)

  def take(self, round_: int) -> tuple[Made, float]:
    """Round `round_`'s batch and the seconds the trainer waited for it. A batch outside the staleness
    bound is dropped and counted, never returned. The attempt's first batch compiles the rollout side's
    generator: it may take watchdog.startup_timeout_s more."""
    t0 = time.monotonic()
    deadline = t0 + self.timeout + (self.startup_s if self.first else 0.0)
    self.first = False
    with self.cond:
      while True:
        while not self.items:
          if self.error is not None:
            raise self.error
          if self.thread is None or not self.thread.is_alive():
            raise RuntimeError(f"the rollout producer thread is gone without a batch for round {round_}")
          left = deadline - time.monotonic()
          if left <= 0:
            self._stalled("rollout", self.next_round, time.monotonic() - t0)
          self.cond.wait(min(left, 1.0))
        made = self.items.popleft()
        self.cond.notify_all()
        lag = self.trainer_version - made.version
        if made.round == round_ and 0 <= lag <= self.staleness:
          return made, time.monotonic() - t0
        self._drop([made])

  def get_state(self) -> list[dict]:
    """The batches of later rounds made by versions older than the trainer's (the ones a resume could not
    make again), after waiting for those still being made."""
    deadline = time.monotonic() + self.timeout
    with self.cond:
      while self._need(self.next_round) < self.trainer_version and self.error is None:
        left = deadline - time.monotonic()
        if left <= 0:
          self._stalled("rollout", self.next_round, self.timeout)
        self.cond.wait(min(left, 1.0))
      if self.error is not None:
        raise self.error
      return [m.state() for m in self.items]

  def idle_busy(self) -> tuple[float, float]:
    """The producer's seconds waiting for a version and making batches since the last call."""
    with self.cond:
      out, self.producer_idle_s, self.producer_busy_s = (self.producer_idle_s, self.producer_busy_s), 0.0, 0.0
    return out

  def drop_all(self) -> None:
    """After a rollback: the batches made by the abandoned versions are dropped (and counted)."""
    self.close()
    self._drop(list(self.items))
    self.items.clear()

  def close(self) -> None:
    if self.thread is not None:
      self.stopping.set()
      with self.cond:
        self.cond.notify_all()
      self.thread.join(timeout=self.timeout)
      self.thread = None

  # --- internals ----------------------------------------------------------------------------------
  def _need(self, round_: int) -> int:
    """The version round `round_`'s batch is sampled with (the fixed interleaving)."""
    return max(self.floor, round_ - 1 - self.staleness)

  def _publish(self, params: Any, version: int) -> float:
    t0 = time.monotonic()
    placed = self.place(params)
    done = threading.Event()
    completes = self.observers.publish(version)  # False: a drill's transfer that never completes
    failed: list[BaseException] = []

    def wait() -> None:  # a thread of its own: block_until_ready has no timeout
      try:
        jax.block_until_ready(placed) if self.link is None else self.link.wait(placed)
      except BaseException as e:  # noqa: BLE001 - the rollout process died: ends the publish below
        failed.append(e)
        done.set()
        return
      if completes:
        done.set()

    threading.Thread(target=wait, name="publish", daemon=True).start()
    if not done.wait(self.timeout):
      self._stalled("publish", version, time.monotonic() - t0)
    if failed:
      raise self._died(failed[0])
    with self.cond:
      self.versions[version] = placed
      self.trainer_version = version
      self._forget()
      self.cond.notify_all()
    return time.monotonic() - t0

  def _forget(self) -> None:
    """Drops the versions no batch still to be made needs (the rollout side holds at most S + 1)."""
    keep = self._need(self.next_round)
    for v in [v for v in self.versions if v < keep]:
      del self.versions[v]

  def _stalled(self, phase: str, version: int, waited_s: float) -> None:
    self.events.emit(ev.ROLLOUT_STALL, self.trainer_version, phase=phase, version=version, waited_s=round(waited_s, 3))
    what = "the weight publish of version" if phase == "publish" else "the rollout batch sampled by version"
    raise Stalled(f"{what} {version if phase == 'publish' else self._need(self.next_round)} took over "
                  f"post.sync_timeout_s={self.timeout:g}s: the rollout side is hung (exit 76, restartable)")

  def _drop(self, made: list[Made]) -> None:
    if made:
      self.dropped += len(made)
      self.events.emit(ev.ROLLOUT_DROP, self.trainer_version, count=len(made), versions=[m.version for m in made])
      log.warning("dropped %d rollout batches (versions %s) outside the staleness bound of the trainer's version %d",
                  len(made), [m.version for m in made], self.trainer_version)

  def _produce(self) -> None:
    try:
      while not self.stopping.is_set():
        t0 = time.monotonic()
        with self.cond:
          k, q = self.next_round, self.next_position
          need = self._need(k)
          while not self.stopping.is_set() and (need not in self.versions or len(self.items) > self.staleness):
            self.cond.wait(1.0)
          if self.stopping.is_set():
            return
          params = self.versions[need]
        t1 = time.monotonic()
        # A drill may hold the producer until the run stops (a hung worker) or raise (a worker that dies).
        if self.observers.rollout(k, self.stopping):
          return
        if self.link is not None:  # params: the publish's number on the rollout processes
          r = self.link.sample(k, q, need, params, self.stopping)
          if r is None:  # stopping
            return
        else:
          r = rollout_lib.sample(self.data, self.generator_for(params), params, q, self.post, self.seed, self.seq_len)
        made = Made(k, q, need, r, encode(r))
        with self.cond:
          self.items.append(made)
          self.next_round, self.next_position = k + 1, q + 1
          self.producer_idle_s += t1 - t0
          self.producer_busy_s += time.monotonic() - t1
          self._forget()
          self.cond.notify_all()
    except BaseException as e:  # noqa: BLE001 - handed to the trainer, which ends the run with its code
      e = self._died(e)
      with self.cond:
        self.error = e
        self.cond.notify_all()

  def _died(self, e: BaseException) -> BaseException:
    """The `rollout_died` event; the error the trainer raises (a crash names the side that died)."""
    self.events.emit(ev.ROLLOUT_DIED, self.trainer_version, round=self.next_round,
                     version=self._need(self.next_round), error=redact_text(f"{type(e).__name__}: {e}")[:1000])
    if not isinstance(e, (UserError, UserCodeExit)):  # a crash (exit 1): its message says which side died
      died = RuntimeError(f"the rollout producer thread died at round {self.next_round}: {type(e).__name__}: {e}")
      died.__cause__, e = e, died
    return e


def rollout_placement(cfg: Any, program: Any) -> tuple[Any, Callable[[Any], Any]]:
  """(the rollout side's program, params -> the rollout side's copy): with post.rollout_devices, its
  program (rollout.rollout_program) and a device_put onto its parameter sharding; without, the trainer's
  program and a copy (the trainer's state is donated to its next update)."""
  rollout_program = rollout_lib.rollout_program(cfg)
  if rollout_program is None:
    return program, lambda params: jax.tree.map(lambda x: x.copy(), params)
  shardings = rollout_program.state.shardings.params
  dtypes = jax.tree.map(lambda a: a.dtype, rollout_program.state.abstract.params)
  return rollout_program, lambda params: jax.device_put(jax.tree.map(lambda x, d: x.astype(d), params, dtypes),
                                                        shardings)


class AsyncRlStepper(RlStepper):
  """RlStepper's rounds with the rollouts from a `RolloutSide` (module docstring)."""
  reports_mismatch = True

  def __init__(self, cfg: Any, program: Any, observers: Any, metrics: Any, out_dir: Any, starting_state: Any,
               events: Any):
    super().__init__(cfg, program, observers, metrics, out_dir, starting_state)
    self.rollout_program, place = rollout_placement(cfg, program)
    link = None
    if remote_rollout.rollout_processes(cfg):  # the rollout side is processes of their own (across hosts)
      link = remote_rollout.Link(program, self.rollout_program)
      place = link.place
    self._generator = None
    self.side = RolloutSide(self.data, place, self._generator_for, cfg.post, cfg.seed, cfg.data.seq_len, observers, events,
                             startup_s=cfg.watchdog.startup_timeout_s, link=link)
    self._restart, self._round_end = True, None
    self._dropped_total = 0

  def describe(self) -> str:
    where = (f"{self.cfg.post.rollout_devices} rollout devices" if self.cfg.post.rollout_devices
             else "rollouts on the trainer's devices")
    if self.side.link is not None:
      where += f" on processes {remote_rollout.rollout_processes(self.cfg)}"
    return (f"{super().describe()}; async: {where}, max_staleness {self.cfg.post.max_staleness}, correction "
            f"{self.cfg.post.correction}")

  def _generator_for(self, params: Any) -> Any:
    if self._generator is None:  # the rollout side's generator, built on its first batch (its own thread)
      self._generator = sampling_lib.for_program(self.rollout_program, params)
    return self._generator

  def start(self, state: state_lib.TrainState, step: int) -> None:
    self.reference = self._reference(state)
    self._restart = True

  def _rollout(self, state: state_lib.TrainState, step: int) -> tuple[rollout_lib.Rollout, list]:
    if self._restart:  # the attempt's first round, or the first after a rollback: version step - 1
      restored, self.data.restored_in_flight = self.data.restored_in_flight, []
      self.side.restart(state.params, step - 1, step, self.data.step, restored)
      self.data.in_flight, self._restart = self.side, False
    made, self._wait_s = self.side.take(step)
    self.data.step = made.position + 1
    self._made = made
    return made.rollout, [made.rollout]

  def run(self, state: state_lib.TrainState, step: int) -> tuple[state_lib.TrainState, Outcome]:
    t0 = time.monotonic()
    state, outcome = super().run(state, step)
    t1 = time.monotonic()
    publish_s = self.side.publish(state.params, step)
    t2 = time.monotonic()
    round_s = t2 - (self._round_end if self._round_end is not None else t0)
    self._round_end = t2
    idle, busy = self.side.idle_busy()
    busy_s = t1 - t0 - self._wait_s  # the round's work but the wait for its batch (log-probs, updates, scoring)
    outcome.scalars.update({
        "rl/staleness_mean": float(step - 1 - self._made.version), "rl/version": float(self._made.version),
        "rl/dropped_rollouts": float(self.side.dropped), "rl/trainer_idle_s": self._wait_s,
        "rl/trainer_busy": busy_s / max(round_s, 1e-9), "rl/updates_per_s": self.updates_per_step / max(round_s, 1e-9),
        "rl/publish_s": publish_s, "rl/rollout_idle_s": idle, "rl/rollout_busy_s": busy,
        "rl/rollout_s": busy,  # the producer's sampling time, not the trainer's wait
        "rl/rollout_tokens_per_s": completion_tokens([self._made.rollout]) / max(busy, 1e-9)})
    return state, outcome

  def after_rollback(self, step: int, last: bool) -> None:
    self.side.drop_all()  # made by versions the rollback abandoned
    self.data.in_flight, self.data.restored_in_flight = None, []
    self._restart, self._round_end = True, None
