"""What the end-of-step decision reads and says: the run's facts after a step (``RunFacts``), what a
restart in place needs beyond them (``Restartable``), the step marker in the job log, and the
``Decision`` itself with its ``Action``. ``step_decision.decide`` (and ``replace_node`` for a straggler's
stop) make the decision; ``step_end.py`` carries it out."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from relaytrain.job import JobFacts, RunDir
from relaytrain.resilience.batch import repeat
from relaytrain.resilience.batch.bad_nodes import job_implicated
from relaytrain.resilience.batch.crash import CrashLog
from relaytrain.resilience.batch.step_restart import RestartPlan, StepFacts
from relaytrain.resilience.hangs.record import HangRecord, HangRecordFile
from relaytrain.resilience.run_state import RunState, RunStateFile


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
    earlier_implicated: tuple[str, ...] = ()  # nodes this job's earlier failures implicated (bad_nodes.py)
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
            job_implicated(crashes.entries(), job.job_id),
            repeat.previous_crash(crashes.entries(), job.job_id),
        )


def step_marker(restart_count: int, step_restarts: int) -> str:
    """The job-log line before each launch of a step: the batch job's driver (``driver.py``) writes
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
    exclude: tuple[str, ...] = ()  # REQUEUE: nodes the next allocation excludes (bad_nodes.py)


@dataclass(frozen=True)
class Restartable:
    """What a restart in place needs to know beyond the run's files (``step_restart.plan_restart``)."""

    step: StepFacts = field(default_factory=StepFacts)
    min_nodes: int = 1  # the fewest nodes the run may continue on
    usable_nodes: list[str] | None = None  # the job's nodes that can run a step now (None: unknown)
    spares: tuple[str, ...] = ()  # the job's idle spare nodes that can run a step now

    def lost(self) -> tuple[str, ...]:
        """The step's nodes Slurm no longer gives the job (none when it could not say)."""
        usable = self.usable_nodes
        return () if usable is None else tuple(n for n in self.step.nodes if n not in usable)
