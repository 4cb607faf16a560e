"""The one way relaytrain writes and reads a run's JSON Lines files, and the event record.

A run has these: `metrics.jsonl` (the trainer's metrics logger, `relaytrain.program`, the end-of-step
decision), `crashes.jsonl` (the end-of-step decision) and `slurm/jobs.jsonl` (`launch`, `sweep`,
`chain`), and one sample record per rank (`samples/rank_<r>.jsonl`, data/consumption.py); `RunDir`
names them. Several processes append to one file across jobs, so a record is one
`os.write` of one whole line on a descriptor opened with O_APPEND: it lands after everything written
before, in one piece, and is in the file (not in a buffer) once `append` returns. A process killed
while writing can still leave a torn last line; readers skip lines that are not a JSON object and
count them, so one bad line never hides the rest of a run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relaytrain.job.rundir import RunDir, metrics_record

TAIL_BYTES = 65536  # enough for the last records of a metrics log, or the last step of a job's output


def encode(record: Mapping[str, Any], *, sort_keys: bool = False) -> bytes:
    """One line: the record as strict JSON (no NaN: other readers would reject the file) and a newline."""
    return (json.dumps(dict(record), allow_nan=False, sort_keys=sort_keys) + "\n").encode("utf-8")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:  # one call writes a line of any size a run writes; the loop only guards the exception
        view = view[os.write(fd, view) :]


def _open_append(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)


def _after_torn_line(fd: int) -> bytes:
    """A newline when the file ends inside a line (its writer was killed mid-write): the next record then
    starts on a line of its own instead of being glued to the torn one and lost with it."""
    size = os.fstat(fd).st_size
    return b"\n" if size and os.pread(fd, 1, size - 1) != b"\n" else b""


def append(path: Path, record: Mapping[str, Any], *, sort_keys: bool = False) -> None:
    """Append one record as one line. Raises OSError (a full or read-only disk): the caller decides
    whether losing the line matters."""
    data = encode(record, sort_keys=sort_keys)  # before the file is touched: a NaN writes nothing
    fd = _open_append(path)
    try:
        _write_all(fd, _after_torn_line(fd) + data)
    finally:
        os.close(fd)


class Appender:
    """`append` on a file held open, for a writer of many lines (the metrics logger: one per step)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = _open_append(path)
        self._start = _after_torn_line(self._fd)  # only this process writes it while it is open

    def write(self, record: Mapping[str, Any]) -> None:
        assert self._fd is not None, f"{self.path} is closed"
        data, self._start = self._start + encode(record), b""
        _write_all(self._fd, data)

    def close(self) -> None:
        """Closes after an fsync: the lines survive the node's crash, not only the process's."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


@dataclass(frozen=True)
class Records:
    """The JSON objects of a file in file order, and how many non-empty lines were not one."""

    records: list[dict[str, Any]]
    skipped: int = 0


def parse(lines: Iterable[str]) -> Records:
    records, skipped = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            skipped += 1
    return Records(records, skipped)


def read(path: Path) -> Records:
    """Every record of the file (none when it does not exist); a torn or foreign line is skipped."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return Records([])
    return parse(text.splitlines())


def tail_text(path: Path, size: int = TAIL_BYTES) -> str:
    """The last ``size`` bytes of a file as text ("" when it cannot be read): a job's output, a log."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def tail(path: Path, size: int = TAIL_BYTES) -> list[dict[str, Any]]:
    """The records in the last ``size`` bytes of a file, oldest first. The line the window cuts is skipped
    like a torn one: the end of a one-line JSON object is never a JSON object itself."""
    return parse(tail_text(path, size).splitlines()).records


def read_from(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The records of the whole lines after byte ``offset`` and the offset after the last of them, for a
    reader that follows a file as it grows (the batch driver's alerts). A line still being written waits
    for the next call; a file that shrank (replaced) is read from its start."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            offset = 0 if size < offset else offset
            f.seek(offset)
            data = f.read(size - offset)
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    return parse(data[:end].decode(errors="replace").splitlines()).records, offset + end


def event_record(event: str, step: int, fields: Mapping[str, Any]) -> dict[str, Any]:
    """A `metrics.jsonl` event: ``kind`` "event", ``step``, time, the job's identity, ``event``, fields."""
    return metrics_record("event", step, {"event": event, **fields})


def append_job_record(run: RunDir, event: str, **fields: Any) -> dict[str, Any]:
    """Append a `job` record (``kind`` "job", ``event``, fields) to the run's `metrics.jsonl`: what the batch
    job's driver did and when (its start and end, each job step's), for the time ledger. Raises OSError."""
    record = metrics_record("job", 0, {"event": event, **fields})
    append(run.metrics, record)
    return record


def append_event(run: RunDir, event: str, step: int, **fields: Any) -> dict[str, Any]:
    """Append an event to the run's `metrics.jsonl` (for writers without a metrics logger: a program, the
    end-of-step decision). Returns the record; raises OSError like `append`."""
    record = event_record(event, step, fields)
    append(run.metrics, record)
    return record
