"""The last hang the job's hang monitor detected: ``<run_dir>/hang/last.json`` (``RunDir.hang_record``).

The monitor (in the batch job's driver) writes it when it detects a hang, before it has the hung ranks
killed; the end-of-step decision after that step reads it back (``for_step``) to say in crashes.jsonl,
run_state.json and ``relaytrain status`` that the crash was a hang, and which rank(s) and node(s) held
the others. The file lives in a shared run directory that anything may have written: ``read`` takes it
as hostile input (size-capped, strict JSON, every field type-checked) and answers None for anything but
a well-formed record, never a traceback.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import asdict, dataclass
from typing import Any

from relaytrain.atomic import write_atomic
from relaytrain.job import JobFacts, RunDir

# A record names a few culprits and one line: far below this. A bigger file is not one of ours.
MAX_RECORD_BYTES = 256 * 1024
CULPRIT_KEYS = ("rank", "node", "phase", "why")


@dataclass(frozen=True)
class HangRecord:
    job_id: str  # the Slurm job whose step hung
    step_restarts: int  # which step of the job (RELAYTRAIN_STEP_RESTARTS of the hung step)
    step: int  # the training step the ranks were at
    detected_at: float  # unix seconds
    idle_s: float  # how long no rank had moved when it was detected
    limit_s: float  # the limit it passed (the largest phase limit over the ranks)
    culprits: tuple[dict[str, Any], ...]  # each {"rank": int, "node": str, "phase": str, "why": str}
    line: str  # the job log's `hang detected: ...` line
    report: str  # the report's path relative to the run dir (logs/hang-step<N>.md)
    # SLURM_RESTART_COUNT of the hung step: a requeued job starts its step restarts at 0 again, so job id
    # and step restarts alone would match a hang of the run before the requeue. None: not recorded.
    restart_count: int | None = None

    @property
    def culprit_nodes(self) -> tuple[str, ...]:
        """The nodes of the culprits, each once, in the culprits' order."""
        return tuple(dict.fromkeys(str(c["node"]) for c in self.culprits))

    def as_json(self) -> dict[str, Any]:
        record = asdict(self)
        record["culprits"] = [dict(c) for c in self.culprits]
        return record

    @classmethod
    def from_json(cls, data: object) -> HangRecord | None:
        """The record ``data`` (parsed JSON) holds, or None when it is not exactly a record's shape."""
        if not isinstance(data, dict):
            return None
        strings = ("job_id", "line", "report")
        ints = ("step_restarts", "step")
        numbers = ("detected_at", "idle_s", "limit_s")
        if not all(isinstance(data.get(key), str) for key in strings):
            return None
        if not all(_is_int(data.get(key)) for key in ints):
            return None
        if not all(_is_number(data.get(key)) for key in numbers):
            return None
        restart_count = data.get("restart_count")
        if restart_count is not None and not _is_int(restart_count):
            return None
        culprits = data.get("culprits")
        if not isinstance(culprits, list) or not all(_is_culprit(c) for c in culprits):
            return None
        return cls(
            job_id=data["job_id"],
            step_restarts=data["step_restarts"],
            step=data["step"],
            detected_at=float(data["detected_at"]),
            idle_s=float(data["idle_s"]),
            limit_s=float(data["limit_s"]),
            culprits=tuple({key: c[key] for key in CULPRIT_KEYS} for c in culprits),
            line=data["line"],
            report=data["report"],
            restart_count=restart_count,
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)  # type: ignore[arg-type]


def _is_culprit(value: object) -> bool:
    return (
        isinstance(value, dict)
        and _is_int(value.get("rank"))
        and all(isinstance(value.get(key), str) for key in ("node", "phase", "why"))
    )


class HangRecordFile:
    """``<run_dir>/hang/last.json``: one record, replaced whole by each hang."""

    def __init__(self, run: RunDir):
        self.path = run.hang_record

    def write(self, record: HangRecord) -> None:
        """Atomically: a reader sees the previous record or this one, never a part. Raises OSError."""
        text = json.dumps(record.as_json(), allow_nan=False, indent=1, sort_keys=True) + "\n"
        write_atomic(self.path, text, durable=False)

    def read(self) -> HangRecord | None:
        """The record, or None: no file, an unreadable, oversized or damaged one, or not a record."""
        try:
            # non-blocking, and only a regular file: a FIFO in its place must not stall the decision
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:  # missing, no permission
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a directory, a FIFO, a device
                return None
            with os.fdopen(fd, "rb", closefd=False) as f:
                raw = f.read(MAX_RECORD_BYTES + 1)
        except OSError:
            return None
        finally:
            os.close(fd)
        if len(raw) > MAX_RECORD_BYTES:
            return None
        try:
            data = json.loads(raw.decode("utf-8"))  # NaN and Infinity: _is_number refuses them
        except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: nesting thousands deep
            return None
        return HangRecord.from_json(data)

    def for_step(self, job: JobFacts) -> HangRecord | None:
        """The record when it is of the job step that just ended (``job``'s id and restart in place, and
        its requeue count where the record has one), else None: a hang of an earlier step or job says
        nothing about this one."""
        record = self.read()
        if record is None or (record.job_id, record.step_restarts) != (job.job_id, job.step_restarts):
            return None
        if record.restart_count is not None and record.restart_count != job.restart_count:
            return None
        return record
