"""Each run of a Slurm job as accounting knows it: Start..End, one per requeue, for the time ledger.

``sacct -D -X`` (every run of a requeued job, the allocation alone) where accounting storage runs, else
``sacct -c`` (the job completion file, one line per run). A run not finished yet ends now. Runs are
numbered by their start, which is Slurm's restart count for a job that was requeued in place.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterable
from typing import NamedTuple

from relaytrain.job.slurmctld import SLURM_QUERY_TIMEOUT_S, parse_slurm_time

QUERIES = (
    ["sacct", "-D", "-X", "-n", "-P", "-o", "JobID,Start,End,State"],
    ["sacct", "-c", "-n", "-P", "-o", "JobID,Start,End,State"],
)


class JobRun(NamedTuple):
    job_id: str
    restart: int  # its place among the job's runs, by start
    start: float
    end: float
    running: bool  # not ended yet: `end` is when it was asked


def parse_runs(job_id: str, text: str, now: float) -> list[JobRun]:
    """The runs of `job_id` in sacct's `JobID|Start|End|State` lines (steps and other jobs left out)."""
    found: list[tuple[float, float, bool]] = []
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < 3 or parts[0].strip() != job_id:
            continue
        start = parse_slurm_time(parts[1])
        if start is None:  # never started (pending, or cancelled in the queue)
            continue
        end = parse_slurm_time(parts[2])
        found.append((start, end if end is not None else now, end is None))
    found = sorted(set(found))
    return [JobRun(job_id, index, start, end, running) for index, (start, end, running) in enumerate(found)]


def job_runs(job_ids: Iterable[str], timeout: float = SLURM_QUERY_TIMEOUT_S) -> list[JobRun] | None:
    """Every run of the jobs, or None when Slurm's accounting cannot be asked (no sacct, disabled, down)."""
    ids = [str(job) for job in job_ids if str(job)]
    if not ids:
        return []
    if shutil.which("sacct") is None:
        return None
    now = time.time()
    for query in QUERIES:
        try:
            proc = subprocess.run([*query, "-j", ",".join(ids)], capture_output=True, text=True,
                                  timeout=timeout, check=False)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return None
        if proc.returncode == 0 and proc.stdout.strip():
            return [run for job in ids for run in parse_runs(job, proc.stdout, now)]
    return None
