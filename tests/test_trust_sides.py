"""Trust, third round (issue 37), the config and the side systems: numeric ranges and strict config
files, the evaluation CLI's arguments and tasks, the sidecar's record of every checkpoint it started,
MLflow and OTLP failing to a warning, and the quiet CPU peak behind MFU.

Each case goes through the real entry point and asserts the exit code, that no traceback was printed,
that the message names the culprit, and what is left on disk.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from maxtrain.cli import train
from maxtrain.config import base_config, ranges
from maxtrain.errors import EXIT_BAD_INPUT
from test_trust_inputs import assert_exit, base, run_train  # the trust tests' shared helpers



# ---- numeric ranges and strict config files (cases 6, 11, 12) ---------------------------------

def test_every_numeric_key_has_a_range():
  """The table covers every declared number, and each default lies inside its own range."""
  cfg = base_config()
  numeric = ranges.numeric_keys(cfg)
  assert sorted(set(numeric) - set(ranges.RANGES)) == []
  assert sorted(set(ranges.RANGES) - set(numeric)) == []  # no stale entries
  ranges.check(cfg)


@pytest.mark.parametrize("overrides,names", [
    (["--config.model.quantization=fp8", "--config.model.quant_margin=100"], ["config.model.quant_margin=100", "[-1, 4]"]),
    (["--config.model.quantization=fp8", "--config.model.quant_margin=-3"], ["config.model.quant_margin=-3"]),
    (["--config.tracking.otel_interval_s=nan"], ["config.tracking.otel_interval_s=nan", "finite"]),
    (["--config.watchdog.timeout_s=-5"], ["config.watchdog.timeout_s=-5.0", "0 = off"]),
    (["--config.fleet.exchange_timeout_s=0"], ["config.fleet.exchange_timeout_s=0.0"]),
    (["--config.checkpoint.s3_connect_timeout_s=inf"], ["config.checkpoint.s3_connect_timeout_s=inf"]),
    (["--config.model.moe.aux_loss_weight=-0.1"], ["config.model.moe.aux_loss_weight=-0.1", ">= 0"]),
    (["--config.post.kl_coef=-2"], ["config.post.kl_coef=-2.0"]),  # -1 = the algorithm's default
    (["--config.mesh.tensor=0"], ["config.mesh.tensor=0", "-1 or an integer >= 1"]),
])
def test_numeric_key_out_of_range_exit_2_before_anything(store, tmp_path, capsys, overrides, names):
  out = tmp_path / "run"
  code, output = run_train(base(store, out) + overrides, capsys)
  assert_exit(code, output, EXIT_BAD_INPUT, *names, "out of range")
  assert not out.exists()  # refused at load: no output dir, nothing compiled


@pytest.mark.parametrize("body,names", [
    ("import ml_collections\ndef get_config():\n  c = ml_collections.ConfigDict()\n  c.steps = 3\n  return c\n",
     ["get_config() returned a config without", "declared keys (in ", "hardware", "model", "base_config()"]),
    ("from maxtrain.config import base_config\ndef get_config():\n  c = base_config()\n  c.model.not_a_key = 3\n"
     "  return c\n", ["unknown config key config.model.not_a_key"]),
    ("from maxtrain.config import base_config\ndef get_config():\n  c = base_config()\n  c.optimizer.lr_peak = 1e-3\n"
     "  return c\n", ["unknown config key config.optimizer.lr_peak", "Did you mean config.optimizer.lr"]),
    ("from maxtrain.config import base_config\ndef get_config():\n  c = base_config()\n  c.model.quant_margin = 100\n"
     "  return c\n", ["config.model.quant_margin=100"]),
])
def test_config_file_is_as_strict_as_the_command_line(tmp_path, capsys, body, names):
  path = tmp_path / "cfg.py"
  path.write_text(body)
  out = tmp_path / "run"
  code, output = run_train([f"--config={path}", f"--config.output_dir={out}"], capsys)
  assert_exit(code, output, EXIT_BAD_INPUT, *names, "maxtrain: error:")
  assert len(output.strip().splitlines()) == 1 and not out.exists()


# ---- maxtrain.eval arguments and tasks (case 13) ------------------------------------------------

def run_eval(args, capsys):
  from maxtrain.cli import eval as eval_cli

  code = eval_cli.main(args)
  captured = capsys.readouterr()
  return code, captured.out + captured.err


@pytest.mark.parametrize("value", ["nan", "-1", "0", "inf"])
def test_eval_poll_seconds_out_of_range_exit_2(tmp_path, capsys, value):
  pytest.importorskip("lm_eval")
  code, output = run_eval(["--watch", str(tmp_path), "--tasks", "pycode_mc", "--poll-seconds", value], capsys)
  assert_exit(code, output, EXIT_BAD_INPUT, f"--poll-seconds={float(value)}", "(0, 3600]")
  assert list(tmp_path.iterdir()) == []  # no eval/ folder, no lock file


@pytest.mark.parametrize("case", ["folder/", "existing folder", "under a file"])
def test_eval_output_that_cannot_be_a_file_exit_2_before_evaluating(tmp_path, capsys, case):
  """Refused before the checkpoint is even opened (it does not exist here): no temp file, nothing new."""
  pytest.importorskip("lm_eval")
  (tmp_path / "dir").mkdir()
  (tmp_path / "file").write_text("x")
  output = {"folder/": f"{tmp_path / 'new'}/", "existing folder": str(tmp_path / "dir"),
            "under a file": str(tmp_path / "file" / "r.json")}[case]
  before = sorted(tmp_path.rglob("*"))
  code, out = run_eval(["--checkpoint", str(tmp_path / "no-such-ckpt"), "--tasks", "pycode_mc", "--output", output],
                       capsys)
  assert_exit(code, out, EXIT_BAD_INPUT, f"--output={output}", "a folder" if case != "under a file" else "is a file")
  assert sorted(tmp_path.rglob("*")) == before


def test_eval_include_path_task_with_a_missing_data_file_exit_2(tmp_path, capsys, monkeypatch):
  pytest.importorskip("lm_eval")
  tasks = tmp_path / "tasks"
  tasks.mkdir()
  (tasks / "mine.yaml").write_text("task: my_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                   "    test: data/missing.jsonl\noutput_type: loglikelihood_rolling\n"
                                   "test_split: test\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                                   "metric_list:\n  - metric: word_perplexity\n")
  monkeypatch.chdir(tmp_path)
  code, output = run_eval(["--checkpoint", str(tmp_path / "no-such-ckpt"), "--tasks", "my_task", "--include-path",
                           str(tasks)], capsys)
  assert_exit(code, output, EXIT_BAD_INPUT, "'my_task'", str(tasks / "mine.yaml"), "data/missing.jsonl",
              str(tmp_path))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["tasks"]


# ---- the evaluation sidecar records every step it started (case 7) -------------------------------

def _killed_sidecar_run(tmp_path, finished: bool) -> Path:
  """A run as a SIGKILLed sidecar leaves it (tests/test_eval_watch.py shows the kill leaves exactly a
  `checkpoint_eval_start` for the step): step 5 started, never finished; step 7 a corrupt checkpoint."""
  from maxtrain.evaluation import watch
  from maxtrain.monitor import events as ev

  run = tmp_path / "run"
  (run / "checkpoints" / "7" / "state").mkdir(parents=True)
  (run / "checkpoints" / "7" / "maxtrain_manifest.json").write_text("{not json")
  (run / "eval").mkdir()
  with ev.EventLog(run / "eval" / ev.FILENAME) as log:
    log.emit(watch.EVAL_START, 5, tasks=["pycode_mc"])
  with ev.EventLog(run / ev.FILENAME) as log:
    log.emit(ev.JOB_START, hosts=1)
    if finished:
      log.emit(ev.EXIT, 7, code=0)
  return run


def test_sidecar_restarted_after_its_step_was_rotated_away_records_it_skipped(tmp_path, capsys):
  pytest.importorskip("lm_eval")
  from maxtrain.evaluation import watch
  from maxtrain.monitor import events as ev

  run = _killed_sidecar_run(tmp_path, finished=True)  # checkpoint 5 is gone: the trainer rotated it away
  code, output = run_eval(["--watch", str(run), "--tasks", "pycode_mc", "--poll-seconds", "0.05"], capsys)
  assert code == 0 and "Traceback" not in output, output[-3000:]
  records = [(r["kind"], r["step"]) for r in ev.read_events(run / "eval" / ev.FILENAME)]
  assert records == [(watch.EVAL_START, 5), (watch.EVAL_SKIPPED, 5), (watch.EVAL_START, 7), (watch.EVAL_SKIPPED, 7)]
  reasons = {r["step"]: r["reason"] for r in ev.read_events(run / "eval" / ev.FILENAME) if "reason" in r}
  assert "rotated it away" in reasons[5] and "mid-evaluation" in reasons[5]
  assert "CorruptCheckpoint" in reasons[7]
  assert not list((run / "eval").glob("[0-9]*"))  # no results for either


def test_sidecar_records_a_started_step_rotated_away_while_it_runs(tmp_path):
  pytest.importorskip("lm_eval")
  import shutil

  from maxtrain.evaluation import run as run_lib
  from maxtrain.evaluation import watch
  from maxtrain.monitor import events as ev

  run = _killed_sidecar_run(tmp_path, finished=False)
  (run / "checkpoints" / "5").mkdir()  # still there when the sidecar restarts (no manifest: not pending now)
  sidecar = watch.Sidecar(run, ["pycode_mc"], run_lib.task_manager(), [], 2)
  assert sidecar.unfinished == {5}
  shutil.rmtree(run / "checkpoints" / "5")  # the trainer rotates it away
  sidecar.close_vanished()
  sidecar.close_vanished()  # recorded once
  records = [(r["kind"], r["step"]) for r in ev.read_events(run / "eval" / ev.FILENAME)]
  assert records == [(watch.EVAL_START, 5), (watch.EVAL_SKIPPED, 5)]
  sidecar.events.close()


# ---- side systems never cost the run: MLflow and OTLP (case 8) -----------------------------------

class OtlpReceiver:
  """A local OTLP/HTTP metrics receiver: decodes each ExportMetricsServiceRequest (protobuf) into
  {metric name: (value, attributes)} of its gauge points, newest export last."""

  def __init__(self, status: int = 200):
    import http.server
    import threading

    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2

    self.exports: list[dict] = []
    receiver = self

    class Handler(http.server.BaseHTTPRequestHandler):
      def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = metrics_service_pb2.ExportMetricsServiceRequest()
        request.ParseFromString(body)
        points = {}
        for rm in request.resource_metrics:
          for sm in rm.scope_metrics:
            for metric in sm.metrics:
              for p in metric.gauge.data_points:
                points[metric.name] = (p.as_double, {a.key: a.value.string_value for a in p.attributes})
        receiver.exports.append(points)
        reply = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
        self.send_response(status)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

      def log_message(self, *args):
        pass

    self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/metrics"
    threading.Thread(target=self.server.serve_forever, daemon=True).start()

  def close(self):
    self.server.shutdown()
    self.server.server_close()


def _free_port() -> int:
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_otlp_export_over_http_carries_the_fixed_labels_and_prometheus_values(tmp_path):
  """The real exporter (OTLP/HTTP, protobuf) to a local receiver: every exported point has exactly the
  labels run, process, host, and each value equals what Prometheus serves for the same gauge."""
  pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
  import urllib.request

  import numpy as np

  from maxtrain.monitor import events as ev
  from maxtrain.monitor import otel
  from maxtrain.monitor.metrics import MetricsLogger

  receiver = OtlpReceiver()
  try:
    with ev.EventLog(tmp_path / ev.FILENAME) as events:
      logger = MetricsLogger(tmp_path / "run", events, total_steps=30, tokens_per_step=256, flops_per_token=1e6,
                             peak_flops=1e12, prometheus_port=_free_port())
      gauges = otel.otlp_gauges(receiver.url, 3600.0, "myrun", 0)  # exported at close only: one known export
      logger.gauge_sinks.append(gauges)
      for step in range(1, 31):
        logger.train(step, {"loss": 5.0 / step, "grad_norm": 1.0 + step, "lr": 1e-3, "per_layer": np.arange(3.0) * step})
      port = logger.prometheus._httpd.server_address[1]
      prom = {}
      for line in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode().splitlines():
        if line and not line.startswith("#"):
          name_labels, value = line.rsplit(" ", 1)
          prom[name_labels.split("{")[0]] = float(value)
      gauges.close()  # the final export
      logger.close()
  finally:
    receiver.close()
  assert len(receiver.exports) == 1
  points = receiver.exports[0]
  assert "maxtrain_train_loss" in points and "maxtrain_train_per_layer_layer_2" in points
  import socket

  assert {tuple(sorted(a.items())) for _, a in points.values()} == {
      (("host", socket.gethostname()), ("process", "0"), ("run", "myrun"))}
  assert set(points) <= set(prom)
  assert {k: v for k, (v, _) in points.items()} == {k: prom[k] for k in points}
  assert points["maxtrain_train_loss"][0] == pytest.approx(5.0 / 30)


def test_otlp_collector_that_refuses_exports_costs_a_warning(tmp_path, caplog):
  """A collector that answers 400 to every export: the gauges keep working, the failure is one warning
  and one on_failure call (the trainer's event), and closing does not raise."""
  pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
  from maxtrain.monitor import otel

  receiver, failures = OtlpReceiver(status=400), []
  try:
    gauges = otel.otlp_gauges(receiver.url, 3600.0, "r", 0, on_failure=failures.append)
    with caplog.at_level("WARNING", logger="maxtrain"):
      for step in range(3):
        gauges.update({"train/loss": 1.0 / (step + 1)})
        gauges.provider.force_flush()
      gauges.close()
  finally:
    receiver.close()
  assert len(receiver.exports) >= 3 and len(failures) == 1 and "OTLP export failed" in failures[0]
  assert caplog.text.count("opentelemetry: export to") == 1 and "training goes on" in caplog.text


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory) -> str:
  """One SQLite MLflow store for the module's tests (creating its tables costs seconds)."""
  pytest.importorskip("mlflow")
  return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def _events(run: Path, kind: str) -> list[dict]:
  from maxtrain.monitor import events as ev

  return [r for r in ev.read_events(run / ev.FILENAME) if r["kind"] == kind]


def test_broken_or_stale_mlflow_run_file_starts_a_linked_run_and_resumes(store, mlflow_uri, tmp_path, capsys, caplog,
                                                                         request):
  """A garbage mlflow_run.json, then one naming a run deleted from the store: each resume exits 0 (not
  2: a supervisor would never restart it), names the file, and continues in a new MLflow run whose tags
  link it to the old one; the checkpoint resume itself is untouched (the new run logs only new steps).
  The trainers also export to a local OTLP receiver: the fixed labels, and the last export's loss equal
  to the one MLflow got."""
  pytest.importorskip("mlflow")
  pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
  from mlflow.tracking import MlflowClient

  from maxtrain.monitor import tracking

  run, uri = tmp_path / "run", mlflow_uri
  receiver = OtlpReceiver()
  request.addfinalizer(receiver.close)
  args = base(store, run) + [f"--config.tracking.mlflow_uri={uri}", "--config.log_every=1",
                             "--config.checkpoint.every_steps=1", f"--config.tracking.otel_endpoint={receiver.url}"]
  record = run / tracking.RUN_FILE
  client = MlflowClient(tracking_uri=uri)
  code, output = run_train(args, capsys)
  assert code == 0, output[-3000:]
  first = json.loads(record.read_text())["run_id"]
  record.write_text("garbage{")
  with caplog.at_level("WARNING", logger="maxtrain"):
    code, output = run_train(args + ["--config.steps=3"], capsys)
  assert_exit(code, output + caplog.text, 0, str(record), "does not hold a run id", "linked to it")
  second = json.loads(record.read_text())["run_id"]
  tags = client.get_run(second).data.tags
  assert second != first and tags["maxtrain.previous_run"] == "unreadable"
  assert tags["maxtrain.previous_run_file"] == str(record)
  assert [m.step for m in client.get_metric_history(second, "train/loss")] == [3]  # resumed from step 2
  client.delete_run(second)  # someone cleans the store up
  caplog.clear()
  with caplog.at_level("WARNING", logger="maxtrain"):
    code, output = run_train(args + ["--config.steps=4"], capsys)
  assert_exit(code, output + caplog.text, 0, str(record), f"names run {second}, which was deleted")
  third = json.loads(record.read_text())["run_id"]
  assert client.get_run(third).data.tags["maxtrain.previous_run"] == second
  assert [m.step for m in client.get_metric_history(third, "train/loss")] == [4]
  new_runs = _events(run, tracking.TRACKING_NEW_RUN)
  assert [(r["previous_run"], r["run_id"]) for r in new_runs] == [(None, second), (second, third)]
  assert client.get_run(third).info.status == "FINISHED"
  import socket

  assert len(receiver.exports) >= 3  # at least each trainer's last export, at its exit
  assert {tuple(sorted(a.items())) for export in receiver.exports for _, a in export.values()} == {
      (("host", socket.gethostname()), ("process", "0"), ("run", "run"))}
  last_loss = receiver.exports[-1]["maxtrain_train_loss"][0]
  assert last_loss == client.get_metric_history(third, "train/loss")[-1].value  # the step-4 loss, both ways


def test_mlflow_run_file_naming_a_run_the_store_never_had_starts_a_linked_run(mlflow_uri, tmp_path):
  """A run id the store does not have (purged, or the file came from another store): a new run, linked."""
  pytest.importorskip("mlflow")
  from maxtrain.monitor import events as ev
  from maxtrain.monitor import tracking

  out = tmp_path / "run"
  out.mkdir()
  (out / tracking.RUN_FILE).write_text(json.dumps({"run_id": "0123456789abcdef0123456789abcdef"}))
  with ev.EventLog(out / ev.FILENAME) as events:
    tracker = tracking.MlflowTracker(mlflow_uri, "maxtrain", out, {"steps": 2}, emit=events.emit)
    tracker.close(0)
  run = tracker.client.get_run(tracker.run_id)
  assert run.data.tags["maxtrain.previous_run"] == "0123456789abcdef0123456789abcdef"
  assert json.loads((out / tracking.RUN_FILE).read_text())["run_id"] == tracker.run_id
  assert "does not have" in _events(out, tracking.TRACKING_NEW_RUN)[0]["reason"]
  assert run.info.status == "FINISHED"


def test_unreachable_mlflow_and_otlp_cost_a_warning_not_the_run(store, tmp_path, capsys, caplog):
  """Refused connections for both (nothing listens on the port): exit 0 in seconds (MLflow's own
  client retried a refused connection for about 4 minutes), a warning and a side_system_failed event
  each, and the run's own outputs as without them."""
  pytest.importorskip("mlflow")
  pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
  from maxtrain.monitor import tracking

  run, port = tmp_path / "run", _free_port()  # bound and released: refused
  t0 = time.monotonic()
  with caplog.at_level("WARNING", logger="maxtrain"):
    code, output = run_train(base(store, run) + [f"--config.tracking.mlflow_uri=http://127.0.0.1:{port}",
                                                 f"--config.tracking.otel_endpoint=http://127.0.0.1:{port}/v1/metrics"],
                             capsys)
  seconds = time.monotonic() - t0
  assert_exit(code, output + caplog.text, 0, f"127.0.0.1:{port} did not accept a connection", "training goes on")
  failed = _events(run, tracking.SIDE_SYSTEM_FAILED)
  assert sorted(r["system"].split(" ")[0] for r in failed) == ["MLflow", "OpenTelemetry"]
  assert not (run / tracking.RUN_FILE).exists() and (run / "checkpoints" / "2").is_dir()
  assert seconds < 120, seconds  # a trainer start; the side systems add under a second each
