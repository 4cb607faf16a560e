"""Before a submission: does the run directory already belong to a job that may still run?

A run directory has one writer (``resilience/run_lock.py``). Its lock exists only while a run trains,
so a job that is still pending is found through ``<run_dir>/slurm/jobs.jsonl``, which records every
job `launch` and `sweep` submitted for it. Jobs named in ``--after`` are not in the way: the new job
starts only once they ended.
"""

from __future__ import annotations

import re

from relaytrain.errors import UserError
from relaytrain.job import RunDir
from relaytrain.job.slurmctld import job_is_over, queued_jobs
from relaytrain.resilience.run_lock import RunLock, busy_message
from relaytrain.slurm.submit import read_jobs


def refuse_busy_run_dir(run: RunDir, after: str | None = None, attach: str | None = None) -> None:
    """Raise UserError naming the job (or process) that holds the run directory or is queued to write it.

    ``attach``: the allocation of `launch --jobid`; a lock its own earlier step left is for the step
    to judge (on its node it can tell whether that process still runs).
    """
    waits_for = set(re.split(r"[:,?\s]+", after or "")) - {""}
    holder, alive, why = RunLock(run).current_holder()
    if alive and not (holder is not None and holder.job_id in waits_for | {attach}):
        text = holder.describe(why) if holder is not None else f"an unreadable lock ({why})"
        raise UserError(busy_message(run, text, holder.job_id if holder else "") + "; nothing submitted")
    recorded = {str(entry.get("job_id", "")) for entry in read_jobs(run.jobs)}
    recorded = {
        job for job in recorded if job and job not in waits_for and job.split("_")[0] not in waits_for
    }
    for job_id, state in (queued_jobs(sorted(recorded)) or []) if recorded else []:
        if not job_is_over([state]):
            raise UserError(
                busy_message(run, f"job {job_id} (submitted for it, {state})", job_id, lock=False)
                + "; nothing submitted"
            )
