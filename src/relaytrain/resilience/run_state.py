"""``<run_dir>/run_state.json``: how the run's last job stopped and the requeue decision, as a typed record.

Exit codes do not survive launchers (after a stop signal torchrun's says which signal it got, not what
its workers returned), so whoever needs to know how the run ended (the end-of-step decision, a stale
requeue of a finished run, ``relaytrain status``, a program's ``previous_stop()``, a human) reads this
file. This module is its one reader and writer: ``RunState`` is what it holds, ``RunStatus`` its
status. The JSON is written atomically, one key per line with sorted keys; its field names and values
are a contract (docs/resilience.md), and a file written by an earlier version still reads.
"""

from __future__ import annotations

import ast
import enum
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from relaytrain.atomic import write_atomic
from relaytrain.errors import UserError
from relaytrain.job import JobFacts, RunDir

log = logging.getLogger(__name__)

RUN_STATE_FILE = RunDir(Path()).run_state.name  # for messages; the path is RunDir.run_state
# The main thread, the hard deadline and the hang watchdog may write at the same time: one writer at a
# time, each through its own temporary file. A writer stuck on a dead filesystem must not keep the
# others (which exit right after) from writing, hence the timeout.
_WRITE_LOCK = threading.Lock()
_WRITE_LOCK_WAIT_S = 30.0
_MAX_BYTES = 1 << 20  # a record is a few hundred bytes: a larger file is not one relaytrain wrote
_OLD_USER_ERROR_PREFIX = "UserError("  # before `user_error`, the message was repr(UserError(text))


class RunStatus(enum.StrEnum):
    """A run's status; the values are what run_state.json holds."""

    RUNNING = "running"  # training (or loading its checkpoint); a crash leaves this behind
    STOPPED = "stopped"  # a resumable stop: time limit, preemption, cancel, Ctrl-C, a program's exit 75
    FINISHED = "finished"  # train.max_steps reached, or a program's finish()
    FAILED = "failed"  # an error, a hang, NaN, a damaged checkpoint, a crash the end of the step recorded


class RunStateError(UserError):
    """run_state.json exists but is not a record relaytrain wrote (damaged, or another program's file)."""


@dataclass(frozen=True)
class RunState:
    """One run_state.json. ``facts`` holds every other field as written (job identity, exit code, saved,
    the crash's cause, ...): the writers add facts the record does not need to know."""

    status: RunStatus
    reason: str = ""  # a StopReason label, "max_steps", "crash", "crash_loop", "program_exit"
    step: int = 0  # the step the run had reached (-1: a program's stop whose step nobody knew)
    message: str | None = None  # what happened, for a human (None: no message field)
    # The message of an error the user must fix (a full disk during a save, an impossible layout): a
    # deterministic failure the end of the step does not retry. "" when the run did not fail with one.
    user_error: str = ""
    requeue_requested: bool = False  # the policy asked for a requeue
    requeue_pending: bool = False  # ... and it was not done yet: the batch job's driver does it
    requeued: bool = False  # `scontrol requeue` succeeded
    # The newest checkpoint the run is known to have: the one it resumed from (``running``) or the last
    # one it committed. A later start that loads none must not silently throw it away; every rewrite
    # carries it (None: none recorded).
    checkpoint_step: int | None = None
    time: str = ""  # when it was written, local time (``write`` sets it, with ``unix_time`` and ``host``)
    unix_time: float = 0.0
    host: str = ""
    facts: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, status: RunStatus | str, reason: str, step: int, **written: Any) -> RunState:
        """A record from its fields as run_state.json names them (typed ones are taken out of ``written``,
        the rest become ``facts``). A status that is not a RunStatus value is a ValueError."""
        typed = {f.name for f in fields(cls)} - {"status", "reason", "step", "facts"}
        known = {k: v for k, v in written.items() if k in typed}
        facts = {k: v for k, v in written.items() if k not in typed}
        return cls(RunStatus(status), str(reason), int(step), **known, facts=facts)

    @classmethod
    def from_json(cls, data: object) -> RunState:
        """The record a parsed run_state.json holds; a RunStateError names the first field that is wrong.
        Tolerant of files from earlier versions: a missing field takes its default, and an error that was
        recorded only as ``repr(UserError(...))`` in ``message`` becomes ``user_error``."""
        if not isinstance(data, dict):
            raise RunStateError(f"not a JSON object but {type(data).__name__}")
        status = data.get("status")
        if status not in tuple(RunStatus):
            allowed = ", ".join(s.value for s in RunStatus)
            raise RunStateError(f"status {status!r} is not one of {allowed}")
        typed = {f.name for f in fields(cls)} - {"status", "facts"}
        for name in typed & data.keys():
            value, kinds = data[name], _TYPES[name]
            if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
                wanted = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
                raise RunStateError(f"field {name!r} is {value!r:.80}, not {wanted}")
        facts = {k: v for k, v in data.items() if k not in typed and k != "status"}
        record = cls(RunStatus(status), **{k: data[k] for k in typed & data.keys()}, facts=facts)
        if not record.user_error and record.message and record.message.startswith(_OLD_USER_ERROR_PREFIX):
            record = replace(record, user_error=_old_user_error(record.message))
        return record

    def as_json(self) -> dict[str, Any]:
        """The JSON object written; ``message``, ``user_error`` and ``checkpoint_step`` only
        when set, as earlier versions wrote them."""
        out = {**self.facts}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "facts" or value is None or (f.name == "user_error" and not value):
                continue
            out[f.name] = value.value if isinstance(value, RunStatus) else value
        return out

    def written_by(self, job: JobFacts) -> bool:
        """Whether this job step (job id, requeue count, restart in place) wrote the record."""
        return job.wrote(self.facts)

    def pending_for(self, job: JobFacts) -> bool:
        """Whether the requeue this record calls pending is still to do for ``job``. Not once the same job
        runs again after a requeue (a higher SLURM_RESTART_COUNT): the requeue happened after all. That is
        how `scontrol requeue` fails when Slurm's SIGTERM to the requeued job's processes kills scontrol
        before it reports the requeue it asked for."""
        return self.requeue_pending and not job.requeued_since(self.facts)

    def fact(self, key: str, default: Any = None) -> Any:
        return self.facts.get(key, default)


_TYPES: dict[str, tuple[type, ...]] = {
    "reason": (str,),
    "step": (int,),
    "message": (str, type(None)),
    "user_error": (str,),
    "requeue_requested": (bool,),
    "requeue_pending": (bool,),
    "requeued": (bool,),
    "checkpoint_step": (int, type(None)),
    "time": (str,),
    "unix_time": (int, float),
    "host": (str,),
}


def _old_user_error(message: str) -> str:
    """``UserError('text')`` -> ``text`` (the whole message when it is not such a repr)."""
    try:
        call = ast.parse(message, mode="eval").body
        if isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.Constant):
            return str(call.args[0].value)
    except (SyntaxError, ValueError):
        pass
    return message


class RunStateFile:
    def __init__(self, run: RunDir):
        self.path = run.run_state

    def load(self) -> RunState | None:
        """The last written record, None when there is none yet; a RunStateError (one line naming the file
        and what is wrong with it) when the file is damaged or not relaytrain's."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read(_MAX_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._damaged(exc.strerror or str(exc)) from None
        try:
            if len(raw) > _MAX_BYTES:
                raise RunStateError(f"larger than {_MAX_BYTES} bytes")
            try:
                data = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as exc:
                raise RunStateError(f"not JSON: {exc}") from None
            return RunState.from_json(data)
        except RunStateError as exc:
            raise self._damaged(str(exc)) from None

    def read(self) -> RunState | None:
        """The last written record, or None when there is none or it is damaged (``damage()`` says why):
        for the run itself, which rewrites a damaged record, and for decisions that treat it as unknown."""
        try:
            return self.load()
        except RunStateError:
            return None

    def damage(self) -> str:
        """Why the file cannot be read ("" when it is fine or not there yet)."""
        try:
            self.load()
        except RunStateError as exc:
            return str(exc)
        return ""

    def _damaged(self, why: str) -> RunStateError:
        return RunStateError(
            f"{self.path} is damaged ({why}); the run's state is unknown (its checkpoints are not affected: "
            "the next start rewrites the file)"
        )

    def write(self, record: RunState) -> RunState:
        """Replace the record with ``record``. A new record (no ``time``) is stamped with the time and host;
        one read back keeps when and where it was written. ``checkpoint_step`` keeps its previous value
        unless ``record`` sets it. Returns what was written."""
        stamped = _stamped(record)

        def carry(previous: RunState | None) -> RunState:
            if stamped.checkpoint_step is None and previous is not None:
                return replace(stamped, checkpoint_step=previous.checkpoint_step)
            return stamped

        return self._rewrite(carry)

    def note_checkpoint(self, step: int) -> None:
        """The run committed the checkpoint of `step`: the record says so, the rest of it unchanged. A
        failed write is logged, not raised: the checkpoint is committed all the same, training goes on."""

        def noted(previous: RunState | None) -> RunState:
            return replace(previous or _stamped(RunState(RunStatus.RUNNING)), checkpoint_step=int(step))

        try:
            self._rewrite(noted)
        except OSError as exc:
            log.warning("could not note the checkpoint of step %d in %s: %s", step, self.path, exc)

    def _rewrite(self, make: Callable[[RunState | None], RunState]) -> RunState:
        """Write ``make(the previous record)``; reading and writing under one lock, so that a record another
        thread writes meanwhile (the hard deadline's stop) is never overwritten by a stale copy."""
        locked = _WRITE_LOCK.acquire(timeout=_WRITE_LOCK_WAIT_S)
        try:
            record = make(self.read())
            write_atomic(
                self.path, json.dumps(record.as_json(), indent=1, sort_keys=True) + "\n", durable=False
            )
        finally:
            if locked:
                _WRITE_LOCK.release()
        return record


def _stamped(record: RunState) -> RunState:
    """A new record (no ``time``) with the time and host it is written at; one read back as it is."""
    if record.time:
        return record
    now = time.time()
    when = datetime.fromtimestamp(now).astimezone().isoformat(timespec="seconds")
    return replace(record, time=when, unix_time=round(now, 3), host=socket.gethostname())


def recorded_checkpoint_step(run: RunDir) -> int:
    """The step of the newest checkpoint run_state.json says the run has (0: none recorded)."""
    record = RunStateFile(run).read()
    step = record.checkpoint_step if record is not None else None
    return step if step is not None and step > 0 else 0


def recorded_step(run: RunDir) -> int | None:
    """The step run_state.json says the run reached (None: no readable record)."""
    record = RunStateFile(run).read()
    return record.step if record is not None else None
