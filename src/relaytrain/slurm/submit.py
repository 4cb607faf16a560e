"""Running sbatch and recording what was submitted (`<run_dir>/slurm/jobs.jsonl`)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from relaytrain.errors import UserError
from relaytrain.slurm.client import run_slurm

JOBS_FILE = "jobs.jsonl"


def sbatch_command(script: Path, after: str | None = None) -> list[str]:
    cmd = ["sbatch", "--parsable"]
    if after:
        # A failed prerequisite cancels the dependant instead of leaving it pending forever.
        cmd += [f"--dependency=afterok:{after}", "--kill-on-invalid-dep=yes"]
    return cmd + [str(script)]


def submit(script: Path, after: str | None = None) -> str:
    """Submit with `sbatch --parsable` and return the job id."""
    if shutil.which("sbatch") is None:
        raise UserError(
            "sbatch not found: run on a Slurm login node, or use --dry-run to only write the script"
        )
    result = run_slurm(sbatch_command(script, after), timeout=None)
    if result.returncode != 0:
        message = (result.stderr or result.stdout).strip().splitlines()
        raise UserError(
            f"sbatch refused {script}: {message[-1] if message else 'exit ' + str(result.returncode)}"
        )
    job_id = result.stdout.strip().split(";")[0]
    if not job_id:
        raise UserError(f"sbatch printed no job id for {script}")
    return job_id


def record_job(slurm_dir: Path, entry: dict[str, Any]) -> None:
    slurm_dir.mkdir(parents=True, exist_ok=True)
    entry = {"submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **entry}
    with open(slurm_dir / JOBS_FILE, "a") as f:
        f.write(json.dumps(entry) + "\n")


def read_jobs(slurm_dir: Path) -> list[dict[str, Any]]:
    path = slurm_dir / JOBS_FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
