"""The how-to pages' Slurm lines (docs/howto/), run as written on the local Slurm cluster.

tests/test_howto.py runs the lines that need no cluster and parses the rest. A Slurm line (`launch`,
`cancel`, `logs`, `salloc`, and `preflight` inside an allocation) runs here, as written, where the local
cluster can hold it: one short job, the DDP program of your-own-program.md (2 nodes x 4 tasks, its 40
default steps), then that page's `status` and `logs -f` lines on it. A line whose command an existing
test already runs (a Slurm test's job, or `logs` of a finished run) is read from its page by that test
(`howto_line`) and listed in RUN_ELSEWHERE: the page's text is what runs there, with no job of its own.
Every other Slurm line is named in NOT_HERE with the reason the local cluster cannot run it, so a Slurm
line added to a page is run here, run by another test, or named with its reason
(test_every_slurm_line_is_run_here_elsewhere_or_named_with_its_reason).
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
    "relaytrain logs 8b -f": "the run of the 8B launch above it",
    "salloc --nodes 4 --time 00:10:00": "4 nodes (a lane has 3), and salloc opens an interactive shell",
    "relaytrain preflight configs/8b.toml": "runs inside the 4-node allocation above it, for the 8B preset",
}
# The Slurm lines an existing test reads from its page (howto_line) and runs: line -> that test. `logs`
# of a finished run needs no cluster: tests/test_howto.py runs it on its copy of a tiny run.
RUN_ELSEWHERE = {
    "relaytrain logs 8b": "tests/test_howto.py::test_where_the_time_went_runs_as_written",
    "relaytrain cancel JOBID --signal USR2": (
        "tests/test_e2e_slurm.py::test_cancel_with_usr2_stops_cleanly_with_a_checkpoint"
    ),
    "relaytrain launch configs/debug.toml --nodes 2 --resilience.preflight=off": (
        "tests/test_preflight_slurm.py::"
        "test_every_job_step_is_checked_before_its_first_step_and_exclude_leaves_a_slow_node_out"
    ),
}


def howto_line(page: str, start: str) -> str:
    """The one line of docs/howto/PAGE (its ```bash blocks) that starts with START, as the page writes it:
    what a Slurm test runs where it runs a page's command."""
    lines = {line for line in bash_lines(HOWTO / page) if line.startswith(start)}
    assert len(lines) == 1, f"{page}: expected one line starting {start!r}, found {sorted(lines)}"
    return lines.pop()


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


def test_every_slurm_line_is_run_here_elsewhere_or_named_with_its_reason():
    lines = slurm_lines()
    assert len(lines) >= 15, lines
    run = set(program_block()) | set(RUN_ELSEWHERE)
    unnamed = [
        (page, line)
        for page, line in lines
        if line not in run and line not in NOT_HERE and "configs/8b.toml" not in line
    ]
    assert unnamed == [], f"run these here or in RUN_ELSEWHERE's tests, or name them in NOT_HERE: {unnamed}"
    assert set(NOT_HERE) | set(RUN_ELSEWHERE) <= {line for _, line in lines}, "a line no page has"
    assert not set(NOT_HERE) & set(RUN_ELSEWHERE)


@pytest.mark.parametrize("line", sorted(RUN_ELSEWHERE))
def test_a_line_run_elsewhere_is_read_from_its_page_by_the_test_named(line):
    """The named test's source calls howto_line with the page and the start of that line: it runs the
    page's text, not a copy of it."""
    path, name = RUN_ELSEWHERE[line].split("::")
    source = (REPO / path).read_text()
    body = source[source.index(f"def {name}(") :]
    end = body.find("\ndef ")
    body = body[:end] if end > 0 else body
    calls = re.findall(r"howto_line\(\s*\"([\w-]+\.md)\",\s*\"([^\"]+)\",?\s*\)", body)
    read = [(page, start) for page, start in calls if line.startswith(start)]
    assert any(line in bash_lines(HOWTO / page) for page, _ in read), (
        f"{RUN_ELSEWHERE[line]} does not read `{line}` from its page with howto_line(PAGE, START)"
    )


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
