"""resilience.survivors in a one-node `relaytrain launch` job on the real local Slurm cluster: 2 ranks on one
node, launched by docs/resilience.md's line as written (this test's run folder, tiny model, 2 tasks and a
step delay after it), each rank SIGKILLed from outside the job at a known step.

* Rank 0, then rank 1 in the same job: each is replaced alone (the launcher's standby or a new process, in
  the job log) inside the one job step the driver started: no step restart, no requeue, no crash record.
  Rank 0 first: the store the ranks meet on is the launcher's, not rank 0's. The job COMPLETES with every
  loss, the redone steps' included, bit-identical to an uninterrupted run, and `relaytrain verify` passes.
* The fallback: a fault breaks the survivors' join (faults/, as tests/test_survivors.py does), so the job
  step ends, and the batch driver restarts it in place (as without survivors), bit-exact.

One uninterrupted run (plain torchrun outside Slurm, same config) is the reference of both.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_slurm_jobs import (
    assert_losses_match,
    cli,
    events,
    job_log,
    job_output,
    last_step,
    launch,
    records,
    setup_override,
)
from relaytrain.job import RunDir
from relaytrain.resilience.batch.crash import CrashLog
from test_docs_cli import bash_lines

import faults
from bench.cluster.harness import rank_pids
from conftest import REPO, TINY, child_env
from slurm_fixtures import wait_for, wait_job_finished

pytestmark = pytest.mark.slurm

STEPS = 40
KILLS = ((0, 8), (1, 22))  # (rank, at step), one job; rank 1 once rank 0's recovery is done
DELAY_S = 0.4  # a step: the kills land mid-run, the job stays short
PROFILE = REPO / "configs" / "clusters" / "local.toml"
TRAIN = [*TINY, f"--train.max_steps={STEPS}"]


def doc_line() -> list[str]:
    """docs/resilience.md's `relaytrain launch` line, its words after `relaytrain launch`."""
    lines = bash_lines(REPO / "docs" / "resilience.md")
    (line,) = [line for line in lines if line.startswith("relaytrain launch ") and "survivors" in line]
    words = shlex.split(line)
    assert "--resilience.survivors=true" in words and words[words.index("--nodes") + 1] == "1", line
    return words[2:]


def launch_documented(runs: Path, name: str, **faults_on) -> str:
    """The page's line as written, then this test's run, model, 2 ranks and faults (later keys win)."""
    ours = ["--tasks-per-node", "2", f"--slurm.profile={PROFILE}", f"--run.dir={runs}", f"--run.name={name}"]
    with pytest.MonkeyPatch.context() as here:
        here.chdir(REPO)  # the page's config path is the checkout's
        return launch(*doc_line(), *ours, *TRAIN, setup_override(faults.setup_line(**faults_on)))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's losses (asked for when needed: it runs while the first job does)."""
    run_dir = tmp_path_factory.mktemp("survivors-slurm") / "reference"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "relaytrain.cli", "train", *doc_line()[:1], "--checkpoint.snapshot_every=1", *TRAIN,
               f"--run.dir={run_dir.parent}", f"--run.name={run_dir.name}"]  # fmt: skip
    env = {k: v for k, v in child_env().items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )

    def losses() -> dict[int, float]:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]
        return {r["step"]: r["loss"] for r in records(run_dir, "train")}

    try:
        yield losses
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_rank(run_dir: Path, job: str, rank: int, step: int) -> int:
    """SIGKILL `rank`'s process once `step` is logged; its pid, alive before and gone after (the kill
    landed)."""
    wait_for(lambda: last_step(run_dir) >= step and rank_pids(job, rank), 240, f"job {job} at step {step}")
    (pid,) = rank_pids(job, rank)
    assert alive(pid), f"rank {rank}'s process {pid} ended before the kill"
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not alive(pid), 30, f"rank {rank}'s process {pid} to end")
    return pid


def recoveries(run_dir: Path) -> list[dict]:
    return [e for e in events(run_dir) if e["event"] == "recovery"]


def recovered(run_dir: Path, job: str, count: int) -> bool:
    """Whether `count` recoveries are recorded; fails at once when the driver started another job step
    (the in-process path did not hold)."""
    out = job_output(run_dir, job)
    assert out.count("launching: srun") == 1, f"the driver started another job step:\n{out[-6000:]}"
    return len(recoveries(run_dir)) >= count


def verified(run_dir: Path) -> None:
    code, out = cli("verify", str(run_dir))  # the replayed steps: each sample still once, in order
    assert code == 0, out


def test_a_killed_rank_0_then_rank_1_are_replaced_alone_in_the_one_job_step_bit_exact(
    slurm_cluster, tmp_path, reference
):
    runs = tmp_path / "runs"
    job = launch_documented(runs, "survivors", step_delay_s=DELAY_S)
    run_dir = runs / "survivors"
    killed = []
    try:
        for generation, (rank, step) in enumerate(KILLS, 1):
            killed.append(kill_rank(run_dir, job, rank, step))
            wait_for(lambda g=generation: recovered(run_dir, job, g), 180, f"recovery {generation}")
        fields = wait_job_finished(int(job), timeout=300)
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    out = job_output(run_dir, job)
    assert (fields["JobState"], fields["Restarts"]) == ("COMPLETED", "0"), job_log(run_dir, job)
    for generation, ((rank, _step), pid) in enumerate(zip(KILLS, killed, strict=True), 1):
        replaced = (
            rf"relaytrain\.job\.torchrun: rank {rank} \(pid {pid}\) exited -9; the other ranks stay: (the "
            rf"standby process|no standby process is ready: a new process) \(pid \d+[^)]*\) takes its "
            rf"place in their round {generation}\n"
        )
        assert re.search(replaced, out), out[-6000:]
    assert [(e["lost_rank"], e["generation"]) for e in recoveries(run_dir)] == [(0, 1), (1, 2)]
    # One job step: the driver launched once, recorded no crash, restarted nothing.
    assert out.count("launching: srun") == 1 and "in-process recovery failed" not in out, out[-6000:]
    assert not CrashLog(RunDir(run_dir)).entries()
    assert not [e for e in events(run_dir) if e["event"] == "step_restart"]
    assert all(r.get("step_restart", 0) == 0 and r.get("restart", 0) == 0 for r in records(run_dir, "train"))
    assert_losses_match(run_dir, reference())
    verified(run_dir)


def test_a_failed_in_process_recovery_ends_the_step_and_the_driver_restarts_it_in_place_bit_exact(
    slurm_cluster, tmp_path, reference
):
    runs = tmp_path / "runs"
    job = launch_documented(runs, "fallback", step_delay_s=DELAY_S, break_survivors=True)
    run_dir = runs / "fallback"
    try:
        kill_rank(run_dir, job, 1, KILLS[0][1])
        fields = wait_job_finished(int(job), timeout=300)
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    out = job_output(run_dir, job)
    assert (fields["JobState"], fields["Restarts"]) == ("COMPLETED", "0"), job_log(run_dir, job)
    assert "survivors' join of round 1 broken" in faults.landed(out), out[-6000:]
    assert "the survivors' in-process recovery failed; ending every worker" in out, out[-6000:]
    assert not recoveries(run_dir)
    # Today's path: the driver's restart in place, a second job step that resumes from the snapshot.
    assert out.count("launching: srun") == 2, out[-6000:]
    (restart,) = [e for e in events(run_dir) if e["event"] == "step_restart"]
    assert restart["step_restart"] == 1, restart
    (resumed,) = [e for e in events(run_dir) if e["event"] == "resume"]
    assert resumed["step_restart"] == 1 and resumed["step"] >= KILLS[0][1] - 1, resumed
    assert [e["action"] for e in CrashLog(RunDir(run_dir)).entries()] == ["restart"]
    assert_losses_match(run_dir, reference())
    verified(run_dir)
