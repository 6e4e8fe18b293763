"""OpenTelemetry metrics: the Prometheus endpoint's gauges (same names, same values) through the
OpenTelemetry SDK, exported by OTLP (`tracking.otel_endpoint`) or any SDK metric reader.

The label set is fixed in code: run, process, host, and nothing else, ever: a step, a path or a value
as a label makes a new time series per step, which is what slowed training down elsewhere. `labels`
is the only place attributes are made, and it refuses any other key.
"""

from __future__ import annotations

import logging
import socket
from typing import Any, Mapping

from maxtrain.monitor import prometheus

log = logging.getLogger("maxtrain")
LABELS = ("run", "process", "host")  # the whole label set
MAX_SERIES = 1000  # as Prometheus: metric names beyond this are dropped, not exported


def labels(**values: str) -> dict[str, str]:
  """The attributes of every point: exactly LABELS, as strings."""
  if tuple(sorted(values)) != tuple(sorted(LABELS)):
    raise ValueError(f"OpenTelemetry labels must be exactly {LABELS}, got {sorted(values)}")
  return {key: str(values[key]) for key in LABELS}


class OtelGauges:
  """`update(scalars)` sets one gauge per metric (the Prometheus name) with the fixed labels."""

  def __init__(self, reader: Any, run: str, process_index: int, host: str | None = None):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource

    self.attributes = labels(run=run, process=str(process_index), host=host or socket.gethostname())
    self.provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"service.name": "maxtrain"}))
    self.meter = self.provider.get_meter("maxtrain")
    self._gauges: dict[str, Any] = {}
    self._dropped: set[str] = set()

  def update(self, values: Mapping[str, float]) -> None:
    for name, value in values.items():
      key = prometheus.metric_name(name)
      if key not in self._gauges:
        if len(self._gauges) >= MAX_SERIES:
          if key not in self._dropped:
            self._dropped.add(key)
            log.warning("opentelemetry: more than %d metrics; %s not exported", MAX_SERIES, key)
          continue
        self._gauges[key] = self.meter.create_gauge(key)
      self._gauges[key].set(float(value), attributes=self.attributes)

  def close(self) -> None:
    self.provider.shutdown()


def otlp_gauges(endpoint: str, interval_s: float, run: str, process_index: int) -> OtelGauges:
  """Gauges exported to an OTLP/HTTP endpoint every `interval_s` (the `otel` extra)."""
  from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

  from maxtrain.errors import UserError

  try:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
  except ImportError:
    raise UserError(f"config.tracking.otel_endpoint={endpoint}: the OTLP exporter is not installed; "
                    "pip install 'maxtrain[otel]' (opentelemetry-exporter-otlp-proto-http)") from None
  reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint), export_interval_millis=interval_s * 1e3)
  return OtelGauges(reader, run, process_index)
