"""Building a run's time ledger (monitor/ledger.py) from its records: each allocation cut into spans."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from relaytrain.monitor.ledger import WINDOW_PARTS, Allocation, JobTime, Ledger, Span


def _key(record: dict[str, Any]) -> tuple[str | None, int]:
    return record.get("job_id"), int(record.get("restart") or 0)


def _num(record: dict[str, Any], key: str) -> float | None:
    value = record.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _processes(records: Sequence[dict[str, Any]]) -> dict[tuple[str | None, int], list[dict[str, Any]]]:
    """The records of each allocation, in file order: a Slurm job run's by (job id, restart count); outside
    Slurm a process's by (None, its index), a new ``start``/``resume`` event beginning the next one."""
    groups: dict[tuple[str | None, int], list[dict[str, Any]]] = {}
    local = -1
    for record in records:
        key = _key(record)
        if key[0] is None:
            starts = record.get("kind") == "event" and record.get("event") in ("start", "resume")
            local += 1 if starts or local < 0 else 0
            key = (None, local)
        groups.setdefault(key, []).append(record)
    return groups


def _bounds(key: tuple[str | None, int], records: list[dict[str, Any]]) -> tuple[float, float] | None:
    """An allocation's start and end as its records tell: its first record's time, earlier by a trainer's
    `process_start` (outside Slurm, only its own start event's), to its last record's time."""
    timed = [(record, time) for record in records if (time := _num(record, "time")) is not None]
    if not timed:
        return None
    times = [time for _, time in timed]
    if key[0] is not None:
        begins = [_num(record, "process_start") or time for record, time in timed]
    else:
        first = timed[0][0]
        starts = first.get("kind") == "event" and first.get("event") in ("start", "resume")
        begins = [_num(first, "process_start") or times[0]] if starts else []
    return min([times[0], *begins]), max(times)


def record_allocations(records: Sequence[dict[str, Any]]) -> list[Allocation]:
    """Allocations as the records alone bound them: a Slurm job run from its driver's ``job_start`` (else
    its first record) to its last record; a process outside Slurm from its ``process_start`` to its last
    record (a new ``start``/``resume`` event is a new process)."""
    found = []
    for key, own in _processes(records).items():
        bounds = _bounds(key, own)
        if bounds is not None:
            found.append(Allocation(key[0], key[1], *bounds, "records"))
    return sorted(found, key=lambda a: a.start)


def merge_allocations(measured: Iterable[Allocation], records: Sequence[dict[str, Any]]) -> list[Allocation]:
    """Slurm's Start..End where it has one for a job run the records know, else the records' bounds."""
    by_key = {(a.job_id, a.restart): a for a in measured}
    merged = [by_key.get((a.job_id, a.restart), a) for a in record_allocations(records)]
    return sorted(merged, key=lambda a: a.start)


def build_ledger(
    records: Sequence[dict[str, Any]], allocations: Iterable[Allocation] | None = None
) -> Ledger:
    """The run's ledger: `records` are metrics.jsonl's in file order; `allocations` what Slurm measured
    (sacct), merged with what the records bound (`merge_allocations`)."""
    allocs = merge_allocations(allocations or (), records)
    high_water = [0]  # the furthest step any earlier window ran
    jobs: list[JobTime] = []
    groups = _processes(records)
    last_local = max((a.restart for a in allocs if a.job_id is None), default=0)
    for alloc in allocs:
        own = groups.get((alloc.job_id, alloc.restart), [])
        if alloc.job_id is None:
            spans = _process_spans(own, alloc.start, "startup", high_water)
            if alloc.restart < last_local and not _outcome(own):
                spans.append(_crashed_process_tail(spans, alloc))
        else:
            spans = _job_spans(own, alloc, high_water)
        jobs.append(JobTime(alloc, _lay_out(spans, alloc)))
    queue = sum(max(0.0, b.allocation.start - a.allocation.end) for a, b in zip(jobs, jobs[1:], strict=False))
    return Ledger(jobs, queue)


def _crashed_process_tail(spans: list[Span], alloc: Allocation) -> Span:
    """A process outside Slurm that a later one followed without its stop or end: it died. Its records
    after its last window (a step's line, a snapshot's event) are work it did not keep, lost."""
    last = max((s.end for s in spans), default=alloc.start)
    return Span(
        last,
        alloc.end,
        "lost",
        "after the last window: steps not kept, the process died",
        "a process followed by another without its stop: it died",
    )


def _job_spans(records: list[dict[str, Any]], alloc: Allocation, high_water: list[int]) -> list[Span]:
    """A Slurm job run: the driver's steps, each with the trainer's records of that step."""
    driver = [r for r in records if r.get("kind") == "job"]
    job_start = next((_num(r, "time") for r in driver if r.get("event") == "job_start"), None)
    spans: list[Span] = []
    cursor = alloc.start
    if job_start is not None:
        spans.append(Span(alloc.start, job_start, "startup", "batch script"))
        cursor = job_start
    steps = sorted({int(r.get("step_restart") or 0) for r in records})
    last_ended_well, last_closed = False, True
    for k in steps:
        own = [r for r in records if int(r.get("step_restart") or 0) == k and r.get("kind") != "job"]
        mine = [r for r in driver if int(r.get("step_restart") or 0) == k]
        began = next((_num(r, "time") for r in mine if r.get("event") == "step_start"), None)
        end_rec = next((r for r in mine if r.get("event") == "step_end"), None)
        ended = _num(end_rec, "time") if end_rec else None
        before = "startup" if k == 0 else "restart"
        if began is not None:
            spans.append(Span(cursor, began, before, "between job steps" if k else "driver"))
            cursor = began
        step_spans = _process_spans(own, cursor, before, high_water)
        spans += step_spans
        last = max((s.end for s in step_spans), default=cursor)
        outcome = _outcome(own)
        if ended is not None:
            if outcome:
                spans.append(Span(last, ended, "stop", "exit"))
            elif own or (end_rec or {}).get("exit_code") not in (0, None):
                spans += _failure_tail(last, ended, end_rec or {}, bool(own), before)
            cursor = ended
        else:
            cursor = last
        last_ended_well, last_closed = bool(outcome), ended is not None or not driver
    job_end = next((_num(r, "time") for r in driver if r.get("event") == "job_end"), None)
    if job_end is not None:
        after = "stop" if last_ended_well else "restart"
        spans.append(Span(cursor, job_end, after, "after the last job step"))
        cursor = job_end
    if alloc.source == "sacct" and not alloc.running and (driver or last_ended_well):
        bucket, detail = _allocation_tail(last_ended_well, last_closed)
        spans.append(Span(cursor, alloc.end, bucket, detail, f"the last record to Slurm's End: {detail}"))
    return spans


# The detail of a job run's tail to Slurm's End when its step never ended (verify confirms it by Slurm's
# State of the run: monitor/ledger_sources.py)
ENDED_INSIDE_STEP = "the job ended inside a step: its work since the last record"


def _allocation_tail(ended_well: bool, step_closed: bool) -> tuple[str, str]:
    """What the time from the job's last record to Slurm's End was: the exit after a stop; the decision
    and requeue after a failed step; or, when the step never ended (the driver was killed with its node,
    or the job cancelled), the step's work since its last record, lost."""
    if ended_well:
        return "stop", "job end"
    if step_closed:
        return "restart", "job end after a failed step"
    return "lost", ENDED_INSIDE_STEP


def _outcome(records: list[dict[str, Any]]) -> str:
    """`stop` or `finished` when the trainer ended the step itself, else ""."""
    for record in reversed(records):
        if record.get("kind") == "event" and record.get("event") in ("stop", "finished"):
            return str(record["event"])
    return ""


def _failure_tail(
    last: float, ended: float, end_rec: dict[str, Any], trained: bool, before: str
) -> list[Span]:
    hang = end_rec.get("hang") if isinstance(end_rec.get("hang"), dict) else None
    if not trained:  # it failed before its trainer recorded anything: start-up that came to nothing
        return [Span(last, ended, before, "failed start-up")]
    if hang is not None and _num(hang, "detected_at") is not None:
        detected = float(hang["detected_at"])
        idle = max(0.0, _num(hang, "idle_s") or 0.0)
        progress = max(last, detected - idle)
        return [
            Span(
                last,
                progress,
                "lost",
                "steps after the last record",
                "a hung step's last record to its progress",
            ),
            Span(progress, detected, "hang", "last progress to detection"),
            Span(detected, ended, "restart", "ending the hung step"),
        ]
    return [
        Span(
            last,
            ended,
            "lost",
            "after the last record: steps not kept, the failure's detection",
            "a failed step's last record to its end",
        )
    ]


def _process_spans(
    records: list[dict[str, Any]], cursor: float, before: str, high_water: list[int]
) -> list[Span]:
    """One trainer process: start-up, restore, its ledger windows (and each survivors' recovery between
    them: `_recovery_spans`), its stop."""
    spans: list[Span] = []
    starts = [r for r in records if r.get("kind") == "event" and r.get("event") in ("start", "resume")]
    start = starts[0] if starts else None
    if start is not None:
        restored_at = _num(start, "time") or cursor
        restore_start = _num(start, "restore_start") or restored_at
        tier = str(start.get("restored_from") or "")
        spans.append(Span(cursor, restore_start, before, "launch, imports, process group, model"))
        spans.append(Span(restore_start, restored_at, "restore" if tier else before, tier or "no state"))
        cursor = restored_at
    windows = [r for r in records if r.get("kind") == "ledger"]
    typical = _typical_step_s(windows)
    last_step = None
    resumed_in_place = {id(r) for r in starts[1:]}  # the same job step resumed: a lost rank replaced alone
    for index, record in enumerate(records):
        if record.get("kind") == "ledger":
            spans += _window(record, high_water, typical)
            cursor = max(cursor, window_end(record) or cursor)
            last_step = record.get("step")
        elif id(record) in resumed_in_place:
            later = itertools.islice(records, index, None)
            recovery = next((r for r in later if r.get("event") == "recovery"), None)
            spans += _recovery_spans(cursor, record, recovery)
            cursor = max(cursor, _num(record, "time") or cursor)
    end = next(
        (
            r
            for r in reversed(records)
            if r.get("kind") == "event" and r.get("event") in ("stop", "finished") and r is not start
        ),
        None,
    )
    if end is not None and (_num(end, "time") or 0) > cursor:
        # the trainer closes a window just before its stop's save (and at the loop's end): a stop after a
        # window of another step holds steps no window measured
        closed = last_step == end.get("step") or (
            not windows and start is not None and start.get("step") == end.get("step")
        )
        rule = "" if closed else f"a stop at step {end.get('step')} that no window of that step closed"
        spans.append(Span(cursor, float(end["time"]), "stop", str(end.get("reason") or end["event"]), rule))
    return spans


def _recovery_spans(cursor: float, resume: dict[str, Any], recovery: dict[str, Any] | None) -> list[Span]:
    """A `resume` inside a job step (resilience.survivors: the ranks stayed, a replacement took the lost
    rank's place): from the last window to the fault, steps not kept (lost); from the fault (the
    `recovery` event's time less its `fault_to_step_s`) to the restore, the detection and the new round's
    process group (restart); then the restore. Without a recovery event (the run ended before the
    redone step), the fault is not known: the whole wait is restart, by rule."""
    restored_at = _num(resume, "time") or cursor
    restore_start = min(_num(resume, "restore_start") or restored_at, restored_at)
    fault = None
    if recovery is not None and _num(recovery, "time") is not None:
        fault = float(recovery["time"]) - (_num(recovery, "fault_to_step_s") or 0.0)
    rule = "" if fault is not None else "a resume inside a job step without its recovery event"
    fault = min(max(cursor, fault if fault is not None else cursor), restore_start)
    tier = str(resume.get("restored_from") or "")
    return [
        Span(cursor, fault, "lost", "a lost rank: steps after the last record, not kept"),
        Span(fault, restore_start, "restart", "a lost rank replaced: detection, the new process group", rule),
        Span(restore_start, restored_at, "restore" if tier else "restart", tier or "no state"),
    ]


def window_end(record: dict[str, Any]) -> float | None:
    """When a ledger window ended: its `until` (records before it: the record's own time, its write)."""
    window = record.get("window") if isinstance(record.get("window"), dict) else {}
    return _num(window, "until") or _num(record, "time")


def _typical_step_s(windows: list[dict[str, Any]]) -> float | None:
    """The median step time of a process's windows other than its first step's (None: no other)."""
    per_step = []
    for record in windows:
        window, seconds = record.get("window") or {}, record.get("seconds") or {}
        if not isinstance(window, dict) or not isinstance(seconds, dict) or window.get("first_step"):
            continue
        since, end = _num(window, "since"), window_end(record)
        if since is None or end is None:
            continue
        count = max(1, int(record["step"]) - int(window.get("from_step") or record["step"]) + 1)
        parts = sum(max(0.0, _num(seconds, name) or 0.0) for name in WINDOW_PARTS)
        per_step.append(max(0.0, end - since - parts) / count)
    return statistics.median(per_step) if per_step else None


def _window(record: dict[str, Any], high_water: list[int], typical: float | None = None) -> list[Span]:
    """A ledger window's seconds as spans laid end to end from its `since` (positions approximate within
    the window, seconds exact). The process's first step beyond a `typical` step is start-up."""
    seconds = record.get("seconds") if isinstance(record.get("seconds"), dict) else {}
    window = record.get("window") if isinstance(record.get("window"), dict) else {}
    end = window_end(record)
    since = _num(window, "since")
    if end is None or since is None:
        return []
    first, last = int(window.get("from_step") or record["step"]), int(record["step"])
    count = max(1, last - first + 1)
    replays = min(count, max(0, high_water[0] - first + 1)) if last >= first else 0
    high_water[0] = max(high_water[0], last)
    parts = {name: max(0.0, _num(seconds, name) or 0.0) for name in WINDOW_PARTS}
    steps = max(0.0, (end - since) - sum(parts.values()))
    warmup = 0.0
    if window.get("first_step") and typical is not None and count == 1:
        warmup = max(0.0, steps - typical)
        steps -= warmup
    order = [
        ("startup", warmup, "first step beyond a typical one: compilation, first allocations"),
        ("replayed", steps * replays / count, f"steps {first}-{first + replays - 1}"),
        ("productive", steps * (count - replays) / count, f"steps {first + replays}-{last}"),
        ("snapshot", parts["snapshot_slowdown"], "steps slowed by background work"),
        ("snapshot", parts["snapshot"], "blocking copy"),
        ("checkpoint", parts["checkpoint"], "blocking save"),
        ("eval", parts["eval"], ""),
    ]
    spans, at = [], since
    for bucket, secs, detail in order:
        if secs > 0:
            spans.append(Span(at, at + secs, bucket, detail))
            at += secs
    return spans


def _lay_out(spans: list[Span], alloc: Allocation) -> list[Span]:
    """The spans clipped to the allocation and to each other, in time order, the gaps as unaccounted."""
    out: list[Span] = []
    at = alloc.start
    for span in spans:
        start, end = max(span.start, at), min(span.end, alloc.end)
        if end <= start:
            continue
        if start > at:
            out.append(Span(at, start, "unaccounted"))
        out.append(Span(start, end, span.bucket, span.detail, span.inferred))
        at = end
    if alloc.end > at:
        out.append(Span(at, alloc.end, "unaccounted"))
    return out
