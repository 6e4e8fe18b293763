"""Goodput of a run from its event log: `python tools/goodput_report.py OUTPUT_DIR [--json] [--plot PNG]`.

Reads `OUTPUT_DIR/events.jsonl` (every attempt and the supervisor append to it) and prints the share
of wall time that produced kept training progress, with the rest broken down by cause, and step-time
percentiles. The categories are defined in `maxtrain/monitor/goodput.py`. `--plot goodput.png`
also draws the same intervals as a timeline (`maxtrain/monitor/goodput_plot.py`, needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from maxtrain.monitor import events, goodput


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("output_dir", type=Path, help="the run's output_dir (or an events.jsonl file)")
  parser.add_argument("--json", action="store_true", help="print the report as JSON")
  parser.add_argument("--plot", type=Path, help="also write a timeline picture (PNG) of the same intervals")
  args = parser.parse_args(argv)
  path = args.output_dir if args.output_dir.is_file() else args.output_dir / events.FILENAME
  if not path.exists():
    print(f"goodput_report: no event log at {path} (is {args.output_dir} a run's output_dir?)", file=sys.stderr)
    return 2
  records = events.read_events(path)
  if not records:
    print(f"goodput_report: {path} holds no events", file=sys.stderr)
    return 2
  report = goodput.compute(records)
  print(json.dumps(report, indent=2) if args.json else goodput.format_table(report, str(args.output_dir)))
  if args.plot:
    from maxtrain.monitor import goodput_plot

    print(f"timeline written to {goodput_plot.plot(records, args.plot, args.output_dir.name)}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
