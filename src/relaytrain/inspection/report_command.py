"""CLI: `relaytrain report RUN [--runs DIR] [--out DIR]`."""

from __future__ import annotations

import argparse
from pathlib import Path


def report_command(args: argparse.Namespace) -> int:
    from relaytrain.inspection.report import write_report, written_line  # matplotlib only when it runs
    from relaytrain.inspection.run_view import required_run

    run = required_run(args.run_dir, Path(args.runs))  # the RUN of status, logs and verify
    report, images = write_report(run, Path(args.out) if args.out else None)
    print(written_line(report, images))
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "report",
        help="plot a run's loss, throughput, MFU, memory and GPU use, and summarise it in markdown",
        description="Write PNG plots and report.md for a run directory, stitching requeued jobs together.",
    )
    parser.add_argument(
        "run_dir", metavar="RUN", help="a run name under --runs, or the path of a run directory"
    )
    parser.add_argument("--runs", default="runs", help="where run directories live (default: runs)")
    parser.add_argument("--out", metavar="DIR", default=None, help="output directory (default: RUN/report)")
    parser.set_defaults(func=report_command)
