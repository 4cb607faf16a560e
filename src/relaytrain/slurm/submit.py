"""Running sbatch and recording what was submitted (`<run_dir>/slurm/jobs.jsonl`)."""

from __future__ import annotations

import re
import shlex
import shutil
import time
from pathlib import Path
from typing import Any

from relaytrain.errors import UserError
from relaytrain.job import jsonl
from relaytrain.slurm.client import run_slurm

_JOB_IDS = re.compile(r"[0-9]+(?:_[0-9]+)?(?::[0-9]+(?:_[0-9]+)?)*")  # 1234, 1234_5, 1234:1240
# A chain's dry run: the job id of an earlier stage, which only its submission will tell.
STAGE_VARIABLE = re.compile(r"\$stage[0-9]+")


def check_after(after: str) -> None:
    if not (_JOB_IDS.fullmatch(after) or STAGE_VARIABLE.fullmatch(after)):
        raise UserError(f"--after {after!r} is not a Slurm job id; pass one like --after 1234 (or 1234:1240)")


def sbatch_command(script: Path, after: str | None = None, parsable: bool = True) -> list[str]:
    cmd = ["sbatch", "--parsable"] if parsable else ["sbatch"]
    if after:
        check_after(after)
        # A failed prerequisite cancels the dependant instead of leaving it pending forever.
        cmd += [f"--dependency=afterok:{after}", "--kill-on-invalid-dep=yes"]
    return cmd + [str(script)]


def submission_line(script: Path, after: str | None = None, parsable: bool = True, variable: str = "") -> str:
    """The sbatch command as a shell line; `variable`: assign the job id it prints to this shell variable
    (`stage1=$(sbatch --parsable --dependency=afterok:"$stage0" ...)`, how a chain's dry run shows it)."""
    placeholder = bool(after and STAGE_VARIABLE.fullmatch(after))
    words = [
        f'"{word}"' if placeholder and word.endswith(str(after)) else shlex.quote(word)
        for word in sbatch_command(script, after, parsable)
    ]
    line = " ".join(words)
    return f"{variable}=$({line})" if variable else line


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


def record_job(jobs_file: Path, entry: dict[str, Any]) -> None:
    """Append ``entry`` to a run's jobs.jsonl (`RunDir.jobs`)."""
    jsonl.append(jobs_file, {"submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **entry})


def read_jobs(path: Path) -> list[dict[str, Any]]:
    """The entries of a run's jobs.jsonl (`RunDir.jobs`); none when it does not exist."""
    return jsonl.read(path).records
