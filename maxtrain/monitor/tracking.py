"""Experiment tracking with MLflow (`tracking.mlflow_uri`; off when empty), written by process 0.

One MLflow run per maxtrain run: its id is kept in the run's output dir, next to the checkpoints
(`mlflow_run.json`), so a preempted or restarted run continues the same MLflow run. Steps the last
attempt already logged past its checkpoint are computed again on resume (bitwise the same: a resumed
run is the run that never stopped), and are not logged twice: each metric keeps only points past the
newest step the store already has for it. The parameters are the redacted config (`config.redacted`),
so no secret reaches the store; events.jsonl and the goodput plot go up as artifacts at exit, the exit
code and attempt count as tags.

MLflow is a side system: it never costs the run (DESIGN.md rule 6). A server is probed once at start
with a short connect timeout (MLflow's own client would retry a refused connection for about 4
minutes); one that cannot be reached, or a store that fails, is a warning and a `side_system_failed`
event, and the run trains without it. Points go to the store from a background thread, so a server
that hangs mid-run never blocks a step. A `mlflow_run.json` that does not parse, or names a run the
store no longer has (deleted), is named in a warning and a new MLflow run starts, linked to the old one
by the tag maxtrain.previous_run (the file's run id) and maxtrain.previous_run_file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import socket
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Mapping

from maxtrain import config as config_lib
from maxtrain.errors import UserError
from maxtrain.monitor import otel

log = logging.getLogger("maxtrain")
RUN_FILE = "mlflow_run.json"
MAX_PARAM = 500  # MLflow caps a param value's length; longer values (data.stages lists) are cut
CONNECT_TIMEOUT_S = 5.0  # the probe of an http(s) tracking server at start
# MLflow's REST client for this process (unless the user set them): a refused or hung request is given
# up after one retry and 10 s, not 7 retries with exponential backoff (about 4 minutes).
HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
            "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
RETRY_S = 30.0  # after a failed send the background thread waits this long before trying again
MAX_BUFFERED = 100_000  # points kept for a server that is down; older ones are dropped (TensorBoard has them)
CLOSE_TIMEOUT_S = 30.0  # at exit, the longest the trainer waits for the last points, artifacts and tags
SIDE_SYSTEM_FAILED = "side_system_failed"  # event: system (mlflow | otel), reason; training goes on without it
TRACKING_NEW_RUN = "tracking_new_run"  # event: a new MLflow run replaced an unusable mlflow_run.json: file, reason


class Unreachable(Exception):
  """The tracking server did not accept a connection within CONNECT_TIMEOUT_S."""


def flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      out.update(flat(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = str(value)[:MAX_PARAM]
  return out


def artifacts(uri: str) -> str | None:
  """A SQLite store's artifacts beside its database (MLflow's default is ./mlartifacts of the cwd)."""
  if uri.startswith("sqlite:///"):
    return (Path(uri[len("sqlite:///"):]).absolute().parent / "mlartifacts").as_uri()
  return None


def probe(uri: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
  """Raises Unreachable when an http(s) URI's host does not accept a TCP connection within `timeout_s`
  (other stores are files or databases their driver opens)."""
  parts = urllib.parse.urlsplit(uri)
  if parts.scheme not in ("http", "https") or not parts.hostname:
    return
  port = parts.port or (443 if parts.scheme == "https" else 80)
  try:
    socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
  except OSError as e:
    raise Unreachable(f"{parts.hostname}:{port} did not accept a connection within {timeout_s:g} s "
                      f"({e.strerror or type(e).__name__})") from None


class MlflowTracker:
  """A MetricWriter sink: `scalars(step, values)`; `close(exit_code)` at the trainer's exit. Opening it
  talks to the store (bounded by the probe and HTTP_ENV); everything after goes through one thread."""

  def __init__(self, uri: str, experiment: str, out_dir: Path, redacted_config: Mapping[str, Any],
               emit: Callable[..., Any] = lambda kind, **fields: None):
    from mlflow.tracking import MlflowClient

    self.client, self.out_dir, self.failures = MlflowClient(tracking_uri=uri), out_dir, 0
    self.uri, self.experiment, self.config = uri, experiment, redacted_config
    record = out_dir / RUN_FILE
    previous, why = self._usable_run(record)
    if previous is not None:
      self.run_id = previous
      self.logged = self._logged_steps()
      attempts = int(self.client.get_run(self.run_id).data.tags.get("maxtrain.attempts", "0")) + 1
    else:
      tags = {"maxtrain.output_dir": str(out_dir)}
      if why is not None:  # the file existed but is unusable: link the new run to what it named
        old_id, reason = why
        tags.update({"maxtrain.previous_run": old_id or "unreadable", "maxtrain.previous_run_file": str(record)})
      self.run_id, self.logged, attempts = self._create_run(tags), {}, 1
      if why is not None:
        log.warning("MLflow: %s %s; started a new MLflow run %s linked to it (tag maxtrain.previous_run)",
                    record, why[1], self.run_id)
        emit(TRACKING_NEW_RUN, file=str(record), reason=why[1], previous_run=why[0], run_id=self.run_id)
      tmp = record.with_suffix(".tmp")
      tmp.write_text(json.dumps({"run_id": self.run_id, "tracking_uri": uri}))
      tmp.replace(record)
    self.client.set_tag(self.run_id, "maxtrain.attempts", str(attempts))
    log.info("MLflow run %s at %s (attempt %d)", self.run_id, uri, attempts)
    self._queue: queue.Queue = queue.Queue()
    self._buffer: list = []  # metric points not yet sent (the thread's own)
    self._thread = threading.Thread(target=self._send_loop, name="maxtrain-mlflow", daemon=True)
    self._thread.start()

  def _usable_run(self, record: Path) -> tuple[str | None, tuple[str | None, str] | None]:
    """(run id to continue, None), or (None, (the file's run id or None, why it is unusable)), or
    (None, None) without a file."""
    if not record.exists():
      return None, None
    try:
      run_id = json.loads(record.read_text())["run_id"]
      if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id {run_id!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
      return None, (None, f"does not hold a run id ({type(e).__name__}: {str(e)[:200]})")
    try:
      stage = self.client.get_run(run_id).info.lifecycle_stage
    except Exception as e:  # noqa: BLE001 - MlflowException; only "no such run" starts a new one
      if getattr(e, "error_code", None) not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
        raise  # a store that fails: tracking is off for this attempt, the next one continues the run
      return None, (run_id, f"names run {run_id}, which the store at this tracking URI does not have "
                            f"(deleted for good, or another store)")
    if stage != "active":
      return None, (run_id, f"names run {run_id}, which was deleted from the store (lifecycle stage {stage})")
    return run_id, None

  def _create_run(self, tags: dict[str, str]) -> str:
    from mlflow.entities import Param

    found = self.client.get_experiment_by_name(self.experiment)
    if found is not None and found.lifecycle_stage != "active":
      raise RuntimeError(f"experiment {self.experiment!r} is deleted in the store: restore it or choose another "
                         "tracking.mlflow_experiment")
    experiment_id = found.experiment_id if found else self.client.create_experiment(self.experiment,
                                                                                      artifacts(self.uri))
    run_id = self.client.create_run(experiment_id, run_name=self.out_dir.name, tags=tags).info.run_id
    params = sorted(flat(self.config).items())
    for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
      self.client.log_batch(run_id, params=[Param(k, v) for k, v in params[start:start + 100]])
    return run_id

  def _logged_steps(self) -> dict[str, int]:
    """The newest step the store holds for each metric of the run."""
    metrics = self.client.get_run(self.run_id).data.metrics
    return {key: max(m.step for m in self.client.get_metric_history(self.run_id, key)) for key in metrics}

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    from mlflow.entities import Metric

    points = []
    for name, value in values.items():
      value = float(value)
      if step > self.logged.get(name, -1) and math.isfinite(value):
        points.append(Metric(name, value, 0, int(step)))
        self.logged[name] = int(step)
    if points:
      self._queue.put(("metrics", points))

  def text(self, tag: str, value: str, step: int = 0) -> None:
    self._queue.put(("tag", (tag[:250], value[:5000])))

  def _send_loop(self) -> None:
    """The one thread that talks to the store after start: metric batches (kept and retried every
    RETRY_S while the store fails), tags, and at close the artifacts and the exit tags."""
    retry_at = 0.0
    while True:
      try:
        kind, payload = self._queue.get(timeout=max(0.0, retry_at - time.monotonic()) if self._buffer else None)
      except queue.Empty:
        kind, payload = "flush", None
      if kind == "metrics":
        self._buffer.extend(payload)
        del self._buffer[:-MAX_BUFFERED]
      elif kind == "tag":
        self._call(lambda: self.client.set_tag(self.run_id, *payload), "setting a tag")
      if kind == "close":
        retry_at = 0.0  # one last try for what is buffered
      if self._buffer and time.monotonic() >= retry_at:
        if self._call(self._send_buffer, f"logging steps up to {self._buffer[-1].step}"):
          retry_at = 0.0
        else:
          retry_at = time.monotonic() + RETRY_S
      if kind == "close":
        self._call(lambda: self._finish(payload), "closing the run")
        return

  def _send_buffer(self) -> None:
    while self._buffer:
      self.client.log_batch(self.run_id, metrics=self._buffer[:1000])  # MLflow's batch limit
      del self._buffer[:1000]

  def _call(self, fn: Callable[[], Any], what: str) -> bool:
    try:
      fn()
      return True
    except Exception as e:  # noqa: BLE001 - a tracking server that is down must not stop training
      self.failures += 1
      if self.failures in (1, 10, 100, 1000):
        log.warning("MLflow: %s failed (%s: %s; %d failures so far); training goes on, TensorBoard has every "
                    "scalar", what, type(e).__name__, str(e)[:300], self.failures)
      return False

  def _finish(self, exit_code: int) -> None:
    for name in ("events.jsonl", "goodput.png"):
      if (self.out_dir / name).is_file():
        self.client.log_artifact(self.run_id, str(self.out_dir / name))
    self.client.set_tag(self.run_id, "maxtrain.exit_code", str(exit_code))
    if exit_code == 0:
      self.client.set_terminated(self.run_id, "FINISHED")

  def close(self, exit_code: int) -> None:
    """Events and the goodput plot as artifacts; the exit as tags. The run ends FINISHED only on exit 0
    (a preempted run stays RUNNING: its next attempt continues it). Waits at most CLOSE_TIMEOUT_S."""
    self._queue.put(("close", exit_code))
    self._thread.join(CLOSE_TIMEOUT_S)
    if self._thread.is_alive():
      log.warning("MLflow: the store did not take the last points within %g s; the trainer exits without them",
                  CLOSE_TIMEOUT_S)


def attach(cfg: Any, out_dir: Path, metrics: Any, stack: Any, exit_code: Any) -> None:
  """The trainer's one call: with `tracking.otel_endpoint` set, every process's gauges also go to OTLP;
  with `tracking.mlflow_uri` set, on process 0, every TensorBoard scalar and text also goes to MLflow,
  and the run is closed at exit (`exit_code()` read then). Either failing is a warning and an event."""
  import jax

  def failed(system: str, reason: str) -> None:
    log.warning("%s is unavailable (%s); training goes on without it", system, reason)
    metrics.events.emit(SIDE_SYSTEM_FAILED, system=system, reason=reason[:1000])

  if cfg.tracking.otel_endpoint:
    endpoint = cfg.tracking.otel_endpoint
    try:
      probe(endpoint)
    except Unreachable as e:  # checked once, at start: the collector is off for this attempt
      failed(f"OpenTelemetry export to {endpoint}", str(e))
    else:
      gauges = otel.otlp_gauges(endpoint, cfg.tracking.otel_interval_s, out_dir.name, jax.process_index(),
                                on_failure=lambda reason: failed("OpenTelemetry export", reason))
      metrics.gauge_sinks.append(gauges)
      stack.callback(gauges.close)
  if not cfg.tracking.mlflow_uri or jax.process_index() != 0:
    return
  uri = cfg.tracking.mlflow_uri
  shown = f"config.tracking.mlflow_uri={config_lib.redact_text(uri)}"
  for key, value in HTTP_ENV.items():
    os.environ.setdefault(key, value)
  try:
    import mlflow  # noqa: F401
  except ImportError:
    raise UserError(f"{shown} is set but mlflow is not installed: pip install 'maxtrain[tracking]'") from None
  try:
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=uri)  # parses the URI: an unsupported scheme is bad input, not an outage
  except Exception as e:  # noqa: BLE001 - MlflowException and the store's own errors
    raise UserError(f"{shown}: not a tracking URI MLflow can open ({type(e).__name__}: "
                    f"{config_lib.redact_text(str(e))[:300]}); use e.g. sqlite:///PATH/mlflow.db or http://HOST:5000, "
                    "or '' to turn tracking off") from None
  try:
    probe(uri)
    tracker = MlflowTracker(uri, cfg.tracking.mlflow_experiment, out_dir, config_lib.redacted(cfg),
                            emit=metrics.events.emit)
  except Exception as e:  # noqa: BLE001 - a store that is down or failing: the run goes on without it
    failed(f"MLflow ({shown})", f"{type(e).__name__}: {config_lib.redact_text(str(e))[:300]}")
    return
  metrics.writer.sinks.append(tracker)
  stack.callback(lambda: tracker.close(exit_code()))
