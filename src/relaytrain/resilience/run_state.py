"""``<run_dir>/run_state.json``: the run's state and the requeue decision, written by rank 0.

Exit codes do not survive launchers (after a stop signal torchrun's says which signal it got, not what
its workers returned),
so whoever needs to know how the run ended (the batch script's requeue fallback, a stale requeue of
a finished run, a human) reads this file. The JSON is written atomically, one key per line with sorted
keys, so a shell can test ``grep -q '"requeue_pending": true'`` without a JSON parser.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from relaytrain.job import RunDir

log = logging.getLogger(__name__)

RUN_STATE_FILE = RunDir(Path()).run_state.name  # for messages; the path is RunDir.run_state
STATUSES = ("running", "stopped", "finished", "failed")
# The main thread, the hard deadline and the hang watchdog may write at the same time: one writer at a
# time, each through its own temporary file. A writer stuck on a dead filesystem must not keep the
# others (which exit right after) from writing, hence the timeout.
_WRITE_LOCK = threading.Lock()
_WRITE_LOCK_WAIT_S = 30.0
# The step of the newest checkpoint the run is known to have: the one it resumed from (mark_running) or the
# last one it committed (note_checkpoint). Evidence of checkpointed progress, which a later start must not
# silently throw away when no checkpoint loads; every other record (a stop, a crash, the end) keeps it.
CHECKPOINT_STEP = "checkpoint_step"
_CARRIED_KEYS = (CHECKPOINT_STEP,)


class RunStateFile:
    def __init__(self, run_dir: Path | str):
        self.path = RunDir(Path(run_dir)).run_state

    def read(self) -> dict[str, Any] | None:
        """The last written state, or None when there is none (or it is unreadable)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def write(self, status: str, reason: str, step: int, **extra: Any) -> dict[str, Any]:
        """Replace the state. ``extra`` adds keys (job_id, restart_count, requeue_requested, ...); the
        carried keys (``checkpoint_step``) keep their previous value unless ``extra`` sets them."""
        if status not in STATUSES:
            raise ValueError(f"run state status must be one of {STATUSES}, got {status!r}")
        now = time.time()
        state: dict[str, Any] = {
            "status": status,
            "reason": reason,
            "step": int(step),
            "time": datetime.fromtimestamp(now).astimezone().isoformat(timespec="seconds"),
            "unix_time": round(now, 3),
            "host": socket.gethostname(),
            "requeue_requested": False,
            "requeue_pending": False,
            "requeued": False,
        }

        def replace(previous: dict[str, Any]) -> dict[str, Any]:
            return {**state, **{k: previous[k] for k in _CARRIED_KEYS if k in previous}, **extra}

        return self._rewrite(replace)

    def note_checkpoint(self, step: int) -> None:
        """The run committed the checkpoint of `step`: the record says so, the rest of it unchanged. A
        failed write is logged, not raised: the checkpoint is committed all the same, training goes on."""
        try:
            self._rewrite(lambda previous: {**previous, CHECKPOINT_STEP: int(step)})
        except OSError as exc:
            log.warning("could not note the checkpoint of step %d in %s: %s", step, self.path, exc)

    def _rewrite(self, make: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
        """Write ``make(the previous record)``; reading and writing under one lock, so that a record another
        thread writes meanwhile (the hard deadline's stop) is never overwritten by a stale copy."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        locked = _WRITE_LOCK.acquire(timeout=_WRITE_LOCK_WAIT_S)
        try:
            state = make(self.read() or {})
            tmp.write_text(json.dumps(state, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            os.replace(tmp, self.path)
        finally:
            if locked:
                _WRITE_LOCK.release()
        return state


def recorded_checkpoint_step(run_dir: Path | str) -> int:
    """The step of the newest checkpoint run_state.json says the run has (0: none recorded)."""
    value = (RunStateFile(run_dir).read() or {}).get(CHECKPOINT_STEP, 0)
    return value if isinstance(value, int) and value > 0 else 0
