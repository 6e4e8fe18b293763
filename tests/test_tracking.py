"""Experiment tracking: one MLflow run holds the whole history of a run that crashed, was preempted and
resumed twice (each step's metrics once, the config redacted: a runtime.env secret appears nowhere in
the store); OpenTelemetry gauges keep one fixed label set and report what Prometheus reports."""

import numpy as np
import pytest

pytest.importorskip("mlflow", reason="tracking tests need the test extra: pip install -e '.[test]'")
pytest.importorskip("opentelemetry.sdk", reason="tracking tests need the test extra: pip install -e '.[test]'")

from maxtrain.monitor import events as ev  # noqa: E402
from tiny import TINY_MODEL  # noqa: E402

SECRET = "s3cr3t-9f27c1d0-token-value"


def test_one_mlflow_run_across_crash_preemption_and_resume(store, tmp_path, monkeypatch, capsys):
  from mlflow.tracking import MlflowClient

  from maxtrain.cli import train

  # runtime.env may not change this process's environment once JAX runs: it is set here (and undone after).
  monkeypatch.setenv("MAXTRAIN_TEST_TOKEN", SECRET)
  run, uri = tmp_path / "run", f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"
  (tmp_path / "mlruns").mkdir()
  args = [*TINY_MODEL, f"--config.data.path={store}", "--config.steps=8", f"--config.output_dir={run}",
          "--config.log_every=1", "--config.eval.every_steps=4", "--config.checkpoint.every_steps=2",
          f"--config.tracking.mlflow_uri={uri}", f"--config.runtime.env=MAXTRAIN_TEST_TOKEN={SECRET}",
          "--config.faults.crash_at_step=5", "--config.faults.sigterm_at_step=7"]  # each fires once per run dir
  assert train.main(args) == 1  # a crash after step 5 (checkpoint 4: step 5 runs twice)
  assert "maxtrain: crash: RuntimeError: fault injection: crash" in capsys.readouterr().err
  assert train.main(args) == 75  # preempted at step 7 (checkpoint 7)
  assert train.main(args) == 0
  client = MlflowClient(tracking_uri=uri)
  runs = client.search_runs([client.get_experiment_by_name("maxtrain").experiment_id])
  assert len(runs) == 1
  r = runs[0]
  loss = client.get_metric_history(r.info.run_id, "train/loss")
  assert [m.step for m in loss] == list(range(1, 9))  # step 5 computed twice, logged once
  assert [m.step for m in client.get_metric_history(r.info.run_id, "eval/loss")] == [4, 8]
  assert r.data.params["runtime.env"] == "MAXTRAIN_TEST_TOKEN=<redacted>" and r.data.params["steps"] == "8"
  assert (r.data.tags["maxtrain.attempts"], r.data.tags["maxtrain.exit_code"]) == ("3", "0")
  assert r.info.status == "FINISHED"
  assert "events.jsonl" in [a.path for a in client.list_artifacts(r.info.run_id)]
  # The TensorBoard value of a step equals MLflow's (the same scalars, one sink more).
  tb_loss = {}
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  for path in sorted((run / "tensorboard").glob("events.*")):
    acc = EventAccumulator(str(path))
    acc.Reload()
    if "train/loss" in acc.Tags()["scalars"]:
      tb_loss.update({e.step: e.value for e in acc.Scalars("train/loss")})
  np.testing.assert_allclose([m.value for m in loss], [tb_loss[s] for s in range(1, 9)], rtol=1e-6)
  leaked = [str(p) for p in (tmp_path / "mlruns").rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
  assert not leaked


def test_otel_labels_fixed_and_values_equal_prometheus(tmp_path):
  """A MetricsLogger with Prometheus on and OTel gauges read by the SDK's in-memory reader: after 10 and
  after 200 logged steps the OTel label sets are the same one set, and each gauge equals Prometheus's."""
  import urllib.request

  from opentelemetry.sdk.metrics.export import InMemoryMetricReader

  from maxtrain.monitor import otel
  from maxtrain.monitor.metrics import MetricsLogger

  reader = InMemoryMetricReader()
  with ev.EventLog(tmp_path / ev.FILENAME) as events:
    logger = MetricsLogger(tmp_path / "run", events, total_steps=200, tokens_per_step=256, flops_per_token=1e6,
                           peak_flops=1e12, prometheus_port=_free_port())
    logger.gauge_sinks.append(otel.OtelGauges(reader, "run", 0, host="h0"))
    label_sets = {}
    for step in range(1, 201):
      metrics = {"loss": 5.0 / step, "grad_norm": 1.0 + step, "lr": 1e-3, "per_layer": np.arange(3.0) * step}
      logger.train(step, metrics)
      if step in (10, 200):
        points = _points(reader)
        label_sets[step] = {tuple(sorted(p[1].items())) for p in points.values()}
    assert label_sets[10] == label_sets[200] == {(("host", "h0"), ("process", "0"), ("run", "run"))}
    port = logger.prometheus._httpd.server_address[1]
    prom = _parse(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())
    logger.close()
  otel_values = {name: value for name, (value, _) in _points(reader).items()}
  assert "maxtrain_train_loss" in otel_values and "maxtrain_train_per_layer_layer_2" in otel_values
  assert otel_values["maxtrain_train_loss"] == pytest.approx(5.0 / 200)
  shared = set(otel_values) & set(prom)
  assert shared == set(otel_values)  # every OTel gauge is a Prometheus gauge
  assert {k: otel_values[k] for k in shared} == {k: prom[k] for k in shared}
  with pytest.raises(ValueError):
    otel.labels(run="r", process="0", host="h", step="5")  # no other label, ever


def _free_port() -> int:
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _points(reader) -> dict:
  """{metric name: (value, attributes)} of the last collection (one point per gauge: one label set)."""
  out = {}
  for rm in reader.get_metrics_data().resource_metrics:
    for sm in rm.scope_metrics:
      for metric in sm.metrics:
        points = list(metric.data.data_points)
        assert len(points) == 1, (metric.name, points)
        out[metric.name] = (points[0].value, dict(points[0].attributes))
  return out


def _parse(text: str) -> dict:
  out = {}
  for line in text.splitlines():
    if line and not line.startswith("#"):
      name_labels, value = line.rsplit(" ", 1)
      out[name_labels.split("{")[0]] = float(value)
  return out
