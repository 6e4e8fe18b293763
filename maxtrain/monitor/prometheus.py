"""Optional Prometheus endpoint: the latest training scalars as gauges at http://HOST:PORT/metrics.

Off by default (`monitor.prometheus_port` = 0); binds `monitor.prometheus_host` (default 127.0.0.1:
this host only; scraping from elsewhere needs it set, e.g. to 0.0.0.0). Stdlib only: a `ThreadingHTTPServer` on a daemon
thread, so a slow scraper never blocks the loop. The label set is fixed when the server starts (run
name and process index) and the number of series is capped, so nothing that grows with steps or
hosts beyond the run's own ever becomes a label or a new series.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Mapping

from maxtrain.errors import UserError
from maxtrain.config import redact_text  # a label is public: no credential in it, whatever the run's name

log = logging.getLogger("maxtrain")

PREFIX = "maxtrain_"
MAX_SERIES = 256  # Metric names accepted; the step returns a fixed set, so this is only a guard.


def metric_name(name: str) -> str:
  """'train/loss' -> 'maxtrain_train_loss' (Prometheus names: [a-zA-Z_:][a-zA-Z0-9_:]*)."""
  return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", name).strip("_")


def _label_value(value: str) -> str:
  return redact_text(str(value)).replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def _number(value: float) -> str:
  if math.isnan(value):
    return "NaN"
  if math.isinf(value):
    return "+Inf" if value > 0 else "-Inf"
  return repr(float(value))


class MetricsServer:
  """Serves the latest value of each scalar passed to `update`; `close` stops it."""

  def __init__(self, port: int, labels: Mapping[str, str] | None = None, host: str = "127.0.0.1",
               max_series: int = MAX_SERIES):
    self._labels = ",".join(f'{k}="{_label_value(v)}"' for k, v in sorted((labels or {}).items()))
    self._values: dict[str, float] = {}
    self._lock = threading.Lock()
    self._max_series = max_series
    self._dropped: set[str] = set()
    server = self

    class Handler(BaseHTTPRequestHandler):
      def do_GET(self):  # noqa: N802 (http.server's naming)
        if self.path.split("?")[0] != "/metrics":
          self.send_error(404, "only /metrics is served")
          return
        body = server.render().encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

      def log_message(self, *args):  # Scrapes every few seconds must not flood the training log.
        pass

    self._httpd = ThreadingHTTPServer((host, port), Handler)
    self._httpd.daemon_threads = True
    self.port = self._httpd.server_address[1]  # The bound port (port=0 picks a free one).
    self._thread = threading.Thread(target=self._httpd.serve_forever, name="prometheus", daemon=True)
    self._thread.start()
    log.info("prometheus: serving /metrics on %s:%d", host, self.port)

  def update(self, values: Mapping[str, float]) -> None:
    """Sets gauges from scalars such as the TensorBoard dict ('train/loss' -> maxtrain_train_loss)."""
    with self._lock:
      for name, value in values.items():
        key = metric_name(name)
        if key not in self._values and len(self._values) >= self._max_series:
          if key not in self._dropped:
            self._dropped.add(key)
            log.warning("prometheus: more than %d metrics; %s not exported", self._max_series, key)
          continue
        self._values[key] = float(value)
      self._values[PREFIX + "last_update_seconds"] = time.time()  # Alert on a stale value: a hung run.

  def render(self) -> str:
    """The exposition text (format 0.0.4)."""
    labels = "{" + self._labels + "}" if self._labels else ""
    with self._lock:
      items = sorted(self._values.items())
    return "".join(f"# TYPE {key} gauge\n{key}{labels} {_number(value)}\n" for key, value in items)

  def close(self) -> None:
    self._httpd.shutdown()
    self._httpd.server_close()
    self._thread.join()


def start(port: int, run: str, process_index: int, host: str = "127.0.0.1") -> MetricsServer | None:
  """The trainer's entry: None when `port` is 0 (off); else a server labelled {run, process}, bound
  now (before compiling), so that a busy port is a UserError (exit 2) rather than a late crash."""
  if port <= 0:
    return None
  try:
    return MetricsServer(port, {"run": run, "process": str(process_index)}, host=host)
  except OSError as e:
    raise UserError(f"config.monitor.prometheus_port={port}: cannot serve on {host}:{port} ({e.strerror or e}); "
                    "choose a free port (or 0 to turn the endpoint off), or fix config.monitor.prometheus_host"
                    ) from None
