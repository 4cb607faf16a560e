"""`python -m relaytrain.checkpoint.snapshot cleanup --config CONFIG`: remove this Slurm job's snapshots
from this node's `checkpoint.snapshot_dir` (every run of the job). The batch script runs it on each node
(one task per node) when the job ends for good, so snapshots never outlive their job in a node's memory;
a requeued job keeps them for its next start. Imports no torch: it runs in a second."""

from __future__ import annotations

import argparse
import sys

from relaytrain.checkpoint.snapshot.store import remove_job
from relaytrain.config import load_config
from relaytrain.entry_points import SNAPSHOT
from relaytrain.errors import UserError
from relaytrain.job.facts import JobFacts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {SNAPSHOT}")
    sub = parser.add_subparsers(dest="command", required=True)
    cleanup = sub.add_parser("cleanup", help="remove this job's snapshots from this node")
    cleanup.add_argument("--config", required=True, help="the run's resolved config (its snapshot_dir)")
    cleanup.add_argument("--job-id", default="", help="the Slurm job id (default: this job's)")
    args = parser.parse_args(argv)
    job = JobFacts.from_env()
    job_id = args.job_id or job.job_id
    if not job_id:
        print("not inside a Slurm job: give --job-id", file=sys.stderr)
        return 2
    try:
        snapshot_dir = load_config(args.config).checkpoint.snapshot_dir
    except UserError as exc:
        print(f"relaytrain: {exc}", file=sys.stderr)
        return 2
    for path in remove_job(snapshot_dir, job_id):
        print(f"relaytrain: removed the snapshots of job {job_id} on {job.host()}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
