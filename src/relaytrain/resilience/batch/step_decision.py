"""The end-of-step decision itself: from the facts of a job step that ended, what happens next.

``decide`` is pure (the facts in, a ``Decision`` out); ``step_end.py`` reads the facts and carries the
decision out. See ``step_end.py`` for the whole list of outcomes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from relaytrain.config.schema import ResilienceConfig
from relaytrain.job import JobFacts
from relaytrain.resilience.batch import repeat
from relaytrain.resilience.batch.bad_nodes import (
    IMPLICATED,
    Exclusion,
    exclusions,
    implicated_nodes,
    recorded,
)
from relaytrain.resilience.batch.bad_nodes import why_of as excluded_why
from relaytrain.resilience.batch.crash import CRASH_LOG_FILE, RESTARTED, cause_of, classify
from relaytrain.resilience.batch.decision_facts import (  # noqa: F401  (the decision's names, for callers)
    Action,
    Decision,
    Restartable,
    RunFacts,
    step_marker,
)
from relaytrain.resilience.batch.preflight_exclude import after_preflight, preflight_of
from relaytrain.resilience.batch.replace_node import after_straggler, straggler_of
from relaytrain.resilience.batch.step_restart import RestartPlan, plan_restart
from relaytrain.resilience.codes import EXIT_RESTART_STEP, EXIT_RESUME, StopReason
from relaytrain.resilience.requeue import decide_requeue
from relaytrain.resilience.run_lock import is_busy_refusal
from relaytrain.resilience.run_state import RunState, RunStatus


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
    verdict = None if program else straggler_of(run.state, job)
    if verdict is not None:
        return after_straggler(exit_code, verdict, run, resilience, job, restartable)
    named = None if program else preflight_of(run.state, job)
    if named is not None:  # resilience.preflight = "exclude": nodes left out before the first step
        return after_preflight(exit_code, named, run, resilience, job, restartable)
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
    cause[IMPLICATED] = list(implicated_nodes(cause, restartable.lost()))
    bad = exclusions((*run.earlier_implicated, *cause[IMPLICATED]), r.exclude_node_after)
    cause.update(recorded(bad))
    plan, not_in_place = _plan(run, r, job, restartable, bad)
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
        exclude=tuple(bad),
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


def _plan(
    run: RunFacts, r: ResilienceConfig, job: JobFacts, restartable: Restartable, bad: Mapping[str, Exclusion]
) -> tuple[RestartPlan | None, str]:
    """The restart in place without the excluded nodes; none when one of them would have to stay (no
    spare and the node range does not allow leaving it out): the requeue's allocation excludes it."""
    plan, not_in_place = plan_restart(
        replace(restartable.step, hung=run.hang is not None),
        run.earlier_restarts,
        r,
        job,
        min_nodes=restartable.min_nodes,
        usable_nodes=restartable.usable_nodes,
        excluded=set(bad),
        excluded_why=excluded_why(bad),
        spares=restartable.spares,
    )
    if plan is not None and plan.kept:
        return None, f"excluded node(s) cannot be left out: {plan.kept}"
    return plan, not_in_place


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
    left_out = plan.placed()
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
        },
        restart=plan,
    )


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
    if not (state is not None and state.pending_for(job) and job.in_slurm):
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
