"""What `relaytrain verify` checks of a run's time ledger (monitor/ledger.py): that it adds up.

- the buckets, `unaccounted` among them, add up to the allocated time (they do by construction: this is
  the guard on that construction);
- ledger windows of one trainer process claim at most `MAX_TWICE` of the allocated time twice (they
  meet end to end as the trainer writes them, but for the milliseconds each record takes to be written;
  more would be time counted twice, which the ledger's layout clips silently);
- at most `MAX_UNACCOUNTED` of the allocated time is time no record covers (allocations still running
  left out: their end is "now", past the last record), and at most `MAX_UNACCOUNTED` is that and time a
  rule put in a bucket without another source to confirm it (monitor/ledger_sources.py), the bucket named;
- every step a process logged lies in one of its ledger windows, and no checkpoint was committed outside
  the allocations (monitor/ledger_sources.py);
- `productive` (with the other step time) agrees with the train records' step times within 1 % of each
  allocation (monitor/ledger_steps.py), and the queue before a requeued run with Slurm's Submit to Start
  of that run (monitor/ledger_queue.py);
- where Slurm's accounting answered, the ledger's Slurm allocations add up to sacct's elapsed time of
  every run of the run's jobs within `SACCT_TOLERANCE` (a job run that recorded nothing, or that the
  records number differently from sacct, is missing from the ledger).

A run whose records hold no `ledger` window and no start event with the ledger's fields (written before
the trainer recorded them) is not checked; its summary says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from relaytrain.job.allocations import JobRun
from relaytrain.monitor.ledger import Ledger, duration
from relaytrain.monitor.ledger_processes import Window, processes
from relaytrain.monitor.ledger_queue import queue_against_submit, records_before_start
from relaytrain.monitor.ledger_sources import commits_outside, steps_without_window, unconfirmed
from relaytrain.monitor.ledger_steps import productive_against_steps

SUM_TOLERANCE = 1e-6  # relative: float sums of spans that tile the allocation
MAX_UNACCOUNTED = 0.01  # of the allocated time
SACCT_TOLERANCE = 0.01  # relative
MIN_GAP_S = 0.05  # a gap or overlap a violation names
MAX_TWICE = 0.01  # of the allocated time, claimed by two windows


@dataclass
class LedgerReport:
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return "; ".join(self.notes)


def check_ledger(
    ledger: Ledger,
    records: Sequence[dict[str, Any]],
    slurm_runs: Sequence[JobRun] | None,
    crashes: Sequence[dict[str, Any]] = (),
    commits: Sequence[tuple[str, float]] = (),
    slurm_why: str = "",
) -> LedgerReport:
    """The violations of `ledger` built from `records` and `slurm_runs` (None: accounting not asked or
    not answering; `slurm_why`: why, or why a run's Submit is unknown), checked against the run's
    `crashes` (crashes.jsonl) and its checkpoints' `commits` (name, commit time), and the summary of what
    was checked."""
    report = LedgerReport()
    ledger_era = any(r.get("kind") == "event" and "process_start" in r for r in records)
    if not ledger_era and not any(r.get("kind") == "ledger" for r in records):
        report.notes.append(
            "no ledger windows in the run's records (written before the time ledger): not checked"
        )
        return report
    allocated = ledger.allocated_s
    buckets = ledger.buckets
    total = sum(buckets.values())
    if abs(total - allocated) > SUM_TOLERANCE * max(allocated, 1.0):
        report.violations.append(f"the buckets add up to {total:.3f} s, the allocations to {allocated:.3f} s")
    report.violations += overlapping_windows(records, allocated)
    running = {(r.job_id, r.restart) for r in slurm_runs or () if r.running}
    ended = [j for j in ledger.jobs if (j.allocation.job_id, j.allocation.restart) not in running]
    ended_s = sum(j.seconds for j in ended)
    unaccounted = sum(j.buckets()["unaccounted"] for j in ended)
    if ended_s > 0 and unaccounted > MAX_UNACCOUNTED * ended_s:
        gaps = sorted(
            (
                (span.seconds, job, span)
                for job in ended
                for span in job.spans
                if span.bucket == "unaccounted" and span.seconds >= MIN_GAP_S
            ),
            key=lambda item: -item[0],
        )[:3]
        where = ", ".join(
            f"{job.label} at +{span.start - job.allocation.start:.1f} s for {secs:.1f} s"
            for secs, job, span in gaps
        )
        report.violations.append(
            f"{duration(unaccounted)} of {duration(ended_s)} allocated ({unaccounted / ended_s:.1%}) is "
            f"unaccounted (no record covers it), more than {MAX_UNACCOUNTED:.0%}; largest gaps: {where}"
        )
    elif ended_s > 0:
        states = {(r.job_id, r.restart): r.state for r in slurm_runs or ()}
        guessed = unconfirmed(ledger, records, crashes, ended, states)
        guessed_s = sum(seconds for seconds, _ in guessed.values())
        if unaccounted + guessed_s > MAX_UNACCOUNTED * ended_s:
            largest = sorted(guessed.items(), key=lambda item: -item[1][0])
            named = "; ".join(
                f"{name} {duration(seconds)} ({', '.join(rules[:2])})" for name, (seconds, rules) in largest
            )
            report.violations.append(
                f"{duration(guessed_s + unaccounted)} of {duration(ended_s)} allocated "
                f"({(guessed_s + unaccounted) / ended_s:.1%}) is inferred by rule with no other source to "
                f"confirm it, or unaccounted, more than {MAX_UNACCOUNTED:.0%}: {named}"
            )
    report.violations += steps_without_window(records)
    report.violations += commits_outside(ledger, commits)
    productive, productive_note = productive_against_steps(ledger, records)
    report.violations += productive
    jobs, lost = len(ledger.jobs), buckets["unaccounted"]
    inferred = sum(ledger.inferred.values())
    report.notes.append(
        f"{duration(allocated)} allocated in {jobs} allocation{'s' * (jobs != 1)}, the buckets add up, "
        f"unaccounted {duration(lost)} ({lost / allocated if allocated else 0.0:.1%}), inferred by rule "
        f"{duration(inferred)} ({inferred / allocated if allocated else 0.0:.1%})"
    )
    report.notes.append(productive_note)
    report.notes.append(_against_sacct(ledger, slurm_runs, report.violations, records))
    queue, queue_note = queue_against_submit(ledger, slurm_runs, slurm_why)
    report.violations += queue + records_before_start(ledger, records)
    report.notes += [queue_note] if queue_note else []
    return report


def _against_sacct(
    ledger: Ledger, slurm_runs: Sequence[JobRun] | None, violations: list[str], records: Sequence[dict]
) -> str:
    """The note on Slurm's elapsed time; a violation appended when the ledger's Slurm allocations differ."""
    if not any(r.get("job_id") for r in records):
        return "outside Slurm: each allocation bounded by its process's own records"
    if slurm_runs is None:
        return "Slurm's accounting did not answer: each allocation bounded by the run's own records"
    untrusted = sorted({r.job_id for r in slurm_runs if not r.trusted})
    unchecked = (
        f"; job(s) {', '.join(untrusted)} not checked: Slurm's job completion file gives a job's runs from "
        "a resize on the resize's time as their start, so their allocations are bounded by the run's own "
        "records"
        if untrusted
        else ""
    )
    slurm_runs = [r for r in slurm_runs if r.trusted]
    if not slurm_runs:
        return unchecked.removeprefix("; ")
    sacct_s = sum(r.end - r.start for r in slurm_runs)
    checked = {r.job_id for r in slurm_runs}
    slurm_jobs = [j for j in ledger.jobs if j.allocation.job_id in checked]
    ledger_s = sum(j.seconds for j in slurm_jobs)
    if abs(ledger_s - sacct_s) <= SACCT_TOLERANCE * sacct_s:
        runs = len(slurm_runs)
        return (
            f"the Slurm allocations match sacct's elapsed time of {runs} job run(s) ({duration(sacct_s)})"
            + unchecked
        )
    known = {
        (j.allocation.job_id, j.allocation.restart) for j in slurm_jobs if j.allocation.source == "sacct"
    }
    missing = [
        f"job {r.job_id} run {r.restart} ({r.end - r.start:.1f} s)"
        for r in slurm_runs
        if (r.job_id, r.restart) not in known
    ]
    unmatched = [j.label for j in slurm_jobs if j.allocation.source != "sacct"]
    apart = abs(ledger_s - sacct_s) / sacct_s if sacct_s > 0 else float("inf")
    line = (
        f"the ledger's Slurm allocations add up to {ledger_s:.1f} s, sacct's elapsed time of the jobs' "
        f"{len(slurm_runs)} run(s) to {sacct_s:.1f} s ({apart:.1%} apart, more than {SACCT_TOLERANCE:.0%})"
    )
    line += f"; sacct's runs the ledger lacks: {', '.join(missing)}" if missing else ""
    line += f"; bounded by records, sacct has no such run: {', '.join(unmatched)}" if unmatched else ""
    violations.append(line)
    return "the Slurm allocations do not match sacct" + unchecked


def overlapping_windows(records: Sequence[dict[str, Any]], allocated_s: float) -> list[str]:
    """A line when the ledger windows that begin before the previous window of their process ended claim
    more than `MAX_TWICE` of `allocated_s` twice (a window's record is stamped as it is written, just
    after the next window began: milliseconds a window), and one per window that ends before it begins.
    A process: one job step of one job run (outside Slurm, one start of the trainer); its `start` or
    `resume` event begins the next."""
    found: list[str] = []
    overlaps: list[tuple[float, str]] = []
    for proc in processes(records):
        where = f" (job {proc.job})" if proc.job else ""
        previous: Window | None = None
        for window in proc.windows:
            since, end = window.since, window.until
            if since is None or end is None:
                continue
            steps = f"the ledger window of steps {window.first}-{window.last}{where}"
            if end < since:
                found.append(f"{steps} ends {since - end:.3f} s before it begins")
            if previous is not None and since < previous.until:
                ago = previous.until - since
                overlaps.append(
                    (ago, f"{steps} begins {ago:.3f} s before the window of step {previous.last} ended")
                )
            previous = window
    twice = sum(seconds for seconds, _ in overlaps)
    if allocated_s > 0 and twice > MAX_TWICE * allocated_s:
        named = sorted((item for item in overlaps if item[0] >= MIN_GAP_S), key=lambda item: -item[0])
        largest = "; ".join(line for _, line in named[:3]) or f"each under {MIN_GAP_S} s"
        found.append(
            f"{twice:.3f} s ({twice / allocated_s:.1%} of the allocated time) is claimed by two ledger "
            f"windows, more than {MAX_TWICE:.0%}: {largest}"
        )
    return found
