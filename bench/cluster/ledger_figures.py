"""What a cluster benchmark keeps of a run's time ledger (relaytrain's `monitor/run_ledger.py`, the one
computation `relaytrain status` shows): its seconds per bucket, and how it compares with Slurm.

bench.goodput reads a run's productive and allocated seconds from it; bench.chaos keeps it per trial
with `relaytrain verify`'s exit code, and a trial counts only when the ledger adds up (`adds_up`).
"""

from __future__ import annotations

from typing import Any

from relaytrain.monitor.run_ledger import RunTime

WITHIN = 0.01  # the bound: the buckets add up to sacct's elapsed, and at most this unaccounted


def ledger_figures(measured: RunTime) -> dict[str, Any]:
    """Of a run's ledger (`RunFiles.time_ledger`): its `allocated_s`, `queue_s`, `goodput` and `buckets`
    (as `relaytrain status --json` gives them), its number of `allocations`, and against Slurm: `sacct_s`
    (sacct's elapsed time of every run of the run's jobs; None when accounting did not answer, 0 outside
    Slurm), `vs_sacct` (the ledger's Slurm allocations less that, relative to it; None without it) and
    `unaccounted_share`."""
    ledger = measured.ledger
    figures = {key: value for key, value in ledger.as_json().items() if key != "jobs"}
    runs = measured.slurm_runs
    sacct = None if runs is None else sum(r.end - r.start for r in runs)
    slurm_s = sum(job.seconds for job in ledger.jobs if job.allocation.job_id is not None)
    allocated = ledger.allocated_s
    figures.update({
        "allocations": len(ledger.jobs),
        "sacct_s": None if sacct is None else round(sacct, 3),
        "vs_sacct": round((slurm_s - sacct) / sacct, 6) if sacct else None,
        "unaccounted_share": round(ledger.buckets["unaccounted"] / allocated, 6) if allocated else None,
    })  # fmt: skip
    return figures


def adds_up(figures: dict[str, Any]) -> bool:
    """The buckets add up to sacct's elapsed time within `WITHIN`, and at most `WITHIN` is unaccounted."""
    vs, unaccounted = figures.get("vs_sacct"), figures.get("unaccounted_share")
    return vs is not None and abs(vs) <= WITHIN and unaccounted is not None and unaccounted <= WITHIN


def time_adds_up(trial: Any) -> bool | None:
    """A chaos trial's: `relaytrain verify` exited 0 and its ledger `adds_up`; None for a trial kept before
    the benchmark recorded them (its `verify_exit` None)."""
    if trial.verify_exit is None:
        return None
    return trial.verify_exit == 0 and adds_up(trial.ledger)
