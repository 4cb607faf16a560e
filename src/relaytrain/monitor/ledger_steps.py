"""The ledger's `productive` bucket against the train records' step times (`relaytrain verify`).

The ledger's step time is what its windows (monitor/time_ledger.py, the window's wall clock) leave once
checkpoint, snapshot and evaluation time are taken out; `ledger_spans.py` lays it out as `productive`,
`replayed` (steps an earlier window ran), the first step's time beyond a typical step (`startup`) and the
steps a snapshot's background work slowed (`snapshot`). The train records time the same steps another
way: the metrics' step timer (monitor/timer.py) times each logging window from the first step's data
read, evaluation left out, and its per-step means are in the record (``time_step_s``, of which
``time_checkpoint_s`` is blocking checkpoint and snapshot time). So over the steps both logged:

    productive + replayed + first-step start-up + snapshot slowdown
        ~ sum over the records of (time_step_s - time_checkpoint_s) x the record's steps

They differ by the milliseconds between the two clocks' readings (a window closes after the step's
evaluation and save, the timer reads before them: those are taken out on both sides). Per allocation, a
difference over `MAX_APART` of the allocated time (and sacct's whole second, where sacct bounds it) is a
violation naming the bucket: time the ledger put in `productive` that no step took (or steps it did not
count).

Compared per process, up to its last step that both a train record and a ledger window end at (a stop's
window and the steps after the last log step have no train record). A process with a NaN rollback is not
compared: its train records' steps repeat, so their count of steps is not known.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from relaytrain.monitor.ledger import Ledger, duration
from relaytrain.monitor.ledger_processes import processes

MAX_APART = 0.01  # of the allocation's seconds
# and, where sacct bounds the allocation, its whole second: its End is truncated, so up to a second of
# the last steps of a run that stopped right after them lies past it (a preempted job on the local cluster)
SACCT_RESOLUTION_S = 1.0
STEP_DETAILS = {
    "productive": None,  # any detail
    "replayed": None,
    "startup": "first step beyond a typical one",
    "snapshot": "steps slowed by background work",
}


def _num(record: dict[str, Any], key: str) -> float | None:
    value = record.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _train_seconds(trains: list[dict[str, Any]], begin: int, last: int) -> float | None:
    """The train records' step time, checkpoint time left out, over steps begin+1..last (None: a record
    without its step times)."""
    total, previous = 0.0, begin
    for record in trains:
        step = int(record["step"])
        if step > last:
            break
        step_s, checkpoint_s = _num(record, "time_step_s"), _num(record, "time_checkpoint_s") or 0.0
        if step_s is None:
            return None
        total += (step_s - checkpoint_s) * max(1, step - previous)
        previous = step
    return total


def _ledger_step_seconds(ledger: Ledger, alloc: tuple, start: float, end: float) -> float:
    """The ledger's step-time spans of allocation `alloc` within [start, end]."""
    total = 0.0
    for job in ledger.jobs:
        if (job.allocation.job_id, job.allocation.restart) != alloc:
            continue
        for span in job.spans:
            if span.bucket not in STEP_DETAILS:
                continue
            detail = STEP_DETAILS[span.bucket]
            if detail is not None and not span.detail.startswith(detail):
                continue
            total += max(0.0, min(span.end, end) - max(span.start, start))
    return total


def productive_against_steps(ledger: Ledger, records: Sequence[dict[str, Any]]) -> tuple[list[str], str]:
    """Violations (one line each, per allocation) and a note: the ledger's step time against the train
    records' (see above)."""
    seconds = {
        (j.allocation.job_id, j.allocation.restart): (j.seconds, j.label, j.allocation.source == "sacct")
        for j in ledger.jobs
    }
    compared: dict[tuple, list[float]] = {}  # alloc -> [ledger s, train s, steps]
    skipped = 0
    for proc in processes(records):
        windows = [w for w in proc.windows if w.since is not None and w.until is not None]
        if proc.alloc not in seconds or not windows or not proc.train:
            continue
        if proc.rollback or not isinstance(proc.begin, int):
            skipped += 1
            continue
        ends = {w.last: w.until for w in windows}
        both = [int(r["step"]) for r in proc.train if int(r["step"]) in ends]
        if not both:
            continue
        last = max(both)
        train_s = _train_seconds(proc.train, proc.begin, last)
        if train_s is None:
            skipped += 1
            continue
        start = min(w.since for w in windows)
        ledger_s = _ledger_step_seconds(ledger, proc.alloc, start, ends[last])
        sums = compared.setdefault(proc.alloc, [0.0, 0.0, 0.0])
        sums[0] += ledger_s
        sums[1] += train_s
        sums[2] += last - proc.begin
    violations = []
    for alloc, (ledger_s, train_s, _) in compared.items():
        allocated, label, sacct = seconds[alloc]
        apart = ledger_s - train_s
        if abs(apart) > MAX_APART * allocated + (SACCT_RESOLUTION_S if sacct else 0.0):
            violations.append(
                f"productive: {label}'s ledger puts {ledger_s:.3f} s in its steps (productive, replayed, the "
                f"first step's start-up, snapshot slowdown), its train records' step times add up to "
                f"{train_s:.3f} s: {apart:+.3f} s, more than {MAX_APART:.0%} of its {duration(allocated)} "
                "allocated" + (" and sacct's whole second" if sacct else "")
            )
    if not compared:
        note = "productive: no steps logged by both the ledger windows and the train records, not compared"
    else:
        ledger_s = sum(v[0] for v in compared.values())
        train_s = sum(v[1] for v in compared.values())
        steps = int(sum(v[2] for v in compared.values()))
        note = (
            f"productive: the ledger's step time of {steps} logged step(s) is {duration(ledger_s)}, the "
            f"train records' step times {duration(train_s)} ({ledger_s - train_s:+.3f} s)"
        )
    if skipped:
        note += f"; {skipped} process(es) not compared (a NaN rollback, or records without step times)"
    return violations, note
