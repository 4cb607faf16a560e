"""A crash that reproduces the previous crash of this job: a deterministic fault, stopped, never requeued.

Restarting in place and requeueing recover from faults of the machines: a rank killed, a node lost, a
hang, a broken connection, a full disk. A fault of the program, its data or its config (a shape error at
step k, an import error at start-up) fails the same way every time, and restarting it only burns the
allocation and the queue. The end-of-step decision (``step_decision._after_crash``) asks ``repeated``
before it plans a restart: a crash whose cause signature equals the previous crash's of this Slurm job
(``crashes.jsonl``) stops the job with the cause named, after one reproduction.

A cause signature is the exception's type and its normalized message, and the step it failed at (the
run's ``run_state.json``), or the last exception line of the job log when the step died at start-up
before it wrote ``run_state.json``. A crash has no signature, and is always recovered from, when it
shows a fault of the machines: a signal (SIGKILL, the OOM killer, a segfault), a task ``srun`` saw killed
or lost with its node, a hang, or an error of the communication layer or the disk (gloo, NCCL, a closed
connection, a timeout, ENOSPC). Everything here is pure: the facts in, a signature or a verdict out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from relaytrain.resilience.run_state import RunState, RunStatus

REASON = "repeated_error"  # run_state.json's reason when a repeated crash stopped the job
SIGNATURE_FIELD = "signature"  # the crash cause's field (crashes.jsonl) that holds the signature
# Errors of the machines, not of the program: the same text twice is still worth a restart.
_INFRASTRUCTURE = re.compile(
    r"gloo|nccl|connection (?:closed|reset|refused|lost)|closed by peer|broken pipe|timed out|timeout"
    r"|socket|tcpstore|diststore|rendezvous|no route to host|network|no space left|disk quota|enospc"
    r"|errno 28|errno 122|out of memory|cannot allocate memory|killed|node fail|hang detected",
    re.IGNORECASE,
)
# The last line of a Python traceback: `ModuleNotFoundError: No module named 'x'` (an srun label may
# precede it); torchrun's own summary (ChildFailedError) says nothing about the cause.
_EXCEPTION_LINE = re.compile(r"^(?:\d+: )?([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$", re.MULTILINE)
_LAUNCHER_ERRORS = ("ChildFailedError",)
_REPR = re.compile(r"^([A-Za-z_][\w.]*)\((.*)\)$", re.DOTALL)
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_MAX_TEXT = 300


@dataclass(frozen=True)
class Signature:
    """What a deterministic crash is recognised by: ``where`` is ``step`` (the run recorded the error at
    ``step``) or ``start-up`` (the step died before it wrote run_state.json)."""

    where: str
    error: str  # `RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x64 and 32x64)`
    step: int = -1

    def as_dict(self) -> dict[str, Any]:
        return {"where": self.where, "error": self.error, "step": self.step}

    @classmethod
    def from_dict(cls, data: Any) -> Signature | None:
        """The signature a crashes.jsonl line holds (None when it holds none, or not this shape)."""
        if not isinstance(data, Mapping):
            return None
        where, error, step = data.get("where"), data.get("error"), data.get("step", -1)
        if not (isinstance(where, str) and isinstance(error, str) and isinstance(step, int)):
            return None
        return cls(where, error, step)

    def place(self) -> str:
        # run_state.json's step: the last one the run finished (the error came while it computed the next)
        return f"after step {self.step}" if self.where == "step" else "at start-up"


def normalized(text: str) -> str:
    """One line, addresses masked, at most _MAX_TEXT characters: the same error prints the same."""
    return " ".join(_ADDRESS.sub("0x?", text).split())[:_MAX_TEXT]


def from_repr(text: str) -> str:
    """`RuntimeError('boom')` (the trainer records ``repr(exc)``) as `RuntimeError: boom`."""
    match = _REPR.match(text.strip())
    if not match:
        return normalized(text)
    name, inner = match.groups()
    inner = inner.strip()
    if len(inner) >= 2 and inner[0] == inner[-1] and inner[0] in "'\"":
        inner = inner[1:-1]
    return normalized(f"{name}: {inner}" if inner else name)


def infrastructure(text: str) -> bool:
    return bool(_INFRASTRUCTURE.search(text))


def signature_of(
    cause: Mapping[str, Any], state: RunState | None, written: bool, job_log_tail: str
) -> Signature | None:
    """The crash's signature, or None when it shows a fault of the machines (or no cause at all).
    ``cause``: crash.cause_of's dict; ``written``: this job step wrote ``state``."""
    if cause.get("hang") or cause.get("signal"):
        return None
    tasks = cause.get("failed_tasks") or ()
    if any(not str(t.get("what", "")).startswith("Exited with exit code") for t in tasks):
        return None  # srun saw a task killed, or its node fail
    if written and state is not None:
        if state.status is not RunStatus.FAILED or state.reason != "error" or not state.message:
            return None  # `running`: a rank died without a record (killed); `hang`: the watchdog fired
        error = from_repr(state.message)
        return None if infrastructure(error) else Signature("step", error, state.step)
    lines = [
        normalized(f"{name}: {text}")
        for name, text in _EXCEPTION_LINE.findall(job_log_tail)
        if not name.endswith(_LAUNCHER_ERRORS)
    ]
    if not lines or infrastructure(lines[-1]):
        return None
    return Signature("start-up", lines[-1])


def previous_crash(entries: Iterable[Mapping[str, Any]], job_id: str) -> Mapping[str, Any] | None:
    """This job's last crashes.jsonl line (a requeued job keeps its id), or None."""
    last = None
    for entry in entries:
        if str(entry.get("job_id")) == job_id:
            last = entry
    return last


def repeated(signature: Signature | None, previous: Mapping[str, Any] | None) -> bool:
    """Whether this crash reproduces the previous crash of the job: the same signature (a fault of the
    machines has none, and is never a repetition)."""
    if signature is None or previous is None:
        return False
    return Signature.from_dict(previous.get(SIGNATURE_FIELD)) == signature


def stop_message(signature: Signature) -> str:
    """The job log's line and run_state.json's message: the cause named, and why it was not restarted."""
    return (
        f"the same error twice {signature.place()}: {signature.error}; not restarted: a deterministic "
        "fault in the program, data or config; fix it and submit the run again"
    )
