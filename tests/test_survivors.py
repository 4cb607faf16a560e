"""resilience.survivors end to end under `python -m relaytrain.job.torchrun` (gloo, CPU, 2 ranks): rank 0's
process is SIGKILLed from outside at a step; the other one keeps its process, the launcher's standby
process (started before the kill) takes its place, and the run finishes with every loss equal to an
uninterrupted run's, and no standby left. When the
in-process path fails (a fault breaks the survivors' join), the launcher ends every worker and the
restart that follows (the batch driver's, here the same command again) resumes bit-exact. Every run is
docs/resilience.md's survivors line as written, on 2 ranks, with the test's small model and run directory
appended."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relaytrain.job.standby import STANDBY_ENV
from test_docs_cli import bash_lines
from test_resilience_dist import finish, losses, records, wait_for_step, worker_pid

import faults
from conftest import TINY, child_env
from shared_runs import once_per_session

pytestmark = pytest.mark.slow

# 2 ranks: one survivor proves what the others do (keep their processes and the losses, or all end when
# the join breaks) as well as three, at half the processes. 40: the workers still run when the test
# reads their pids.
RANKS, STEPS, KILL_AT = 2, 40, 5
ARGS = [
    *TINY,
    f"--train.max_steps={STEPS}",
    "--checkpoint.interval=0",
    "--checkpoint.snapshot_every=1",
    "--resilience.survivor_timeout_s=60",
]


(DOC_LINE,) = [
    line
    for line in bash_lines(Path(__file__).parents[1] / "docs" / "resilience.md")
    if "--resilience.survivors=true" in line and line.startswith("python -m relaytrain.job.torchrun ")
]


def launch(run_dir: Path, *extra: str, replacements: int | None = None, **env: str) -> subprocess.Popen:
    """The documented line (its flags and keys) on RANKS ranks; later keys win, so `extra` can turn
    survivors off. `replacements`: the launcher's budget instead of the line's."""
    python, *words = shlex.split(DOC_LINE)
    program = words.index("-m", 2)  # the launcher's own options end where the training program starts
    assert python == "python" and words[:2] == ["-m", "relaytrain.job.torchrun"], DOC_LINE
    assert words[2].startswith("--survivor-replacements="), DOC_LINE  # relaytrain's own option, first
    if replacements is not None:
        words[2] = f"--survivor-replacements={replacements}"
    assert [w for w in words[:program] if w.startswith("--nproc_per_node=")], DOC_LINE
    # torchrun's parser (argparse) takes the last --nproc_per_node: this one, after the line's own
    words[program:program] = [f"--nproc_per_node={RANKS}"]
    command = [sys.executable, *words, *ARGS]
    command += [f"--run.dir={run_dir.parent}", f"--run.name={run_dir.name}", *extra]
    return subprocess.Popen(
        command, env=child_env(**env), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted run's losses, made once per session (the two tests may run on two workers)."""

    def plain(folder: Path) -> None:
        rc, out = finish(launch(folder / "reference", "--resilience.survivors=false"))  # uninterrupted
        assert rc == 0, out[-3000:]
        assert "standby" not in out  # survivors off: no standby process, restarts or not

    return losses(once_per_session(tmp_path_factory, "survivors-reference", plain) / "reference")


def standby_pid(agent: int, timeout: float = 60) -> int:
    """The agent's standby process: its child started with the standby's variable."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if parent == agent and f"{STANDBY_ENV}=".encode() in (entry / "environ").read_bytes():
                    return int(entry.name)
            except (OSError, ValueError, IndexError):
                continue
        time.sleep(0.05)
    raise AssertionError(f"no standby process under pid {agent}")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_rank_at(proc: subprocess.Popen, run_dir: Path, rank: int, step: int) -> tuple[dict[int, int], int]:
    """SIGKILL `rank`'s process once `step` is logged and the agent has its standby; every worker's pid
    just before, and the standby's."""
    wait_for_step(run_dir, step, proc)
    standby = standby_pid(proc.pid)
    pids = {r: worker_pid(proc.pid, r) for r in range(RANKS)}
    os.kill(pids[rank], signal.SIGKILL)
    return pids, standby


def test_the_survivors_of_a_killed_rank_0_keep_their_processes_and_the_losses(tmp_path, reference):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--resilience.survivors=true")
    before, standby = kill_rank_at(proc, run_dir, 0, KILL_AT)
    deadline = time.monotonic() + 300
    while not [r for r in records(run_dir, "event") if r["event"] == "recovery"]:
        assert proc.poll() is None and time.monotonic() < deadline, "no recovery event"
        time.sleep(0.05)
    after = {r: worker_pid(proc.pid, r) for r in range(1, RANKS)}
    rc, out = finish(proc)
    assert rc == 0, out[-4000:]
    # The replacement is the standby started before the kill: its pid, rank 0's place.
    replaced = f"rank 0 (pid {before[0]}) exited -9; the other ranks stay: the standby process (pid {standby}"
    assert replaced in out and "takes its place in their round 1" in out, out[-4000:]
    assert f"the standby process (pid {standby}) becomes rank 0" in out, out[-4000:]
    assert all(after[r] == before[r] for r in range(1, RANKS)), (before, after)
    # No standby outlives the agent (the one started after the recovery included).
    standbys = [int(pid) for pid in re.findall(r"started a standby process \(pid (\d+)\)", out)]
    assert standbys[0] == standby and not [pid for pid in standbys if alive(pid)], standbys
    (event,) = [r for r in records(run_dir, "event") if r["event"] == "recovery"]
    assert (event["lost_rank"], event["generation"]) == (0, 1), event
    assert event["steps_replayed"] <= 1 and event["restored_step"] >= KILL_AT - 1, event
    assert 0 < event["detect_s"] < event["fault_to_step_s"], event
    assert "in-process recovery failed" not in out
    assert losses(run_dir) == reference  # every step, the redone one included, bit for bit


def test_a_failed_in_process_recovery_ends_every_worker_and_the_restart_resumes_bit_exact(
    tmp_path, reference
):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--resilience.survivors=true", **faults.env(break_survivors=True))
    kill_rank_at(proc, run_dir, 1, KILL_AT)
    rc, out = finish(proc, timeout=300)
    assert rc != 0, out[-3000:]
    assert "survivors' join of round 1 broken" in faults.landed(out), out[-3000:]
    assert "the survivors' in-process recovery failed; ending every worker" in out
    assert not [r for r in records(run_dir, "event") if r["event"] == "recovery"]
    # What restarts a failed job step (the batch driver's restart in place) starts the same command.
    rc, out = finish(launch(run_dir, "--resilience.survivors=true"))
    assert rc == 0, out[-3000:]
    (resumed,) = [r for r in records(run_dir, "event") if r["event"] == "resume"]
    assert resumed["restored_from"] == "node memory" and resumed["step"] >= KILL_AT - 1, resumed
    assert losses(run_dir) == reference


def test_a_lost_rank_with_no_replacement_left_ends_every_worker(tmp_path, reference):
    """A budget of one replacement: rank 0's loss is repaired in place, rank 1's, later, ends every worker
    (what restarts the failed step, the batch driver's restart in place, is the test above's)."""
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--resilience.survivors=true", replacements=1)
    kill_rank_at(proc, run_dir, 0, KILL_AT)
    deadline = time.monotonic() + 300
    while not [r for r in records(run_dir, "event") if r["event"] == "recovery"]:
        assert proc.poll() is None and time.monotonic() < deadline, "no recovery event"
        time.sleep(0.05)
    survivor = worker_pid(proc.pid, 1)  # the replacement (the standby) took rank 0's place
    wait_for_step(run_dir, KILL_AT + 3, proc)
    os.kill(survivor, signal.SIGKILL)
    rc, out = finish(proc, timeout=300)
    assert rc != 0, out[-3000:]
    used_up = "no replacement is left (--survivor-replacements used up); ending every worker"
    assert f"rank 1 (pid {survivor}) exited -9 and {used_up}" in out, out[-3000:]
    (event,) = [r for r in records(run_dir, "event") if r["event"] == "recovery"]  # one repair, not two
    assert event["lost_rank"] == 0, event
    after = out.split("becomes rank 0", 1)[1]
    assert "started a standby process" not in after, out[-3000:]  # none is started with no budget left
    got = losses(run_dir)
    assert got and all(got[step] == reference[step] for step in got), got  # bit-exact up to the end
