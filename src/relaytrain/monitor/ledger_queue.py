"""The ledger's queue time against Slurm's Submit (`relaytrain verify`).

The ledger's queue is the time between allocations: one run's End to the next run's Start. For a job that
Slurm requeued, the next run's own Submit is when Slurm requeued it, once the previous run's steps and
epilog were done (its nodes completing), so that run waited from its Submit to its Start: a second
account of the queue, from a field the ledger does not read. Slurm keeps it in accounting storage
(`sacct -D`'s Submit) and in a text job completion file (each run's line's `SubmitTime`, read from the
file: `sacct -c` prints the Start there; job/allocations.py). The ledger's queue holds that wait and the
completing before it (on the local cluster 11-12 s between a run's End and its requeue's Submit), so it
may be longer, never shorter: a ledger queue shorter than Slurm's wait by more than `AGREE` of the later
run's allocation and sacct's whole second is a violation naming the bucket (allocations the ledger
stretched over time Slurm says the job waited). The note gives the completing time the ledger's queue
holds. Where neither answers (no accounting storage, and a job completion file that is not text or that
this host cannot read) the requeues are not checked, and the note says so and why (job/allocations.py's
one line); verify's exit status is that of the checks it made.

Queue time between two different jobs of a run (a job submitted again by hand) is not checked: nothing
relates one job's Submit to the other's End.

Wherever sacct gave the bounds (the job completion file too), the run's own clock checks Slurm's Start:
no record of a job run (the driver's `job_start` first, the trainer's `process_start`) is older than
that run's Start, but for sacct's whole second. An older one is time the records show running that the
ledger counts as queue, or as the run before (`records_before_start`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from relaytrain.job.allocations import JobRun
from relaytrain.monitor.ledger import Ledger

AGREE = 0.01  # of the later run's allocation
SACCT_RESOLUTION_S = 1.0  # sacct's times are whole seconds


def queue_against_submit(
    ledger: Ledger, slurm_runs: Sequence[JobRun] | None, why: str = ""
) -> tuple[list[str], str]:
    """Violations (one line each) and a note ("" when the run had no requeue); `why`: why Slurm's
    accounting did not answer (`slurm_runs` None), or why a run's Submit is unknown."""
    runs = {(r.job_id, r.restart): r for r in slurm_runs or () if r.trusted}
    violations, checked, unknown, completing = [], 0, 0, 0.0
    for before, job in zip(ledger.jobs, ledger.jobs[1:], strict=False):
        a, b = before.allocation, job.allocation
        if a.job_id is None or a.job_id != b.job_id or b.restart <= a.restart:
            continue
        run = runs.get((b.job_id, b.restart))
        if run is None and slurm_runs is not None:
            continue  # a run sacct does not bound (untrusted): said by the check against sacct
        if run is None or run.submit is None:
            unknown += 1
            continue
        checked += 1
        gap, waited = max(0.0, b.start - a.end), max(0.0, run.start - run.submit)
        completing += max(0.0, gap - waited)
        if waited - gap > AGREE * job.seconds + SACCT_RESOLUTION_S:
            violations.append(
                f"queue: the ledger's queue before {job.label} is {gap:.1f} s (the previous run's End to its "
                f"Start), shorter than Slurm's Submit to Start of that run, {waited:.1f} s, by more than "
                f"{AGREE:.0%} of its allocation and sacct's second"
            )
    if not checked and not unknown:
        return violations, ""
    note = f"queue: {checked} requeue(s) checked against Slurm's Submit to Start"
    note += f" ({completing:.0f} s of the queue Slurm's completing before a requeue)" if checked else ""
    if unknown:
        note += f", {unknown} NOT checked: {why or 'Slurm gave no Submit'}"
    return violations, note


def records_before_start(ledger: Ledger, records: Sequence[dict[str, Any]]) -> list[str]:
    """One line per allocation bounded by sacct whose records begin before its Start (see above)."""
    found = []
    for job in ledger.jobs:
        a = job.allocation
        if a.source != "sacct" or a.job_id is None:
            continue
        times = [
            float(value)
            for r in records
            if r.get("job_id") == a.job_id and int(r.get("restart") or 0) == a.restart
            for value in (r.get("time"), r.get("process_start"))
            if isinstance(value, int | float) and not isinstance(value, bool)
        ]
        first = min(times, default=a.start)
        if first < a.start - SACCT_RESOLUTION_S:
            found.append(
                f"queue: {job.label}'s first record is {a.start - first:.1f} s older than sacct's Start of "
                "that run: the ledger counts time the run's records show running as queue"
            )
    return found
