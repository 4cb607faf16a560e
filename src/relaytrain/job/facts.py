"""The facts of the job this process runs in, read from its environment in one place.

Every part of relaytrain that needs to know about the current SLURM job (the resilience layer, the
process-group setup, the metrics, the GPU monitor) asks a ``JobFacts``; nothing else reads ``SLURM_*``.
Outside SLURM the ids are empty, the restart count is 0 and ``in_slurm`` is False.

The job's end time comes from, first found wins:

1. ``RELAYTRAIN_FAKE_JOB_END_TIME`` (unix seconds): a testing hook, also handy outside SLURM to rehearse
   the time-budget stop.
2. ``SLURM_JOB_END_TIME`` (set by Slurm >= 23.02).
3. ``scontrol show job -o $SLURM_JOB_ID`` (its ``EndTime=``), then ``squeue -h -j $SLURM_JOB_ID -o %e``.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from relaytrain.job.env import expand_nodelist
from relaytrain.job.slurmctld import queried_end_time, queried_preempt_time, scontrol_job_field

log = logging.getLogger(__name__)

FAKE_END_TIME_ENV = "RELAYTRAIN_FAKE_JOB_END_TIME"
# Set by relaytrain's batch script: the signal it asked Slurm for with `--signal=B:SIG@SECONDS`
# (`USR2`), or `none` (`--signal none`, attach mode). Absent: the job was submitted another way.
PRE_TIMEOUT_SIGNAL_ENV = "RELAYTRAIN_SLURM_SIGNAL"
# Set by relaytrain's batch script: how many times it has started the job step again inside this
# allocation after a crash (restart in place). 0 or absent: the first step of this run of the job.
STEP_RESTARTS_ENV = "RELAYTRAIN_STEP_RESTARTS"
# Set by the batch job's driver before each job step: the job's spare nodes (`slurm.spare_nodes`) that
# are idle and usable now, comma-separated. Absent or empty: no spare to replace a node with.
SPARE_NODES_ENV = "RELAYTRAIN_SPARE_NODES"
_END_TIME_VARIABLES = (FAKE_END_TIME_ENV, "SLURM_JOB_END_TIME")


def _int(text: str | None) -> int:
    try:
        return int(text or 0)
    except ValueError:
        return 0


def _signal_name(text: str) -> str:
    """`USR2` and `SIGUSR2` -> `SIGUSR2`; `none` stays; empty stays empty."""
    text = text.strip().upper()
    if not text or text == "NONE":
        return text.lower()
    return text if text.startswith("SIG") else f"SIG{text}"


def _written_by(record: Mapping[str, object] | None) -> tuple[str, int, int] | None:
    """(job id, requeue count, restart in place) of the job step that wrote ``record`` (a run_state.json
    as :meth:`JobFacts.identity` fills it), or None for an empty or damaged one."""
    if not record:
        return None
    try:
        return (
            str(record.get("job_id", "")),
            int(record.get("restart_count", -1)),  # type: ignore[call-overload]
            int(record.get("step_restarts", 0)),  # type: ignore[call-overload]
        )
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class JobFacts:
    """What a process knows about its SLURM job. Build it with ``JobFacts.from_env()``."""

    job_id: str = ""
    array_job_id: str = ""
    array_task_id: str = ""
    restart_count: int = 0  # SLURM_RESTART_COUNT: unset on a first run, 1, 2, ... after requeues
    node_name: str = ""  # SLURMD_NODENAME: on a local multi-slurmd cluster the hostname is shared
    nodelist: str = ""  # SLURM_JOB_NODELIST as Slurm writes it (`gpu[07-08]`); nodes() expands it
    num_nodes: int = 0  # SLURM_JOB_NUM_NODES
    env_end_time: float | None = None  # RELAYTRAIN_FAKE_JOB_END_TIME, else SLURM_JOB_END_TIME
    env_end_source: str = ""  # which of the two gave env_end_time
    unreadable_end_time: str = ""  # `NAME='value'` of an end-time variable that is not unix seconds
    pre_timeout_signal: str = ""  # RELAYTRAIN_SLURM_SIGNAL: `SIGUSR2`, `none`, or "" (not known)
    step_restarts: int = 0  # RELAYTRAIN_STEP_RESTARTS: job steps started again in this allocation
    spare_nodes: tuple[str, ...] = ()  # RELAYTRAIN_SPARE_NODES: idle spares the job holds now

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> JobFacts:
        environ = os.environ if environ is None else environ
        end, end_source, unreadable = None, "", ""
        for name in _END_TIME_VARIABLES:
            value = environ.get(name, "").strip()
            if not value:
                continue
            try:
                end, end_source = float(value), name
                break
            except ValueError:
                unreadable = unreadable or f"{name}={value!r}"
        return cls(
            job_id=environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "",
            array_job_id=environ.get("SLURM_ARRAY_JOB_ID", ""),
            array_task_id=environ.get("SLURM_ARRAY_TASK_ID", ""),
            restart_count=_int(environ.get("SLURM_RESTART_COUNT")),
            node_name=environ.get("SLURMD_NODENAME", ""),
            nodelist=environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST", ""),
            num_nodes=_int(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES")),
            env_end_time=end,
            env_end_source=end_source,
            unreadable_end_time=unreadable,
            pre_timeout_signal=_signal_name(environ.get(PRE_TIMEOUT_SIGNAL_ENV, "")),
            step_restarts=_int(environ.get(STEP_RESTARTS_ENV)),
            spare_nodes=tuple(n for n in environ.get(SPARE_NODES_ENV, "").split(",") if n.strip()),
        )

    @property
    def in_slurm(self) -> bool:
        return bool(self.job_id)

    def sends_pre_timeout_signal(self, name: str) -> bool:
        """Whether Slurm sends signal ``name`` (`SIGUSR2`) to this job before its time limit.

        Never outside Slurm. In a job of relaytrain's batch script, only the signal it asked for; in a
        job submitted another way it cannot be known, and the configured signal is assumed.
        """
        if not self.in_slurm:
            return False
        return self.pre_timeout_signal in ("", name)

    @property
    def requeue_id(self) -> str:
        """The id `scontrol requeue` takes and squeue shows: ARRAYJOBID_TASKID for an array task."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    def host(self) -> str:
        """This node's name: SLURMD_NODENAME inside SLURM, else the hostname."""
        return self.node_name or socket.gethostname()

    def nodes(self) -> list[str]:
        """The job's hostnames (`gpu[07-08]` -> gpu07, gpu08); [] outside SLURM."""
        return expand_nodelist(self.nodelist)

    def identity(self) -> dict[str, object]:
        """The job fields every run_state.json record carries."""
        return {
            "job_id": self.job_id,
            "requeue_id": self.requeue_id,
            "restart_count": self.restart_count,
            "step_restarts": self.step_restarts,
        }

    def wrote(self, record: Mapping[str, object] | None) -> bool:
        """Whether this job step (job id, requeue count, restart in place) wrote ``record``, a
        run_state.json as :meth:`identity` fills it; False for an earlier step, run or job."""
        written = _written_by(record)
        return written is not None and written == (self.job_id, self.restart_count, self.step_restarts)

    def requeued_since(self, record: Mapping[str, object] | None) -> bool:
        """Whether this job ran again after a requeue since ``record`` (a run_state.json as
        :meth:`identity` fills it) was written: the same job id, a lower requeue count."""
        written = _written_by(record)
        if written is None or not self.job_id:
            return False
        job_id, restart_count, _ = written
        return job_id == self.job_id and 0 <= restart_count < self.restart_count

    def end_time(self) -> tuple[float | None, str]:
        """(the job's end time in unix seconds or None, where it came from). May ask slurmctld."""
        if self.unreadable_end_time:
            log.warning("ignoring %s: not unix seconds", self.unreadable_end_time)
        if self.env_end_time is not None:
            return self.env_end_time, self.env_end_source
        if not self.in_slurm:
            return None, "not a SLURM job"
        return queried_end_time(self.job_id)

    def preempt_time(self, end_source: str) -> float | None:
        """When Slurm began to preempt this job, or None; asks slurmctld, except for the testing hook's
        end time (``end_source``), which no scheduler set."""
        if not self.in_slurm or end_source == FAKE_END_TIME_ENV:
            return None
        return queried_preempt_time(self.job_id)

    def scheduler_state(self) -> str | None:
        """JobState as slurmctld sees it now (`RUNNING`, `CANCELLED by 1000`, ...), or None."""
        return scontrol_job_field(self.job_id, "JobState") if self.in_slurm else None
