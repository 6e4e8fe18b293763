"""The goodput report as a picture: `python tools/goodput_report.py OUTPUT_DIR --plot goodput.png`.

One horizontal bar per row of `goodput.timeline` (the job, then each process when there are
several), coloured by category over wall time; every elementary interval is split by its category
shares, so each colour's total length is the report's seconds for it. Restarts are dashed lines;
the title carries the goodput. matplotlib is imported here only (the `test` extra installs it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from maxtrain.monitor import goodput

COLORS = {"productive": "#2ca02c", "startup_compile": "#9467bd", "data_wait": "#17becf", "checkpoint": "#1f77b4",
          "eval": "#bcbd22", "lost_progress": "#ff7f0e", "hang": "#d62728", "downtime": "#7f7f7f", "other": "#e6e6e6"}


def plot(records: Iterable[dict], path: str | Path, title: str = "") -> Path:
  """Writes the timeline picture of an event log's records to `path` (PNG); returns the path."""
  import matplotlib

  matplotlib.use("Agg")  # no display needed
  import matplotlib.pyplot as plt

  data = goodput.timeline(records)
  report, rows, t0 = data["report"], data["rows"], data["t0"]
  height = 2.0 + 0.45 * len(rows)
  fig, ax = plt.subplots(figsize=(9, height), dpi=80)
  for y, (_, intervals) in enumerate(rows):
    bars: dict[str, list[tuple[float, float]]] = {c: [] for c in goodput.CATEGORIES}
    for start, end, parts in intervals:
      x = start - t0
      for category in goodput.CATEGORIES:  # fixed order inside an interval
        width = (end - start) * parts.get(category, 0.0)
        if width > 0:
          bars[category].append((x, width))
          x += width
    for category, spans in bars.items():
      if spans:
        ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=COLORS[category], linewidth=0)
  for wall in data["restarts"]:
    ax.axvline(wall - t0, color="black", linestyle="--", linewidth=0.8)
  ax.set_yticks(range(len(rows)), [label for label, _ in rows])
  ax.invert_yaxis()
  ax.set_xlim(0, data["t1"] - t0)
  ax.set_xlabel("wall seconds since the first event (dashed: supervisor restarts)")
  steps = report["steps"]
  ax.set_title(f"{title + ': ' if title else ''}goodput {report['goodput']:.1%} of {report['total_s']:.0f} s, "
               f"{report['attempts']} attempt(s), steps {steps['kept']} kept / {steps['computed']} computed",
               fontsize=10)
  handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[c]) for c in goodput.CATEGORIES]
  labels = [f"{c} {report['fractions'][c]:.1%}" for c in goodput.CATEGORIES]
  fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8, frameon=False)
  fig.tight_layout(rect=(0, 0.55 / height, 1, 1))  # room for the legend's two rows below the axis
  path = Path(path)
  fig.savefig(path)
  plt.close(fig)
  return path
