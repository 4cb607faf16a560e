"""The trainer processes in a run's metrics.jsonl, one walk for every check that reads them by process.

A process is one job step of one job run (outside Slurm, one start of the trainer): its ``start`` or
``resume`` event begins it, and the records that follow with its (job id, restart, step restart) are its
own. `relaytrain verify`'s ledger checks read it: the windows against each other
(monitor/ledger_check.py), the logged steps against the windows (monitor/ledger_sources.py) and the
steps' time against the train records' (monitor/ledger_steps.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from relaytrain.monitor.ledger_spans import window_end


def _num(record: dict[str, Any], key: str) -> float | None:
    value = record.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class Window:
    """One `ledger` record: steps `first`..`last`, from `since` to `until` (None: not in the record)."""

    first: int
    last: int
    since: float | None
    until: float | None


@dataclass
class Process:
    key: tuple  # (job id, restart, step restart)
    alloc: tuple  # its allocation's key in the ledger: (job id, restart), outside Slurm (None, its index)
    begin: Any  # the step its start/resume event names (an int, unless the record is damaged)
    windows: list[Window] = field(default_factory=list)
    train: list[dict[str, Any]] = field(default_factory=list)  # its `train` records with an int step
    ended: bool = False  # its `stop` or `finished` event came
    rollback: bool = False  # it rolled back after a NaN: its train records' steps repeat

    @property
    def job(self) -> str | None:
        return self.key[0]


def processes(records: Sequence[dict[str, Any]]) -> list[Process]:
    """The trainer processes of `records` (metrics.jsonl's, in file order), in the order they began;
    records before any start event of their process are left out."""
    found: list[Process] = []
    current: dict[tuple, Process] = {}
    local = -1
    for record in records:
        job = record.get("job_id")
        key = (job, int(record.get("restart") or 0), int(record.get("step_restart") or 0))
        kind = record.get("kind", "train")
        if kind == "event" and record.get("event") in ("start", "resume"):
            local += job is None
            current[key] = Process(
                key, (job, key[1]) if job is not None else (None, local), record.get("step")
            )
            found.append(current[key])
            continue
        proc = current.get(key)
        if proc is None:
            continue
        window = record.get("window")
        if kind == "ledger" and isinstance(window, dict) and isinstance(record.get("step"), int):
            last = record["step"]
            first = int(window.get("from_step") or last)
            proc.windows.append(Window(first, last, _num(window, "since"), window_end(record)))
        elif kind == "train" and isinstance(record.get("step"), int):
            proc.train.append(record)
        elif kind == "event" and record.get("event") in ("stop", "finished"):
            proc.ended = True
        elif kind == "event" and record.get("event") == "rollback":
            proc.rollback = True
    return found
