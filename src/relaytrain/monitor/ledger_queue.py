"""The ledger's queue time against Slurm's Submit (`relaytrain verify`).

The ledger's queue is the time between allocations: one run's End to the next run's Start. For a job that
Slurm requeued, the next run's own `Submit` in sacct is when it was requeued, so that run waited from its
Submit to its Start: a second account of the same queue time, from a field the ledger does not read. The
two agree within `AGREE` of the later run's allocation and sacct's whole second; more is a violation
naming the bucket (an allocation the ledger bounded wrongly, or a run between the two it does not hold).

Queue time between two different jobs of a run (a job submitted again by hand) is not checked: nothing
relates one job's Submit to the other's End.
"""

from __future__ import annotations

from collections.abc import Sequence

from relaytrain.job.allocations import JobRun
from relaytrain.monitor.ledger import Ledger

AGREE = 0.01  # of the later run's allocation
SACCT_RESOLUTION_S = 1.0  # sacct's times are whole seconds


def queue_against_submit(ledger: Ledger, slurm_runs: Sequence[JobRun] | None) -> tuple[list[str], str]:
    """Violations (one line each) and a note ("" when the run had no requeue Slurm accounted)."""
    runs = {(r.job_id, r.restart): r for r in slurm_runs or () if r.trusted}
    violations, checked, unknown = [], 0, 0
    for before, job in zip(ledger.jobs, ledger.jobs[1:], strict=False):
        a, b = before.allocation, job.allocation
        if a.job_id is None or a.job_id != b.job_id or b.restart <= a.restart:
            continue
        run = runs.get((b.job_id, b.restart))
        if run is None:
            continue
        if run.submit is None:
            unknown += 1
            continue
        checked += 1
        gap, waited = max(0.0, b.start - a.end), max(0.0, run.start - run.submit)
        if abs(gap - waited) > AGREE * job.seconds + SACCT_RESOLUTION_S:
            violations.append(
                f"queue: the ledger's queue before {job.label} is {gap:.1f} s (the previous run's End to its "
                f"Start), sacct's Submit to Start of that run {waited:.1f} s: {gap - waited:+.1f} s, more "
                f"than {AGREE:.0%} of its allocation and sacct's second"
            )
    if not checked and not unknown:
        return violations, ""
    note = f"queue: {checked} requeue(s) checked against sacct's Submit to Start"
    if unknown:
        note += f", {unknown} not (sacct gave no Submit)"
    return violations, note
