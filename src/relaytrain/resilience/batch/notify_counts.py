"""`relaytrain status`'s alerts: the counts the batch job's driver records when each job ends (a ``notify``
job record in metrics.jsonl: sent, failed, dropped, unsent, retries; notify.py), summed over the run's
jobs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

from relaytrain.resilience.batch.notify_send import Counts

COUNTS = tuple(f.name for f in fields(Counts))


def run_counts(records: Iterable[Mapping[str, Any]]) -> dict[str, int] | None:
    """The counts of every job's alerts and how many jobs recorded them; None when no job sent any."""
    jobs = [r for r in records if r.get("kind") == "job" and r.get("event") == "notify"]
    if not jobs:
        return None
    total = dict.fromkeys(COUNTS, 0)
    for record in jobs:
        for key in COUNTS:
            value = record.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                total[key] += value
    return {**total, "jobs": len(jobs)}


def describe(counts: Mapping[str, int]) -> str:
    """`5 sent, 1 failed, 0 dropped, 0 unsent, 2 retries (2 jobs)`."""
    told = ", ".join(f"{counts[key]} {key}" for key in COUNTS)
    return f"{told} ({counts['jobs']} job{'s' if counts['jobs'] != 1 else ''})"
