"""A run's `rank_times` records read back for the straggler benchmarks: the gathered rows of each window
(``straggler_watch._times_record`` undone), each rank's pipeline stage, and whether a phase was timed.
Records kept before a phase was timed have no column of it (``ADDED_PHASES``): the replay reads 0 s there,
which the judge leaves out, as that run's judge had nothing of it to compare."""

from __future__ import annotations

from typing import Any

from relaytrain.resilience.rank.straggler import MIN_PHASE_S
from relaytrain.resilience.rank.straggler_watch import RECORD_COLUMNS

# phases timed since the record began: a run recorded before one was timed has no column of it
ADDED_PHASES = ("forward",)


def phase_timed(records: list[dict[str, Any]], phase: str) -> bool:
    """Whether a run's `rank_times` records show ``phase`` timed: a phase of ``ADDED_PHASES`` is missing
    from records kept before it was timed, and 0 where the run could not time it."""
    return any(float(r.get(f"rank0_{phase}_s") or 0) >= MIN_PHASE_S for r in records)


def stages_from_record(record: dict[str, Any]) -> list[int] | None:
    """Each rank's pipeline stage as a window's `rank_times` record keeps it (None: one stage)."""
    stages = record.get("stages")
    return [int(s) for s in stages] if stages is not None else None


def matrix_from_record(record: dict[str, Any], ranks: int) -> list[list[float]]:
    """A window's gathered rows back from its `rank_times` record; 0 s for a phase of ``ADDED_PHASES``
    the record has no column of; KeyError for any other column it lacks."""

    def value(rank: int, column: str) -> float:
        key = f"rank{rank}_{column}_s"
        if key not in record and column.removesuffix("_fastest") in ADDED_PHASES:
            return 0.0
        return float(record[key])

    return [[value(rank, column) for column in RECORD_COLUMNS] for rank in range(ranks)]


def niceness(data: dict) -> str:
    """The niceness a kept straggler run's bench (and its busy processes) and ranks ran at; results kept
    before it was recorded: "" (all ran at the default, 0)."""
    if "nice" not in data:
        return ""
    ranks = sorted({n for t in data["trials"] for n in t.get("nice", {}).values()})
    said = f"the bench and its busy processes at nice {data['nice']}"
    return said + (f", the ranks (started by Slurm) at nice {', '.join(map(str, ranks))}" if ranks else "")
