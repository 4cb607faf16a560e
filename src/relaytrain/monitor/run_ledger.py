"""A run's time ledger from its directory: its metrics.jsonl, and Slurm's Start..End of each of its jobs'
runs where accounting can be asked (`relaytrain status`, `report` and `verify` share this)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relaytrain.job import RunDir
from relaytrain.job.allocations import JobRun, SlurmRuns, slurm_runs
from relaytrain.monitor.history import read_records
from relaytrain.monitor.ledger import Allocation, Ledger
from relaytrain.monitor.ledger_spans import build_ledger


@dataclass
class RunTime:
    """The ledger with what it was built from: the records, and Slurm's runs of the run's jobs (None when
    accounting was not asked or did not answer; [] when the run has no Slurm job)."""

    ledger: Ledger
    records: list[dict[str, Any]]
    slurm_runs: list[JobRun] | None
    slurm_why: str = ""  # why accounting did not answer, or why a run's Submit is unknown


def run_time(run: RunDir, ask_slurm: bool = True) -> RunTime:
    """`run_ledger` and its inputs (`relaytrain verify` checks the ledger against them)."""
    records, _skipped = read_records(run.metrics)
    jobs = sorted({str(r["job_id"]) for r in records if r.get("job_id")})
    asked = (slurm_runs(jobs) if ask_slurm else SlurmRuns(None, "Slurm not asked")) if jobs else SlurmRuns([])
    allocations = [  # an untrusted job's allocations are bounded by the run's own records instead
        Allocation(r.job_id, r.restart, r.start, r.end, "sacct", r.running)
        for r in asked.runs or []
        if r.trusted
    ]
    return RunTime(build_ledger(records, allocations), records, asked.runs, asked.why)


def run_ledger(run: RunDir, ask_slurm: bool = True) -> Ledger:
    """The ledger of `run` (a UserError when it has no metrics yet). Without Slurm, or with `ask_slurm`
    False, each allocation is bounded by the run's own records of it."""
    return run_time(run, ask_slurm).ledger
