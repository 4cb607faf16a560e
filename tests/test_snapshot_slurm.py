"""On the local Slurm cluster (each node with its own /dev/shm): a rank SIGKILLed on one node while that
node's memory is wiped too; the job step, restarted in place, resumes from the snapshots, the lost rank's
file fetched from its replica on the other node, replaying at most one step, bit for bit."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from e2e_slurm_jobs import (
    FIRST_RUN_ONLY,
    assert_losses_match,
    job_log,
    launch,
    records,
    setup_override,
    start_reference,
    write_config,
)
from relaytrain.localcluster import cluster as local_cluster

import faults
from bench.cluster.harness import rank_pids
from slurm_fixtures import wait_for, wait_job_finished

STEPS = 24
SNAPSHOTS = "\n[checkpoint]\ninterval = 100\nsnapshot_every = 1\n"  # no checkpoint before the last step


def _node_of(pid: int) -> str:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"SLURMD_NODENAME="))


def _snapshot_dirs(node: str, job: str) -> str:
    return local_cluster.on_node(
        node, ["sh", "-c", f"ls -d /dev/shm/relaytrain-job{job}-* 2>/dev/null"]
    ).stdout


@pytest.mark.slurm
def test_killed_rank_on_a_wiped_node_resumes_from_the_peer_replica(slurm_cluster, tmp_path):
    runs = tmp_path / "runs"
    cfg = write_config(tmp_path / "snap.toml", runs, "snap", STEPS)
    cfg.write_text(cfg.read_text() + SNAPSHOTS)
    reference = start_reference(runs / "reference", cfg)
    slow = FIRST_RUN_ONLY.format(faults.setup_line(step_delay_s=0.4))
    job = launch(str(cfg), "--nodes", "2", "--tasks-per-node", "1", setup_override(slow))
    run_dir = runs / "snap"
    try:

        def reached():
            logged = [r["step"] for r in records(run_dir, "train") if not r.get("step_restart")]
            return max(logged, default=0) >= 8 and rank_pids(job, 1)

        wait_for(reached, 240, f"job {job} to reach step 8", interval=0.5)
        pid = rank_pids(job, 1)[0]
        node = _node_of(pid)
        other = next(n for n in slurm_cluster.nodes if n != node)
        assert _snapshot_dirs(node, job) and _snapshot_dirs(other, job)
        assert not list(Path("/dev/shm").glob(f"relaytrain-job{job}-*"))  # node memory, not this machine's
        os.kill(pid, signal.SIGKILL)
        killed_at = max(r["step"] for r in records(run_dir, "train") if not r.get("step_restart"))
        # the node lost its memory with its process: the rank's own snapshots are gone
        local_cluster.on_node(node, ["sh", "-c", f"rm -rf /dev/shm/relaytrain-job{job}-*"])
        fields = wait_job_finished(int(job), timeout=300)
        out, _ = reference.communicate(timeout=300)
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
        if reference.poll() is None:
            reference.kill()
    assert reference.returncode == 0, out[-3000:]
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "0", job_log(run_dir, job)
    resumes = [r for r in records(run_dir, "event") if r["event"] == "resume"]
    assert resumes and resumes[0]["step_restart"] == 1  # restarted in place, no requeue
    assert resumes and killed_at - 1 <= resumes[0]["step"] <= killed_at, (resumes, killed_at)
    rank0_log = (run_dir / "logs/rank_0.log").read_text()
    assert "(1 of 2 rank file(s) from a peer node)" in rank0_log
    assert_losses_match(run_dir, {r["step"]: r["loss"] for r in records(runs / "reference", "train")})
    assert not _snapshot_dirs(node, job) and not _snapshot_dirs(other, job)  # the finished run removed them
