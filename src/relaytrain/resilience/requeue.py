"""After a stop: record it in run_state.json and, when the policy says so, requeue the SLURM job.

Only rank 0 writes the marker and calls ``scontrol requeue``; every rank gets the same exit code.
``requeue()`` is the one place that requeues a job: the stop path here (in the run) and the batch
shell's end-of-step decision (``step_end.py``: a crash, an unrecorded exit 75, a requeue the run could
not do) both call it.
Why relaytrain requeues by itself instead of leaving it to Slurm (both verified on Slurm 22.05):
a preempted job whose processes exit during GraceTime is recorded COMPLETED and not requeued, and a
job that hits its time limit is never requeued, even with ``--requeue``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from relaytrain.config.schema import CheckpointConfig, ResilienceConfig
from relaytrain.errors import USAGE_EXIT_CODE
from relaytrain.job import JobFacts, RunDir
from relaytrain.job.env import expand_nodelist
from relaytrain.job.slurm_command import Outcome, run_slurm_command
from relaytrain.job.slurmctld import scontrol_job_field
from relaytrain.resilience.codes import (
    EXIT_HANG,
    EXIT_INTERRUPTED,
    EXIT_NONFINITE,
    EXIT_RESUME,
    EXIT_STRAGGLER,
    FAILURE_REASONS,
    REQUEUE_REASONS,
    TIME_LIMIT_REASONS,
    StopReason,
)
from relaytrain.resilience.run_state import RunState, RunStateFile, RunStatus

log = logging.getLogger(__name__)

SCONTROL_REQUEUE_TIMEOUT_S = 30.0
UPDATE_TRIES = 3  # a held job's ExcNodeList update, before its release
EXCLUDED_FACT = "requeue_excluded"  # run_state.json: the nodes the requeued job's ExcNodeList got


def decide_requeue(
    reason: StopReason, requeue_enabled: bool, max_requeues: int, restart_count: int, in_slurm: bool
) -> bool:
    """Requeue after a preemption (always) or a time-limit stop (while restart_count < max_requeues).

    Never outside SLURM, never when resilience.requeue is off, never after a user interrupt, a
    scancel, a planned stop_at_step, the end of training or a failure (exception, NaN policy, hang).
    ``restart_count`` is SLURM_RESTART_COUNT, which counts every earlier requeue of the job.
    """
    if not (in_slurm and requeue_enabled) or reason not in REQUEUE_REASONS:
        return False
    if reason in TIME_LIMIT_REASONS:
        return restart_count < max_requeues
    return True


def exit_code_for(reason: StopReason) -> int:
    if reason in (StopReason.NONE, StopReason.STOP_AT_STEP):
        return 0
    if reason == StopReason.NAN:
        return EXIT_NONFINITE
    if reason == StopReason.HANG:
        return EXIT_HANG
    if reason == StopReason.ERROR:
        return 1
    if reason == StopReason.USER_INTERRUPT:
        return EXIT_INTERRUPTED
    if reason == StopReason.DAMAGED_CHECKPOINT:
        return USAGE_EXIT_CODE  # the CLI's exit for a UserError: the user must decide
    if reason == StopReason.STRAGGLER:
        return EXIT_STRAGGLER  # the batch job's driver replaces or drops the node and starts the step again
    return EXIT_RESUME


def stop_fields(reason: StopReason, checkpoint: CheckpointConfig) -> dict[str, Any]:
    """The trainer's `stop` event fields, logged before the stop is recorded (a requeue ends the job
    inside `handle_stop`): the reason, whether the stop saved a checkpoint, and the exit code."""
    saved = checkpoint.enabled and reason != StopReason.NAN
    return {"reason": reason.name.lower(), "saved": saved, "exit_code": exit_code_for(reason)}


def scontrol_requeue(requeue_id: str, exclude: Sequence[str] = ()) -> tuple[bool, str]:
    """(done, message). ``scontrol`` missing (inside a container) or failing gives (False, why).
    ``exclude``: nodes the next allocation must not use (bad_nodes.py): a running job's ExcNodeList
    cannot be changed, so the job is requeued held, updated, and released."""
    if exclude:
        return _requeue_excluding(requeue_id, exclude)
    return _scontrol("requeue", requeue_id)


def _scontrol(*args: str) -> tuple[bool, str]:
    """(done, the command or why not). Every call ignores SIGTERM (relaytrain.job.slurm_command): Slurm's
    SIGTERM to the processes of a job it requeues reaches the `scontrol requeue` that asked for it (killed,
    it reported a requeue that went through as failed) and the `update` and `release` after a
    `requeuehold` (a release killed half-way leaves the job held)."""
    done = run_slurm_command(["scontrol", *args], SCONTROL_REQUEUE_TIMEOUT_S, ignore_sigterm=True)
    if done.outcome is Outcome.MISSING:
        return False, (
            "scontrol is not on PATH (inside a container?): the batch job's driver requeues the job "
            "when run_state.json says requeue_pending (see docs/resilience.md)"
        )
    return (True, done.command) if done.ok else (False, done.why())


def _requeue_excluding(requeue_id: str, exclude: Sequence[str]) -> tuple[bool, str]:
    """requeuehold, add ``exclude`` to the job's ExcNodeList, release: the next allocation avoids them."""
    earlier = scontrol_job_field(requeue_id, "ExcNodeList") or ""  # read while the job still runs
    done, how = _scontrol("requeuehold", requeue_id)
    if not done:
        return done, how
    nodes = dict.fromkeys([*expand_nodelist(earlier if earlier != "(null)" else ""), *exclude])
    for _ in range(UPDATE_TRIES):  # the job is held until the release: a failed update may be tried again
        updated, update = _scontrol("update", f"JobId={requeue_id}", f"ExcNodeList={','.join(nodes)}")
        if updated:
            break
    if not updated:
        log.warning("the requeued job's next allocation does not exclude %s: %s", ",".join(exclude), update)
    released, release = _scontrol("release", requeue_id)
    if not released:
        return False, f"requeued held, but {release}"
    return True, f"{how}; {update}; {release}"


def requeue(
    job: JobFacts, run_state: RunStateFile, record: RunState, why: str, exclude: Sequence[str] = ()
) -> bool:
    """Write the record with the requeue pending, ``scontrol requeue`` the job, record it requeued.

    ``why`` completes the warning when it fails ("could not requeue {why}: ..."); the record then says
    ``requeue_pending`` (the batch job's driver requeues it when the run cannot, docs/resilience.md).
    Slurm ends the job at once after a successful call: the record is written before it.
    """
    if exclude:  # the nodes the next allocation excludes: the job's end tells them (notify, node_excluded)
        record = replace(record, facts={**record.facts, EXCLUDED_FACT: list(dict.fromkeys(exclude))})
    run_state.write(replace(record, requeue_requested=True, requeue_pending=True, requeued=False))
    done, how = scontrol_requeue(job.requeue_id, exclude) if exclude else scontrol_requeue(job.requeue_id)
    if not done:
        log.warning("could not requeue %s: %s", why, how)
        return False
    run_state.write(replace(record, requeue_requested=True, requeue_pending=False, requeued=True))
    log.info("requeued (%s)", how)
    return True


def _refine(reason: StopReason, job: JobFacts) -> StopReason:
    """A SIGTERM from `scancel` looks like a preemption (or, near the end, the time limit) to the
    process; slurmctld marks a cancelled job CANCELLED before its steps get the signal."""
    if reason in (StopReason.PREEMPTION, StopReason.TIME_LIMIT_SIGNAL) and job.in_slurm:
        state = job.scheduler_state()
        if state is not None and state.startswith("CANCELLED"):
            return StopReason.CANCELLED
    return reason


def handle_stop(
    resilience: ResilienceConfig,
    run: RunDir,
    reason: StopReason,
    step: int,
    rank: int,
    *,
    saved: bool = True,
    message: str = "",
    user_error: str = "",
    env: Mapping[str, str] | None = None,
    facts: Mapping[str, Any] | None = None,
) -> int:
    """Record why the run stopped (rank 0), requeue if the policy says so, return the exit code.

    Call it on every rank after the emergency checkpoint is complete (its commit is what the resumed
    job loads; ``scontrol requeue`` kills the job at once). ``saved=False`` when no checkpoint of
    ``step`` was written (the run resumes from the previous one). ``facts``: more fields for the record.
    """
    code = exit_code_for(reason)
    if rank != 0:
        return code
    r = resilience
    job = JobFacts.from_env(env)
    reason = _refine(reason, job)
    code = exit_code_for(reason)
    wanted = decide_requeue(reason, r.requeue, r.max_requeues, job.restart_count, job.in_slurm)
    status = RunStatus.FAILED if reason in FAILURE_REASONS else RunStatus.STOPPED
    record_facts = {**(facts or {}), **job.identity(), "saved": saved, "exit_code": code}
    message = (message or user_error)[:500]  # a user error is its own message unless one is given
    record = RunState.of(status, reason.label, step, message=message, user_error=user_error, **record_facts)
    log.info(
        "run %s at step %d (%s%s), exit code %d, SLURM_RESTART_COUNT=%d",
        status,
        step,
        reason.label,
        "" if saved else ", no new checkpoint",
        code,
        job.restart_count,
    )
    if wanted:
        requeue(job, RunStateFile(run), record, "the job")
        return code
    RunStateFile(run).write(record)
    if job.in_slurm and reason in TIME_LIMIT_REASONS and r.requeue:
        log.warning(
            "not requeuing: SLURM_RESTART_COUNT=%d reached resilience.max_requeues=%d",
            job.restart_count,
            r.max_requeues,
        )
    return code


def mark_running(
    max_steps: int, run: RunDir, rank: int, step: int, env: Mapping[str, str] | None = None
) -> None:
    """At the start of training (rank 0): status running at the step the run resumed from (0: it started
    at step 0, a new line of checkpoints), also its ``checkpoint_step``; logs SLURM_RESTART_COUNT."""
    if rank != 0:
        return
    job = JobFacts.from_env(env)
    if job.in_slurm:
        log.info(
            "SLURM job %s, SLURM_RESTART_COUNT=%d, resuming at step %d",
            job.requeue_id,
            job.restart_count,
            step,
        )
    record = RunState.of(
        RunStatus.RUNNING, "", step, checkpoint_step=step, **job.identity(), max_steps=max_steps
    )
    RunStateFile(run).write(record)


def mark_finished(run: RunDir, rank: int, step: int, env: Mapping[str, str] | None = None) -> None:
    """After the last step (rank 0): status finished, so that a stale requeue ends at once."""
    if rank != 0:
        return
    job = JobFacts.from_env(env)
    RunStateFile(run).write(RunState.of(RunStatus.FINISHED, "max_steps", step, **job.identity(), exit_code=0))


def finished_message(max_steps: int, run: RunDir) -> str | None:
    """A message when run_state.json says this run already finished at ``max_steps`` (train.max_steps),
    else None."""
    record = RunStateFile(run).read()
    if record is None or record.status is not RunStatus.FINISHED:
        return None
    if record.step < max_steps:
        return None  # train.max_steps was raised since: train on
    return (
        f"run {run.root} already finished at step {record.step} (train.max_steps={max_steps}, "
        f"{record.time or '?'}); nothing to do. Raise train.max_steps to train further."
    )
