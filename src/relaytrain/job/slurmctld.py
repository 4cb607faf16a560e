"""Asking slurmctld about this job (``scontrol``/``squeue``), for what the environment does not say.

Slurm prints times in the client's local time zone, which ``datetime.fromisoformat(...).timestamp()``
reads back the same way. Every query is bounded by a timeout and returns None when the client is
missing (inside a container), fails or times out: callers carry on without the answer.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from datetime import datetime

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
    if shutil.which(args[0]) is None:
        return None
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.warning("%s failed: %s", " ".join(args), err)
        return None
    if proc.returncode != 0:
        log.warning("%s exited %d: %s", " ".join(args), proc.returncode, proc.stderr.strip()[:300])
        return None
    return proc.stdout


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
