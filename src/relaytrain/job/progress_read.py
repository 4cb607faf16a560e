"""Reading the progress board (``job/progress.py``): the hang watcher's side, in another process than the
ranks that write it. A record torn by a write under way is read again (the sequence lock)."""

from __future__ import annotations

import mmap
import time
from pathlib import Path

from relaytrain.job.progress import _BODY, _HEAD, MAGIC, SIZE, VERSION, Phase, ProgressRecord


def read_record(path: Path, attempts: int = 50) -> ProgressRecord | None:
    """One rank's record, or None (missing, foreign or torn through every attempt)."""
    try:
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    with m:
        if len(m) < SIZE:
            return None
        for _ in range(attempts):
            magic, version, seq = _HEAD.unpack_from(m, 0)
            if magic != MAGIC or version != VERSION:
                return None
            if seq % 2:
                time.sleep(0.0005)
                continue
            body = _BODY.unpack_from(m, _HEAD.size)
            if _HEAD.unpack_from(m, 0)[2] == seq:
                return _record(body)
    return None


def read_board(directory: Path) -> list[ProgressRecord]:
    """Every rank's record in ``directory``, by rank."""
    try:
        paths = sorted(directory.glob("rank*"))
    except OSError:
        return []
    records = [r for r in (read_record(p) for p in paths) if r is not None]
    return sorted(records, key=lambda r: r.rank)


def _record(body: tuple) -> ProgressRecord:
    (
        rank,
        local_rank,
        pid,
        step,
        phase,
        started,
        updated,
        budget,
        entered,
        left,
        name,
        expected,
        step_coll,
        last_coll,
        usual,
        marks,
        *rest,
    ) = body
    medians, pauses = rest[: len(Phase)], rest[len(Phase) :]
    return ProgressRecord(
        rank=rank,
        local_rank=local_rank,
        pid=pid,
        step=step,
        phase=Phase(phase),
        phase_started=started,
        updated=updated,
        budget_s=budget,
        collectives_entered=entered,
        collectives_left=left,
        collective=name.rstrip(b"\0").decode(errors="replace"),
        expected_collective=expected.rstrip(b"\0").decode(errors="replace"),
        step_collectives=step_coll,
        last_step_collectives=last_coll,
        usual_step_collectives=usual,
        medians={p: v for p, v in zip(Phase, medians, strict=True) if v > 0},
        marks=marks,
        pauses={p: v for p, v in zip(Phase, pauses, strict=True) if v > 0},
    )
