"""When does this SLURM job end? Sources, first found wins:

1. ``RELAYTRAIN_FAKE_JOB_END_TIME`` (unix seconds): a testing hook, also handy outside SLURM to rehearse
   the time-budget stop.
2. ``SLURM_JOB_END_TIME`` (set by recent Slurm versions).
3. ``scontrol show job -o $SLURM_JOB_ID`` (its ``EndTime=``), then ``squeue -h -j $SLURM_JOB_ID -o %e``.

Slurm prints times in the client's local time zone, which ``datetime.fromisoformat(...).timestamp()``
reads back the same way.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from datetime import datetime

log = logging.getLogger(__name__)

FAKE_END_TIME_ENV = "RELAYTRAIN_FAKE_JOB_END_TIME"
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


def job_end_time(env: Mapping[str, str] | None = None) -> tuple[float | None, str]:
    """(end time in unix seconds or None, where it came from)."""
    env = os.environ if env is None else env
    for name in (FAKE_END_TIME_ENV, "SLURM_JOB_END_TIME"):
        value = env.get(name, "").strip()
        if value:
            try:
                return float(value), name
            except ValueError:
                log.warning("ignoring %s=%r: not unix seconds", name, value)
    job_id = env.get("SLURM_JOB_ID", "").strip()
    if not job_id:
        return None, "not a SLURM job"
    end = scontrol_job_field(job_id, "EndTime")
    if end is not None and parse_slurm_time(end) is not None:
        return parse_slurm_time(end), "scontrol show job"
    out = run_slurm_client(["squeue", "-h", "-j", job_id, "-o", "%e"])
    if out is not None and parse_slurm_time(out) is not None:
        return parse_slurm_time(out), "squeue"
    return None, "scontrol/squeue gave no end time"
