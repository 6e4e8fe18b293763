"""Prometheus /metrics endpoint against localhost."""

import urllib.error
import urllib.request

import pytest

from maxtrain.monitor import prometheus


def scrape(port: int, path: str = "/metrics") -> dict[str, str]:
  with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    lines = response.read().decode().splitlines()
  return dict(line.rsplit(" ", 1) for line in lines if not line.startswith("#"))


def test_metrics_endpoint_serves_latest_values_with_fixed_labels():
  assert prometheus.start(0, "run", 0) is None  # port 0 in the config = off
  server = prometheus.MetricsServer(0, {"run": 'my "run"', "process": "0"}, host="127.0.0.1", max_series=4)
  try:
    server.update({"train/loss": 2.5, "train/grad_norm": float("nan")})
    server.update({"train/loss": 2.25})
    series = scrape(server.port)
    labels = '{process="0",run="my \\"run\\""}'
    assert series[f"maxtrain_train_loss{labels}"] == "2.25"
    assert series[f"maxtrain_train_grad_norm{labels}"] == "NaN"
    assert float(series[f"maxtrain_last_update_seconds{labels}"]) > 0
    # The cap on series: names past it are dropped, never added.
    server.update({f"train/extra_{i}": 1.0 for i in range(5)})
    assert len(scrape(server.port)) == 4
    with pytest.raises(urllib.error.HTTPError, match="404"):
      scrape(server.port, "/other")
  finally:
    server.close()
  with pytest.raises(urllib.error.URLError):
    scrape(server.port)
