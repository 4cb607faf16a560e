"""Asking slurmctld about this job (``scontrol``/``squeue``), for what the environment does not say.

Slurm prints times in the client's local time zone, which ``datetime.fromisoformat(...).timestamp()``
reads back the same way. Every query is bounded by a timeout and returns None when the client is
missing (inside a container), fails or times out: callers carry on without the answer.
"""

from __future__ import annotations

import logging
import re
from datetime import datetime

from relaytrain.job.env import expand_nodelist
from relaytrain.job.slurm_command import Outcome, run_slurm_command

log = logging.getLogger(__name__)

SLURM_QUERY_TIMEOUT_S = 15.0


def parse_slurm_time(text: str) -> float | None:
    """'2026-11-22T15:30:00' -> unix seconds; 'Unknown', 'None', 'N/A', '' -> None."""
    text = text.strip()
    if not text or not text[0].isdigit():
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def run_slurm_client(args: list[str], timeout: float = SLURM_QUERY_TIMEOUT_S) -> str | None:
    """stdout of a Slurm client command, or None when it is missing, fails or times out."""
    done = run_slurm_command(args, timeout)
    if not done.ok and done.outcome is not Outcome.MISSING:
        log.warning("%s", done.why())
    return done.stdout if done.ok else None


def scontrol_job_field(job_id: str, key: str) -> str | None:
    """One ``Key=value`` field of ``scontrol show job -o ID`` (None when unavailable)."""
    out = run_slurm_client(["scontrol", "show", "job", "-o", job_id])
    if out is None:
        return None
    match = re.search(rf"(?:^|\s){re.escape(key)}=(\S*)", out)
    return match.group(1) if match else None


def queried_end_time(job_id: str) -> tuple[float | None, str]:
    """(end time from ``scontrol show job``, else ``squeue -o %e``, or None; where it came from)."""
    end = parse_slurm_time(scontrol_job_field(job_id, "EndTime") or "")
    if end is not None:
        return end, "scontrol show job"
    end = parse_slurm_time(run_slurm_client(["squeue", "-h", "-j", job_id, "-o", "%e"]) or "")
    if end is not None:
        return end, "squeue"
    return None, "scontrol/squeue gave no end time"


def queried_preempt_time(job_id: str) -> float | None:
    """When Slurm began to preempt this job (``scontrol show job``'s PreemptTime), or None.

    From then on the job's EndTime is the preemption's end (PreemptTime + the partition's GraceTime), not
    its time limit: an end time read then is no sign that the time limit is near.
    """
    return parse_slurm_time(scontrol_job_field(job_id, "PreemptTime") or "")


# States after which a job never runs again (a requeued job is PENDING or REQUEUED*, not one of these).
ENDED_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "TIMEOUT",
    }
)


def queued_jobs(job_ids: list[str]) -> list[tuple[str, str]] | None:
    """(id, state) of each of these jobs that ``squeue`` still shows (array tasks one by one, as it
    names them), from one call; None when Slurm cannot be asked (no client or controller, a timeout)."""
    done = run_slurm_command(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i %T"], SLURM_QUERY_TIMEOUT_S)
    if done.outcome is Outcome.FAILED and "invalid job id" in done.stderr.lower():
        return []  # one job id that Slurm purged after MinJobAge
    if not done.ok:
        if done.outcome is not Outcome.MISSING:
            log.warning("%s", done.why())
        return None
    return [(p[0], p[1]) for p in (line.split() for line in done.stdout.splitlines()) if len(p) >= 2]


def queue_states(job_id: str) -> list[str] | None:
    """The job's states as ``squeue`` shows them (one per array task), ``[]`` when Slurm no longer
    shows the job, None when Slurm cannot be asked."""
    jobs = queued_jobs([job_id])
    return None if jobs is None else [state for _, state in jobs]


def job_is_over(states: list[str]) -> bool:
    """Whether a job with these ``queue_states`` will never run again."""
    return all(state in ENDED_STATES for state in states)


# sinfo's node states in which a node cannot run a job step (its `*` suffix, not responding, too)
_UNUSABLE_NODE_STATES = ("down", "drain", "fail", "maint", "reboot", "power", "unknown", "future")


def usable_job_nodes(job_id: str) -> list[str] | None:
    """The nodes the job holds now that can run a step: its ``NodeList`` (with ``--no-kill`` Slurm
    drops a failed node from it) less those ``sinfo`` shows down, draining or not responding. None
    when Slurm cannot be asked."""
    nodelist = scontrol_job_field(job_id, "NodeList")
    if nodelist is None:
        return None
    nodes = expand_nodelist(nodelist) if nodelist not in ("", "(null)") else []
    if not nodes:
        return []
    out = run_slurm_client(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %t"])
    if out is None:
        return None
    bad = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and (parts[1].endswith("*") or parts[1].startswith(_UNUSABLE_NODE_STATES)):
            bad.add(parts[0])
    return [node for node in nodes if node not in bad]
