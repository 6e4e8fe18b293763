"""Experiment tracking with MLflow (`tracking.mlflow_uri`; off when empty), written by process 0.

One MLflow run per maxtrain run: its id is kept in the run's output dir, next to the checkpoints
(`mlflow_run.json`), so a preempted or restarted run continues the same MLflow run. Steps the last
attempt already logged past its checkpoint are computed again on resume (bitwise the same: a resumed
run is the run that never stopped), and are not logged twice: each metric keeps only points past the
newest step the store already has for it. The parameters are the redacted config (`config.redacted`),
so no secret reaches the store; events.jsonl and the goodput plot go up as artifacts at exit, the exit
code and attempt count as tags.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Mapping

log = logging.getLogger("maxtrain")
RUN_FILE = "mlflow_run.json"
MAX_PARAM = 500  # MLflow caps a param value's length; longer values (data.stages lists) are cut


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


class MlflowTracker:
  """A MetricWriter sink: `scalars(step, values)`; `close(exit_code)` at the trainer's exit."""

  def __init__(self, uri: str, experiment: str, out_dir: Path, redacted_config: Mapping[str, Any]):
    from mlflow.tracking import MlflowClient

    self.client, self.out_dir, self.failures = MlflowClient(tracking_uri=uri), out_dir, 0
    record = out_dir / RUN_FILE
    if record.exists():
      self.run_id = json.loads(record.read_text())["run_id"]
      self.logged = self._logged_steps()
      attempts = int(self.client.get_run(self.run_id).data.tags.get("maxtrain.attempts", "0")) + 1
    else:
      found = self.client.get_experiment_by_name(experiment)
      experiment_id = found.experiment_id if found else self.client.create_experiment(experiment, artifacts(uri))
      run = self.client.create_run(experiment_id, run_name=out_dir.name, tags={"maxtrain.output_dir": str(out_dir)})
      self.run_id, self.logged, attempts = run.info.run_id, {}, 1
      params = sorted(flat(redacted_config).items())
      for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
        from mlflow.entities import Param

        self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in params[start:start + 100]])
      tmp = record.with_suffix(".tmp")
      tmp.write_text(json.dumps({"run_id": self.run_id, "tracking_uri": uri}))
      tmp.replace(record)
    self.client.set_tag(self.run_id, "maxtrain.attempts", str(attempts))
    log.info("MLflow run %s at %s (attempt %d)", self.run_id, uri, attempts)

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
    try:
      for start in range(0, len(points), 1000):  # MLflow's batch limit
        self.client.log_batch(self.run_id, metrics=points[start:start + 1000])
    except Exception as e:  # a tracking server that is down must not stop training; TensorBoard has it all
      self.failures += 1
      if self.failures in (1, 10, 100, 1000):
        log.warning("MLflow: logging step %d failed (%s: %s; %d failures so far); training goes on", step,
                    type(e).__name__, e, self.failures)

  def text(self, tag: str, value: str, step: int = 0) -> None:
    self.client.set_tag(self.run_id, tag[:250], value[:5000])

  def close(self, exit_code: int) -> None:
    """Events and the goodput plot as artifacts; the exit as tags. The run ends FINISHED only on exit 0
    (a preempted run stays RUNNING: its next attempt continues it)."""
    for name in ("events.jsonl", "goodput.png"):
      if (self.out_dir / name).is_file():
        self.client.log_artifact(self.run_id, str(self.out_dir / name))
    self.client.set_tag(self.run_id, "maxtrain.exit_code", str(exit_code))
    if exit_code == 0:
      self.client.set_terminated(self.run_id, "FINISHED")


def attach(cfg: Any, out_dir: Path, metrics: Any, stack: Any, exit_code: Any) -> None:
  """The trainer's one call: with `tracking.otel_endpoint` set, every process's gauges also go to OTLP;
  with `tracking.mlflow_uri` set, on process 0, every TensorBoard scalar and text also goes to MLflow,
  and the run is closed at exit (`exit_code()` read then)."""
  import jax

  from maxtrain import config as config_lib

  if cfg.tracking.otel_endpoint:
    from maxtrain.monitor import otel

    gauges = otel.otlp_gauges(cfg.tracking.otel_endpoint, cfg.tracking.otel_interval_s, out_dir.name,
                              jax.process_index())
    metrics.gauge_sinks.append(gauges)
    stack.callback(gauges.close)
  if not cfg.tracking.mlflow_uri or jax.process_index() != 0:
    return
  from maxtrain.errors import UserError

  try:
    tracker = MlflowTracker(cfg.tracking.mlflow_uri, cfg.tracking.mlflow_experiment, out_dir, config_lib.redacted(cfg))
  except ImportError:
    raise UserError("config.tracking.mlflow_uri is set but mlflow is not installed: pip install 'maxtrain[tracking]'"
                    ) from None
  except Exception as e:  # MlflowException and the store's own errors: a bad URI or an unreachable server
    raise UserError(f"config.tracking.mlflow_uri={config_lib.redact_text(cfg.tracking.mlflow_uri)}: cannot open the "
                    f"MLflow run ({type(e).__name__}: {config_lib.redact_text(str(e))[:300]}); use e.g. "
                    "sqlite:///PATH/mlflow.db or http://HOST:5000, or '' to turn tracking off") from None
  metrics.writer.sinks.append(tracker)
  stack.callback(lambda: tracker.close(exit_code()))
