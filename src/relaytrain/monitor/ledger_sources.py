"""The time ledger against sources it did not build: what `relaytrain verify` confirms of its inferred
spans, and what other records say the ledger should hold.

- **Inferred spans** (monitor/ledger.py: a bucket a rule chose where no record measured the span) are
  confirmed by a source of their own, where the sources agree within `AGREE` of the allocation: a Slurm
  allocation's `stop` tail by the trainer's stop or finished event and Slurm's End, the tail (the job's
  last record to Slurm's End) no longer than that and `EXIT_S`; a `restart` or `lost` tail of
  a Slurm job by crashes.jsonl (the end-of-step decision's record of the failure, of the same job run,
  written as the failed step ended: by the span's end, or before the job's last record for the tail to
  Slurm's End) or a job step the driver saw end with a non-zero exit code; the `lost` tail of a job run
  whose step never ended (the driver killed with its node, the job preempted or cancelled: the time from
  its last window to Slurm's End) by Slurm's End and its State of that run, which says Slurm ended it
  from outside (not COMPLETED: a run that completed by itself ended its step); a `lost`
  tail of a process outside Slurm by the trainer's `train` records inside it (steps the process ran after
  its last window). A process's `stop` that no window of its step closed holds steps no window measured:
  nothing confirms it. What is not confirmed counts with `unaccounted` in verify's 1 % check.
- **Steps without a window.** Every step a process logged (`train` records, written by the metrics
  logger, not the ledger) lies in one of its ledger windows, up to its last window, and, when the process
  ended with its `stop` or `finished` event (its loop closed a window there), after it too.
- **Commits outside every allocation.** A checkpoint committed (its `COMPLETE` written) after an
  allocation bounded by its own records ended, and before the next began, was saved by time no record
  holds: that process's stop (its save and exit) is not recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from relaytrain.monitor.ledger import JobTime, Ledger, Span
from relaytrain.monitor.ledger_processes import processes
from relaytrain.monitor.ledger_spans import ENDED_INSIDE_STEP

COMMIT_SLACK_S = 0.01  # a commit this much after an allocation's recorded end is outside it
AGREE = 0.01  # of the allocation: how far two sources of one span's time may be apart
# The batch script's exit after the driver's job_end, to Slurm's End (whole seconds): 0.2-3.1 s in four
# 2-node runs on the local cluster
EXIT_S = 5.0


def _num(record: dict[str, Any], key: str) -> float | None:
    value = record.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _job_records(job: JobTime, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    a = job.allocation
    return [r for r in records if r.get("job_id") == a.job_id and int(r.get("restart") or 0) == a.restart]


def confirmation(
    job: JobTime,
    span: Span,
    records: Sequence[dict[str, Any]],
    crashes: Sequence[dict[str, Any]],
    states: dict[tuple, str] | None = None,
) -> str:
    """The source that confirms an inferred span's bucket, or "" when none does; `states`: Slurm's State
    of each job run, by (job id, restart)."""
    a = job.allocation
    if a.job_id is None:
        if span.bucket == "lost":
            ran = [
                r
                for r in records
                if r.get("kind", "train") == "train"
                and r.get("job_id") is None
                and span.start < (_num(r, "time") or 0.0) <= span.end
            ]
            return "the trainer's train records of the steps it ran" if ran else ""
        return ""
    own = _job_records(job, records)
    if span.bucket == "stop" and span.inferred.startswith("the last record to Slurm's End"):
        # the job's last record (the driver's end, after the trainer's stop) and Slurm's End agree: the
        # tail between them is the batch script's exit, within the check's 1 % and EXIT_S
        ended = any(r.get("kind") == "event" and r.get("event") in ("stop", "finished") for r in own)
        agree = span.seconds <= AGREE * (a.end - a.start) + EXIT_S
        return "the trainer's stop event and Slurm's End" if ended and agree and a.source == "sacct" else ""
    if span.bucket == "lost" and span.detail == ENDED_INSIDE_STEP:
        # the step never ended as the driver saw it: Slurm ended the run from outside (a node failure, a
        # preemption, a cancel, a requeue) at the End the tail runs to
        state = (states or {}).get((a.job_id, a.restart), "")
        ended = a.source == "sacct" and state not in ("", "COMPLETED", "RUNNING")
        return f"Slurm's End and its State of the run ({state})" if ended else ""
    if span.bucket in ("restart", "lost"):
        tolerance = AGREE * (a.end - a.start)
        tail = span.inferred.startswith("the last record to Slurm's End")
        for c in crashes:
            at, restart = _num(c, "time"), c.get("restart_count", c.get("restart"))
            if str(c.get("job_id")) != a.job_id or int(restart or 0) != a.restart or at is None:
                continue
            # the end-of-step decision writes it as the failed step ends: at the span's end (a failed
            # step's tail), or before the job's last record (the tail to Slurm's End)
            low, high = (a.start, span.start) if tail else (span.start, span.end)
            if low <= at <= high + tolerance:
                return "the driver's crash records"
        failed = [
            r
            for r in own
            if r.get("kind") == "job" and r.get("event") == "step_end" and r.get("exit_code") not in (0, None)
        ]
        return "the driver's end of a failed job step" if failed else ""
    return ""


def unconfirmed(
    ledger: Ledger,
    records: Sequence[dict[str, Any]],
    crashes: Sequence[dict[str, Any]],
    jobs: Sequence[JobTime],
    states: dict[tuple, str] | None = None,
) -> dict[str, tuple[float, list[str]]]:
    """Per bucket: the seconds of `jobs`' inferred spans nothing confirms, and the rules that chose them
    (`states`: Slurm's State of each job run, by (job id, restart))."""
    out: dict[str, tuple[float, list[str]]] = {}
    for job in jobs:
        for span in job.spans:
            if not span.inferred or span.seconds <= 0 or confirmation(job, span, records, crashes, states):
                continue
            seconds, rules = out.get(span.bucket, (0.0, []))
            rule = f"{job.label}: {span.inferred}"
            out[span.bucket] = (seconds + span.seconds, rules + ([rule] if rule not in rules else []))
    return out


def steps_without_window(records: Sequence[dict[str, Any]]) -> list[str]:
    """One line per process with logged steps that none of its ledger windows covers (see above)."""
    found = []
    for proc in processes(records):
        spans = [(w.first, w.last) for w in proc.windows]
        last = max((end for _, end in spans), default=None)
        uncovered = [
            step
            for step in (int(r["step"]) for r in proc.train)
            if not any(a <= step <= b for a, b in spans)
            and (proc.ended or (last is not None and step <= last))
        ]
        if uncovered:
            where = f"job {proc.job}'s process" if proc.job else "the process"
            found.append(
                f"{where} that began at step {proc.begin} logged steps {_ranges(uncovered)} (its train "
                "records) that no ledger window covers: their time is not measured"
            )
    return found


def _ranges(steps: list[int]) -> str:
    steps = sorted(set(steps))
    parts, start = [], steps[0]
    for a, b in zip(steps, [*steps[1:], None], strict=True):
        if b != a + 1:
            parts.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(parts)


def commits_outside(ledger: Ledger, commits: Sequence[tuple[str, float]]) -> list[str]:
    """One line per checkpoint (name, commit time) committed between an allocation bounded by its own
    records and the next allocation."""
    found = []
    for job, after in zip(ledger.jobs, ledger.jobs[1:], strict=False):
        if job.allocation.source != "records":
            continue
        for name, at in commits:
            if job.allocation.end + COMMIT_SLACK_S < at < after.allocation.start:
                found.append(
                    f"checkpoint {name} was committed {at - job.allocation.end:.3f} s after the last record "
                    f"of {job.label}, before the next allocation began: that process's stop (its save and "
                    "its exit) is not recorded"
                )
    return found
