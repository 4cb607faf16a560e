"""The how-to pages' Slurm lines (docs/howto/), run as written on the local Slurm cluster.

tests/test_howto.py runs the lines that need no cluster and parses the rest. A Slurm line (`launch`,
`cancel`, `logs`, `salloc`, and `preflight` inside an allocation) runs here, as written, where the local
cluster can hold it: one short job, the DDP program of your-own-program.md (2 nodes x 4 tasks, its 40
default steps), then that page's `status` and `logs -f` lines on it. Every other Slurm line is named in
NOT_HERE with the reason the local cluster cannot run it, so a Slurm line added to a page is either run
here or named there (test_every_slurm_line_is_run_here_or_named_with_its_reason).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from test_docs_cli import bash_lines

from conftest import child_env

REPO = Path(__file__).resolve().parents[1]
HOWTO = REPO / "docs" / "howto"
PROGRAM_PAGE = HOWTO / "your-own-program.md"
SLURM_COMMANDS = {"launch", "cancel", "logs"}

EIGHT_B = "the 8B preset on 4 or more GPU nodes; the local cluster has CPU nodes, 3 a lane"
# The Slurm lines the local cluster cannot run, each with why (lines naming configs/8b.toml: EIGHT_B).
NOT_HERE = {
    "relaytrain launch run.toml --notify.url_env=SLACK_WEBHOOK_URL --nodes 4 --time 24:00:00": (
        "run.toml is the reader's own config, on 4 nodes; alerts from a Slurm job are delivered in "
        "tests/test_notify_slurm.py"
    ),
    "relaytrain cancel JOBID --signal USR2": "JOBID is the job of the 8B launch above it",
    "relaytrain logs 8b": "the run of the 8B launch above it",
    "relaytrain logs 8b -f": "the run of the 8B launch above it",
    "salloc --nodes 4 --time 00:10:00": "4 nodes (a lane has 3), and salloc opens an interactive shell",
    "relaytrain preflight configs/8b.toml": "runs inside the 4-node allocation above it, for the 8B preset",
    "relaytrain launch configs/debug.toml --nodes 2 --resilience.preflight=off": (
        "200 steps of the debug preset; tests/test_preflight_slurm.py launches jobs with "
        "resilience.preflight = off and checks that no check ran"
    ),
}


def is_slurm_line(line: str) -> bool:
    words = shlex.split(line)
    if words[0] == "salloc":
        return True
    if words[0] != "relaytrain":
        return False
    return words[1] in SLURM_COMMANDS or (words[1] == "preflight" and "--nproc-per-node" not in words)


def slurm_lines() -> list[tuple[str, str]]:
    return [(page.name, line) for page in sorted(HOWTO.glob("*.md")) for line in bash_lines(page)
            if is_slurm_line(line)]  # fmt: skip


def program_block() -> list[str]:
    """your-own-program.md's launch block: the launch, then `status ddp` and `logs ddp -f`."""
    lines = bash_lines(PROGRAM_PAGE)
    start = next(i for i, line in enumerate(lines) if line.startswith("relaytrain launch --command "))
    block = lines[start : start + 3]
    assert [shlex.split(line)[1] for line in block] == ["launch", "status", "logs"], block
    return block


def test_every_slurm_line_is_run_here_or_named_with_its_reason():
    lines = slurm_lines()
    assert len(lines) >= 15, lines
    run_here = set(program_block())
    unnamed = [
        (page, line)
        for page, line in lines
        if line not in run_here and line not in NOT_HERE and "configs/8b.toml" not in line
    ]
    assert unnamed == [], f"run these here, or name them in NOT_HERE with the reason: {unnamed}"
    assert set(NOT_HERE) <= {line for _, line in lines}, "NOT_HERE names a line no page has"


def _shell(line: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    done = subprocess.run(["bash", "-c", line], cwd=cwd, env=child_env(), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    assert done.returncode == 0, f"{line}\nexit {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done


@pytest.mark.slurm
def test_the_program_page_launch_status_and_logs_run_as_written(slurm_cluster, tmp_path):
    """In a directory holding examples/ (the page runs from a checkout): the launch line submits the job,
    `status ddp` names it, `logs ddp -f` follows it to its end; the job completes with the program's 40
    steps on 8 ranks over 2 nodes."""
    from slurm_fixtures import wait_job_finished

    (tmp_path / "examples").symlink_to(REPO / "examples")
    launch, status, logs = program_block()
    submitted = _shell(launch, tmp_path, timeout=120)
    job_id = int(re.search(r"submitted job (\d+)", submitted.stdout).group(1))
    try:
        assert str(job_id) in _shell(status, tmp_path, timeout=60).stdout
        followed = _shell(logs, tmp_path, timeout=600)
        fields = wait_job_finished(job_id, timeout=120)
    finally:
        subprocess.run(["scancel", str(job_id)], capture_output=True, check=False)
    run = tmp_path / "runs" / "ddp"
    assert fields["JobState"] == "COMPLETED", followed.stdout[-3000:]
    assert fields["NumNodes"] == "2" and fields["NumTasks"] == "8", fields
    rows = [json.loads(line) for line in (run / "out" / "losses.jsonl").read_text().splitlines()]
    assert {row["step"] for row in rows} == set(range(1, 41)), rows[-3:]
    assert "COMPLETED" in _shell(status, tmp_path, timeout=60).stdout
