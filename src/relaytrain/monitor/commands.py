"""CLI: `relaytrain report RUN_DIR [--out DIR]`."""

from __future__ import annotations

import argparse
from pathlib import Path


def report_command(args: argparse.Namespace) -> int:
    from relaytrain.job import RunDir
    from relaytrain.monitor.report import write_report, written_line  # matplotlib only when it runs

    report, images = write_report(RunDir(Path(args.run_dir)), Path(args.out) if args.out else None)
    print(written_line(report, images))
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "report",
        help="plot a run's loss, throughput, MFU, memory and GPU use, and summarise it in markdown",
        description="Write PNG plots and report.md for a run directory, stitching requeued jobs together.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (runs/<name>)")
    parser.add_argument(
        "--out", metavar="DIR", default=None, help="output directory (default: RUN_DIR/report)"
    )
    parser.set_defaults(func=report_command)
