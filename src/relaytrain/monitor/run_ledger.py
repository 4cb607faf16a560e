"""A run's time ledger from its directory: its metrics.jsonl, and Slurm's Start..End of each of its jobs'
runs where accounting can be asked (`relaytrain status`, `report` and `verify` share this)."""

from __future__ import annotations

from relaytrain.job import RunDir
from relaytrain.job.allocations import job_runs
from relaytrain.monitor.history import read_records
from relaytrain.monitor.ledger import Allocation, Ledger
from relaytrain.monitor.ledger_spans import build_ledger


def run_ledger(run: RunDir, ask_slurm: bool = True) -> Ledger:
    """The ledger of `run` (a UserError when it has no metrics yet). Without Slurm, or with `ask_slurm`
    False, each allocation is bounded by the run's own records of it."""
    records, _skipped = read_records(run.metrics)
    jobs = sorted({str(r["job_id"]) for r in records if r.get("job_id")})
    measured = (job_runs(jobs) or []) if ask_slurm and jobs else []
    allocations = [Allocation(r.job_id, r.restart, r.start, r.end, "sacct") for r in measured]
    return build_ledger(records, allocations)
