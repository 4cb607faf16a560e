"""The end-of-step decision itself: from the facts of a job step that ended, what happens next.

``decide`` is pure (the facts in, a ``Decision`` out); ``step_end.py`` reads the facts and carries the
decision out. See ``step_end.py`` for the whole list of outcomes.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from relaytrain.config.schema import ResilienceConfig
from relaytrain.job import JobFacts, RunDir
from relaytrain.resilience import repeat
from relaytrain.resilience.codes import EXIT_RESTART_STEP, EXIT_RESUME, StopReason
from relaytrain.resilience.crash import (
    CRASH_LOG_FILE,
    CULPRIT_TWICE,
    RESTARTED,
    CrashLog,
    cause_of,
    classify,
)
from relaytrain.resilience.hang_record import HangRecord, HangRecordFile
from relaytrain.resilience.requeue import decide_requeue
from relaytrain.resilience.run_lock import is_busy_refusal
from relaytrain.resilience.run_state import RunState, RunStateFile, RunStatus
from relaytrain.resilience.step_restart import RestartPlan, StepFacts, plan_restart


class Action(enum.Enum):
    FINISHED = "finished"  # nothing left to do: the step ended well, or the run's own stop decided
    REQUEUE = "requeue"  # requeue the job: it resumes from the last complete checkpoint
    FAIL = "fail"  # the job ends here and is not requeued
    RESTART = "restart"  # the batch script starts the job step again inside this allocation


@dataclass(frozen=True)
class RunFacts:
    """What the run directory and the job's output say about the step that ended."""

    state: RunState | None  # run_state.json as the step left it (None: none, or damaged)
    earlier_crashes: int  # crashes of this job in crashes.jsonl that requeued it (or ended it)
    job_log_tail: str  # this step's part of the job's output
    earlier_restarts: int = 0  # crashes of this job in crashes.jsonl restarted in place
    hang: HangRecord | None = None  # the hang the job's hang monitor detected in this step
    earlier_hang_nodes: tuple[str, ...] = ()  # culprit nodes of this job's earlier hangs, once per hang
    previous_crash: Mapping[str, Any] | None = None  # this job's last crashes.jsonl line (repeat.py)

    @classmethod
    def read(cls, run: RunDir, job: JobFacts, job_log_tail: str = "") -> RunFacts:
        # The output file holds every run of the job (--open-mode=append) and every step of a run:
        # keep only this step's part (the batch job's driver logs the marker before each launch).
        start = job_log_tail.rfind(step_marker(job.restart_count, job.step_restarts))
        if start < 0:
            start = job_log_tail.rfind(f"restart count {job.restart_count},")
        tail = job_log_tail[start:] if start >= 0 else job_log_tail
        crashes = CrashLog(run)
        return cls(
            RunStateFile(run).read(),
            crashes.count(job.job_id),
            tail,
            crashes.count(job.job_id, restarts=True),
            HangRecordFile(run).for_step(job),
            tuple(crashes.hang_culprit_nodes(job.job_id)),
            repeat.previous_crash(crashes.entries(), job.job_id),
        )


def step_marker(restart_count: int, step_restarts: int) -> str:
    """The job-log line before each launch of a step: the batch job's driver (``job_driver.py``) writes
    it, the decision after the step finds the step's part of the job log by it."""
    return f"job step of restart count {restart_count}, step restart {step_restarts}:"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str  # why, for a human
    say: tuple[str, ...] = ()  # the job log's lines about it
    record: RunState | None = None  # what run_state.json is to say (None: it stays as the step left it)
    crash: Mapping[str, Any] | None = None  # the crashes.jsonl entry to append
    program_stop: bool = False  # a program's stop: also a `stop` event in metrics.jsonl
    restart: RestartPlan | None = None  # RESTART: where the batch script starts the step again
    requeue_why: str = "the job"  # completes "could not requeue ..." when scontrol fails


@dataclass(frozen=True)
class Restartable:
    """What a restart in place needs to know beyond the run's files (``step_restart.plan_restart``)."""

    step: StepFacts = field(default_factory=StepFacts)
    min_nodes: int = 1  # the fewest nodes the run may continue on
    usable_nodes: list[str] | None = None  # the job's nodes that can run a step now (None: unknown)


def decide(
    exit_code: int,
    run: RunFacts,
    resilience: ResilienceConfig,
    job: JobFacts,
    *,
    program: bool = False,
    restartable: Restartable | None = None,
) -> Decision:
    """What happens after a step of relaytrain's trainer (``program=False``) or of a ``--command``
    program that ended with ``exit_code``."""
    restartable = restartable or Restartable()
    if exit_code != 0 and is_busy_refusal(run.job_log_tail):
        # The run directory belongs to another job or process: its files are not this job's to touch.
        why = "the run directory was in use by another run; nothing to recover"
        return Decision(Action.FAIL, why, (f"step exit code {exit_code}: {why}",))
    if program and exit_code == EXIT_RESTART_STEP:
        why = f"the program exited {EXIT_RESTART_STEP}: it asks for its step to be started again"
        return _after_crash(exit_code, why, run, resilience, job, restartable)
    if program:
        return _after_program(exit_code, run, resilience, job)
    crash, why = classify(run.state, job, exit_code)
    if crash:
        return _after_crash(exit_code, why, run, resilience, job, restartable)
    say = (f"step exit code {exit_code} is not a crash to recover from: {why}",) if exit_code else ()
    return _pending(run, job, say) or Decision(_settled(exit_code, run.state, job), why, say)


def _after_crash(
    exit_code: int,
    why: str,
    run: RunFacts,
    resilience: ResilienceConfig,
    job: JobFacts,
    restartable: Restartable,
) -> Decision:
    r, state = resilience, run.state
    step = state.step if state is not None else 0
    cause = cause_of(exit_code, why, state, run.job_log_tail, run.hang)
    why = cause["why"]  # a hang's: the monitor's `hang detected: ...` line
    written = state is not None and state.written_by(job)
    signature = repeat.signature_of(cause, state, written, run.job_log_tail)  # None: a fault of the machines
    if signature is not None:
        cause = {**cause, repeat.SIGNATURE_FIELD: signature.as_dict()}
        if repeat.repeated(signature, run.previous_crash):  # a deterministic fault: stopped, never requeued
            return _stop_repeated(exit_code, signature, cause, step, job)
    plan, not_in_place = plan_restart(
        restartable.step,
        run.earlier_restarts,
        r,
        job,
        min_nodes=restartable.min_nodes,
        usable_nodes=restartable.usable_nodes,
        excluded=culprits_named_twice(run),
        excluded_why=CULPRIT_TWICE,
    )
    if plan is not None:
        return _restart_in_place(exit_code, why, step, cause, plan, run, r, job)
    if restartable.step.can_restart and r.max_step_restarts:
        cause = {**cause, "not_restarted_in_place": not_in_place}
    allowed = r.requeue and job.in_slurm and run.earlier_crashes < r.max_crash_requeues
    count = run.earlier_crashes + 1
    if allowed:
        reason = "crash"
        message = f"crash {count} of this job ({why}); requeuing from the last complete checkpoint"
    else:
        reason = "crash_loop" if r.requeue and job.in_slurm else "crash"
        message = (
            f"crash {count} of job {job.job_id}: "
            f"resilience.max_crash_requeues={r.max_crash_requeues} reached; "
            f"fix the cause (see {CRASH_LOG_FILE} and the job log) and resubmit"
            if reason == "crash_loop"
            else f"crash ({why}); not requeued (resilience.requeue is off or not in SLURM)"
        )
    facts = {
        **job.identity(),
        "saved": False,
        "exit_code": exit_code,
        "crash": cause,
        "crash_count": count,
        "max_crash_requeues": r.max_crash_requeues,
    }
    say = (message,)
    if "not_restarted_in_place" in cause:
        say = (f"no restart in place: {not_in_place}", message)
    return Decision(
        Action.REQUEUE if allowed else Action.FAIL,
        message,
        say,
        RunState.of(RunStatus.FAILED, reason, step, message=message[:500], **facts),
        crash={**job.identity(), "step": step, **cause, "action": "requeue" if allowed else "fail"},
        requeue_why="after the crash",
    )


def _stop_repeated(
    exit_code: int, signature: repeat.Signature, cause: dict[str, Any], step: int, job: JobFacts
) -> Decision:
    message = repeat.stop_message(signature)
    facts = {**job.identity(), "saved": False, "exit_code": exit_code, "crash": cause, "repeated": True}
    record = RunState.of(RunStatus.FAILED, repeat.REASON, step, message=message[:500], **facts)
    return Decision(
        Action.FAIL,
        message,
        (message,),
        record,
        crash={**job.identity(), "step": step, **cause, "action": "fail", "repeated": True},
    )


def _restart_in_place(
    exit_code: int,
    why: str,
    step: int,
    cause: dict[str, Any],
    plan: RestartPlan,
    run: RunFacts,
    resilience: ResilienceConfig,
    job: JobFacts,
) -> Decision:
    number, cap = run.earlier_restarts + 1, resilience.max_step_restarts
    message = (
        f"crash ({why}); restarting the job step in place {plan.describe()}, from the last complete "
        f"checkpoint (restart in place {number} of resilience.max_step_restarts={cap})"
    )
    facts = {
        **job.identity(),
        "saved": False,
        "exit_code": exit_code,
        "crash": cause,
        "step_restart": number,
        "max_step_restarts": cap,
    }
    lost = list(plan.lost)
    left_out = {"nodes_left_out": list(plan.left_out), **({"nodes_kept": plan.kept} if plan.kept else {})}
    return Decision(
        Action.RESTART,
        message,
        (message,),
        RunState.of(RunStatus.FAILED, "crash", step, message=message[:500], **facts),
        crash={
            **job.identity(),
            "step": step,
            **cause,
            "action": RESTARTED,
            "step_restart": number,
            "nodes_lost": lost,
            **left_out,
        },  # fmt: skip
        restart=plan,
    )


def culprits_named_twice(run: RunFacts) -> set[str]:
    """The culprit nodes of this step's hang that an earlier hang of this job named too: left out of the
    restart in place where the node range allows (a node that hangs the job twice is likely to again)."""
    if run.hang is None:
        return set()
    named = Counter(run.earlier_hang_nodes) + Counter(run.hang.culprit_nodes)
    return {node for node in run.hang.culprit_nodes if named[node] >= 2}


def _after_program(exit_code: int, run: RunFacts, resilience: ResilienceConfig, job: JobFacts) -> Decision:
    """Exit 75 asks for the program to be continued (docs/programs.md), unless it recorded its stop."""
    state = run.state if run.state is not None and run.state.written_by(job) else None
    if exit_code != EXIT_RESUME:
        why = f"the program exited {exit_code}"
        finished = exit_code == 0 or (state is not None and state.status is RunStatus.FINISHED)
        if exit_code and finished:
            # relaytrain.program.finish() recorded the end; a signal after it (the pre-timeout one) killed
            # a program that had nothing left to do
            why += " after it recorded its end (finished)"
        return _pending(run, job) or Decision(Action.FINISHED if finished else Action.FAIL, why)
    if state is not None and state.status is not RunStatus.RUNNING:
        recorded = f"{state.reason}, requeue {state.requeue_requested}"
        why = f"the program recorded its stop ({recorded})"
        return _pending(run, job, (why,)) or Decision(_settled(exit_code, state, job), why, (why,))
    r = resilience
    running = run.state is not None and run.state.status is RunStatus.RUNNING
    step = run.state.step if running and run.state is not None else -1
    reason = StopReason.PROGRAM_EXIT
    wanted = decide_requeue(reason, r.requeue, r.max_requeues, job.restart_count, job.in_slurm)
    message = f"the program exited {EXIT_RESUME} without recording a stop: continue it"
    facts = {**job.identity(), "saved": True, "exit_code": EXIT_RESUME}
    say = [f"exit {EXIT_RESUME}: requeue {'requested' if wanted else 'refused'}"]
    why = message
    if not wanted and job.in_slurm and r.requeue:
        capped = f"not requeuing: SLURM_RESTART_COUNT={job.restart_count} reached resilience.max_requeues="
        why += f"; {capped}{r.max_requeues}"
        say.insert(0, f"{capped}{r.max_requeues}")
    elif not wanted:
        why += "; not requeued (resilience.requeue is off or not in SLURM)"
    return Decision(
        Action.REQUEUE if wanted else Action.FAIL,
        why,
        tuple(say),
        RunState.of(RunStatus.STOPPED, reason.label, step, message=message, **facts),
        program_stop=True,
    )


def _pending(run: RunFacts, job: JobFacts, say: tuple[str, ...] = ()) -> Decision | None:
    """A requeue the run asked for and could not do (no scontrol inside the container, or it failed)."""
    state = run.state
    if not (state is not None and state.requeue_pending and job.in_slurm):
        return None
    why = "the run asked for a requeue it could not do"
    record = state  # rewritten as it is, its time and host included, with the requeue's flags
    line = f"{why}: scontrol requeue {job.requeue_id}"
    return Decision(Action.REQUEUE, why, (*say, line), record, requeue_why="what the run asked for")


def _settled(exit_code: int, state: RunState | None, job: JobFacts) -> Action:
    """No crash, nothing to requeue: finished when the step exited 0 or this run recorded a stop or its
    end, else failed."""
    if exit_code == 0:
        return Action.FINISHED
    written = state is not None and state.written_by(job)
    ended = written and state.status in (RunStatus.STOPPED, RunStatus.FINISHED)
    return Action.FINISHED if ended else Action.FAIL
