"""OpenTelemetry metrics: the Prometheus endpoint's gauges (same names, same values) through the
OpenTelemetry SDK, exported by OTLP (`tracking.otel_endpoint`) or any SDK metric reader.

The label set is fixed in code: run, process, host, and nothing else, ever: a step, a path or a value
as a label makes a new time series per step, which is what slowed training down elsewhere. `labels`
is the only place attributes are made, and it refuses any other key.
"""

from __future__ import annotations

import logging
import socket
from typing import Any, Callable, Mapping

from maxtrain.monitor import prometheus
from maxtrain.errors import UserError

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


EXPORT_TIMEOUT_S = 5.0  # one OTLP export (the SDK's retries included) gives up after this


class _CountingExporter:
  """Wraps an OTLP exporter: a failed export is a warning (the 1st, 10th, 100th ...) and `on_failure`
  once, never an error that reaches the run."""

  def __init__(self, inner: Any, on_failure: Callable[[str], None] | None):
    self.inner, self.on_failure, self.failures = inner, on_failure, 0
    # The reader asks its exporter for these.
    self._preferred_temporality = inner._preferred_temporality
    self._preferred_aggregation = inner._preferred_aggregation

  def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> Any:
    from opentelemetry.sdk.metrics.export import MetricExportResult

    try:
      result = self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
    except Exception as e:  # noqa: BLE001 - the collector is a side system
      result, reason = MetricExportResult.FAILURE, f"{type(e).__name__}: {e}"
    else:
      reason = "the collector did not accept the export"
    if result != MetricExportResult.SUCCESS:
      self.failures += 1
      if self.failures in (1, 10, 100, 1000):
        log.warning("opentelemetry: export to %s failed (%s; %d failures so far); training goes on",
                    getattr(self.inner, "_endpoint", "?"), reason[:300], self.failures)
      if self.failures == 1 and self.on_failure is not None:
        try:
          self.on_failure(f"OTLP export failed: {reason[:300]}")
        except Exception as e:  # noqa: BLE001 - e.g. the event log closed before the exit's last export
          log.warning("opentelemetry: could not record the failure (%s)", e)
    return result

  def force_flush(self, *args: Any, **kwargs: Any) -> bool:
    return self.inner.force_flush(*args, **kwargs)

  def shutdown(self, *args: Any, **kwargs: Any) -> None:
    self.inner.shutdown(*args, **kwargs)


def otlp_gauges(endpoint: str, interval_s: float, run: str, process_index: int,
                on_failure: Callable[[str], None] | None = None) -> OtelGauges:
  """Gauges exported to an OTLP/HTTP endpoint every `interval_s` (the `otel` extra); a failed export is
  a warning and `on_failure(reason)` once (the trainer probes the endpoint first: tracking.attach)."""
  from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

  try:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
  except ImportError:
    raise UserError(f"config.tracking.otel_endpoint={endpoint}: the OTLP exporter is not installed; "
                    "pip install 'maxtrain[otel]' (opentelemetry-exporter-otlp-proto-http)") from None
  scheme = endpoint.split("://", 1)[0] if "://" in endpoint else ""
  if scheme not in ("http", "https"):
    raise UserError(f"config.tracking.otel_endpoint={endpoint}: not an OTLP/HTTP URL; use "
                    "http://HOST:4318/v1/metrics (or '' to turn it off)")
  exporter = _CountingExporter(OTLPMetricExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S), on_failure)
  reader = PeriodicExportingMetricReader(exporter, export_interval_millis=interval_s * 1e3,
                                         export_timeout_millis=EXPORT_TIMEOUT_S * 1e3)
  return OtelGauges(reader, run, process_index)
