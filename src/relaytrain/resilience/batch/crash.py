"""Whether a failed job step was a crash, and its cause (resilience.max_crash_requeues caps its requeues).

A crash is a job step that ended nonzero without a resumable stop: a rank killed (SIGKILL, the OOM
killer, a segfault), an exception, the hang watchdog, or a process that died before it wrote anything.
The batch script's end-of-step decision (``step_end.py``, run outside the step, so it survives the
ranks) asks ``classify`` here, which decides from ``run_state.json``:

* the step was refused because another run holds the run directory (``run.lock``; its output says
  so): not this job's run, nothing is recorded;
* ``stopped`` or ``finished`` by the current run: not a crash (the stop path already decided; torchrun
  exits 128 + the signal after a stop signal even when every worker saved);
* ``failed`` with reason ``nan`` or ``damaged_checkpoint`` (no checkpoint of the run loads), a
  UserError recorded as its ``user_error`` (a full disk during a save), or a step exit code 2 (a config or
  usage error): a deterministic failure, never requeued;
* ``failed`` with reason ``error`` or ``hang``, ``running``, or a marker written by an earlier run (the
  process died before or while loading its checkpoint): a crash.

When the job's hang monitor detected a hang in the step (``record.HangRecord``) and had its ranks
killed, the crash's cause says so: ``why`` is the monitor's ``hang detected: ...`` line and ``hang`` names
the step, the culprit rank(s) and node(s), the report and the limit that was passed.

Crashes are counted per SLURM job in ``<run_dir>/crashes.jsonl`` (one line per crash, never rewritten),
so a job resubmitted by hand starts with a fresh allowance; time-limit requeues have their own cap
(``max_requeues``). The requeued job resumes from the last complete checkpoint as after any requeue.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from relaytrain.job import JobFacts, RunDir, jsonl
from relaytrain.resilience.hangs.record import HangRecord
from relaytrain.resilience.run_state import RunState, RunStatus

CRASH_LOG_FILE = RunDir(Path()).crashes.name  # for messages; the path is RunDir.crashes
USAGE_ERROR_EXIT = 2  # relaytrain's CLI exits 2 on a UserError/ConfigError: retrying cannot help
# nan: the same data would fail again; damaged_checkpoint: the same files would (the user must decide)
NEVER_REQUEUED_REASONS = frozenset({"nan", "damaged_checkpoint"})
CRASH_REASONS = frozenset({"error", "hang"})
RESTARTED = "restart"  # a crashes.jsonl line's action when the step was started again in place
CULPRIT_TWICE = "named as a hang's culprit twice"  # why earlier versions left a node out of a restart
STRAGGLER = "straggler"  # a crashes.jsonl line's kind for a straggler's stop (its node replaced or dropped)
HANG_LINE_START = "hang detected: "  # the monitor's job-log line starts so, and a hang crash's `why`
# srun reports each task that died: `srun: error: node2: task 1: Killed` (or `... Exited with exit code 3`)
_SRUN_TASK_ERROR = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): (.+)")
# torchrun (one node) exits 1 whatever killed its worker; its failure summary names the signal
_TORCHRUN_SIGNAL = re.compile(r"Signal \d+ \((SIG[A-Z0-9]+)\) received by PID")
# slurmstepd's line when Slurm cancels a step (scancel, or a cancellation it delivers late to the next
# step of the same id after a requeue): every task is killed, none of them failed on its own
_STEP_CANCELLED = re.compile(r"\*\*\* STEP \S+ ON \S+ CANCELLED AT ")


def signal_of(exit_code: int) -> str:
    """`SIGKILL` for 137 (128 + 9, the shells' convention), else empty."""
    if 128 < exit_code < 128 + 65:
        try:
            return signal.Signals(exit_code - 128).name
        except ValueError:
            return ""
    return ""


def srun_task_errors(job_log_tail: str) -> list[dict[str, str]]:
    """The `srun: error: NODE: task N: WHAT` lines of the job's output: which node and rank died, and how."""
    return [
        {"node": node, "tasks": tasks, "what": what.strip()}
        for node, tasks, what in _SRUN_TASK_ERROR.findall(job_log_tail)
    ]


def torchrun_signals(job_log_tail: str) -> list[str]:
    """`SIGKILL` for each `Signal 9 (SIGKILL) received by PID ...` of torchrun's failure summary."""
    return sorted(set(_TORCHRUN_SIGNAL.findall(job_log_tail)))


def classify(state: RunState | None, job: JobFacts, exit_code: int) -> tuple[bool, str]:
    """(is it a crash to recover from, why). ``state`` is run_state.json as the step left it."""
    if exit_code == 0:
        return False, "the job step exited 0"
    if state is None or not state.written_by(job):
        if exit_code == USAGE_ERROR_EXIT:
            return False, "exit code 2: a config or usage error (see the log)"
        return True, "the step died before its run wrote run_state.json (start-up or checkpoint load)"
    status, reason = state.status, state.reason
    if status in (RunStatus.STOPPED, RunStatus.FINISHED):
        return False, f"the run {status} ({reason}); the stop path decided about requeueing"
    if status is RunStatus.FAILED and reason in NEVER_REQUEUED_REASONS:
        again = "the same data" if reason == "nan" else "the same checkpoint files"
        return False, f"the run failed ({reason}): not retried, {again} would fail again"
    if status is RunStatus.FAILED and state.user_error:
        # A condition the user must fix (a full disk during a save, a bad resume): torchrun exits 1 for any,
        # so the step's exit code does not say so; the same job would fail the same way again.
        return False, f"the run failed with an error the user must fix: {state.user_error}"
    if status is RunStatus.FAILED and reason in CRASH_REASONS:
        return True, f"the run failed ({reason}): {state.message or ''}".strip()
    if status is RunStatus.RUNNING:
        return True, f"a rank died at step >= {state.step} without a record (killed, OOM, segfault?)"
    return False, f"run_state.json has status {status.value!r}: not a crash"


class CrashLog:
    """``<run_dir>/crashes.jsonl``: every crash of the run, one JSON object a line."""

    def __init__(self, run: RunDir):
        self.path = run.crashes

    def entries(self) -> list[dict[str, Any]]:
        return jsonl.read(self.path).records

    def count(self, job_id: str, *, restarts: bool = False) -> int:
        """This job's crashes that were restarted in place (``restarts``), or the others: requeued or
        the job's end (lines written before restarts in place existed have no ``action``)."""
        return sum(
            1
            for e in self.entries()
            if str(e.get("job_id")) == job_id
            and (e.get("action") == RESTARTED) == restarts
            and (restarts or e.get("kind") != STRAGGLER)  # a straggler's stop is no crash to requeue
        )

    def hang_culprit_nodes(self, job_id: str) -> list[str]:
        """The culprit nodes of this job's hangs: each node once per hang crash that named it (the lines
        are the run directory's, anything may have written them: what is not a hang's shape is skipped)."""
        nodes: list[str] = []
        for entry in self.entries():
            hang = entry.get("hang")
            culprits = hang.get("culprits") if isinstance(hang, dict) else None
            if str(entry.get("job_id")) != job_id or not isinstance(culprits, list):
                continue
            named = (c.get("node") for c in culprits if isinstance(c, dict))
            nodes += dict.fromkeys(node for node in named if isinstance(node, str) and node)
        return nodes

    def append(self, entry: Mapping[str, Any]) -> None:
        jsonl.append(self.path, entry, sort_keys=True)


_ACTIONS = {RESTARTED: "restarted in place", "requeue": "requeued", "fail": "not recovered (the job ended)"}


def describe_crash(entry: Mapping[str, Any]) -> str:
    """One line for a crashes.jsonl entry (`relaytrain status`): a hang's step, culprit(s) and report, or
    another crash's step and why; then what followed. The entry may hold anything: odd fields are left out."""
    hang = entry.get("hang") if isinstance(entry.get("hang"), dict) else None
    straggler = entry.get("straggler") if isinstance(entry.get("straggler"), dict) else None
    if straggler is not None:
        s = straggler
        parts = [
            f"straggler at step {entry.get('step', '?')}: rank {s.get('rank', '?')} on {s.get('node', '?')} "
            f"{s.get('slower', '?')}x slower in {s.get('phase', '?')} ({s.get('action', '?')})"
        ]
    elif hang is not None:
        culprits = [c for c in hang.get("culprits") or () if isinstance(c, dict)]
        named = "; ".join(
            f"rank {c.get('rank', '?')} on {c.get('node', '?')} in {c.get('phase', '?')}"
            + (f" ({c['why']})" if c.get("why") else "")
            for c in culprits
        )
        parts = [f"hang at step {hang.get('step', '?')}: {named or 'no culprit named'}"]
        if hang.get("report"):
            parts.append(f"report {hang['report']}")
    else:
        parts = [f"at step {entry.get('step', '?')}: {entry.get('why') or 'no cause recorded'}"]
    action = _ACTIONS.get(str(entry.get("action", "requeue")), str(entry.get("action")))
    left_out = entry.get("nodes_left_out")
    if isinstance(left_out, list) and left_out:
        why = entry.get("nodes_left_out_why", CULPRIT_TWICE)
        action += f" without {','.join(map(str, left_out))} ({why})"
    replaced = entry.get("nodes_replaced")
    if isinstance(replaced, list) and replaced:
        pairs = [p for p in replaced if isinstance(p, list) and len(p) == 2]
        action += "; " + ", ".join(f"spare {spare} in place of {node}" for node, spare in pairs)
    return "; ".join([*parts, action])


def hang_why(hang: HangRecord) -> str:
    """A hang crash's `why`: the monitor's job-log line (`hang detected: rank 1 on n2 in ...`)."""
    line = " ".join(hang.line.split()) or f"at step {hang.step}"  # one line, whatever the file held
    return line if line.startswith(HANG_LINE_START) else HANG_LINE_START + line


def hang_cause(hang: HangRecord) -> dict[str, Any]:
    """What crashes.jsonl and run_state.json's `crash` say of a hang under `hang`."""
    return {
        "step": hang.step,
        "culprits": [dict(c) for c in hang.culprits],
        "line": hang.line,
        "report": hang.report,
        "idle_s": hang.idle_s,
        "limit_s": hang.limit_s,
    }


def cause_of(
    exit_code: int, why: str, state: RunState | None, job_log_tail: str, hang: HangRecord | None = None
) -> dict[str, Any]:
    """The crash's cause as crashes.jsonl and run_state.json record it: exit code, signal, the tasks
    `srun` reported dead (and their nodes), the marker the step left, and the hang the job's hang
    monitor detected in the step (its line becomes the `why`)."""
    errors = srun_task_errors(job_log_tail)
    hung = {} if hang is None else {"hang": hang_cause(hang)}
    return {
        "exit_code": exit_code,
        "signal": signal_of(exit_code) or ",".join(torchrun_signals(job_log_tail)),
        "why": why if hang is None else hang_why(hang),
        "failed_tasks": errors,
        "step_cancelled": bool(_STEP_CANCELLED.search(job_log_tail)),
        "nodes": sorted({e["node"] for e in errors}),
        "previous_state": None
        if state is None
        else {"status": state.status.value, "reason": state.reason, "step": state.step, "host": state.host},
        **hung,
    }
