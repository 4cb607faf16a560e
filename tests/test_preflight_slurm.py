"""`relaytrain preflight` in a real Slurm allocation of 2 nodes: run as a job step, one task per node, it
names the node whose rank a CPU quota slows from outside (faults.throttle, as the straggler tests do), in
one line, and writes both nodes' results to the run's preflight folder. The same checks before a training
job's first step, with `resilience.preflight = "exclude"` and a spare: a node slowed the same way is left
out, the spare in its place."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time

import pytest

import faults.throttle as throttle
from conftest import REPO
from slurm_fixtures import sbatch, wait_for, wait_job_finished

pytestmark = pytest.mark.slurm

FACTOR = 4.0  # a quarter of a CPU: about 60 % below the median of two nodes, past the 40 % threshold


def preflight_pid(job: int, rank: int) -> int | None:
    """The preflight task of `rank` (SLURM_PROCID) in job `job`, or None."""
    return throttle.job_process(str(job), (f"SLURM_PROCID={rank}".encode(),), b"preflight")


def test_a_node_slowed_from_outside_is_named(slurm_cluster, tmp_path):
    runs = tmp_path / "runs"
    script = tmp_path / "preflight.sh"
    script.write_text(
        f"#!/bin/bash\nexec {sys.executable} -m relaytrain.cli preflight --budget 8 --run.dir={runs}\n"
    )
    job = sbatch("--nodes=2", "--ntasks-per-node=1", f"--output={tmp_path}/%j.out", str(script))
    pid = None
    try:
        pid = wait_for(lambda: preflight_pid(job, 1), 120, f"job {job}'s rank 1", interval=0.05)
        node = throttle._environ(pid)["SLURMD_NODENAME"]
        done = subprocess.run(
            [sys.executable, "-m", "faults.throttle", "--pid", str(pid), "--factor", str(FACTOR)],
            cwd=REPO, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        fields = wait_job_finished(job, timeout=300)
    finally:
        if pid is not None:
            throttle.release(pid)
    time.sleep(0.5)
    out = (tmp_path / f"{job}.out").read_text(errors="replace")
    named = [
        line for line in out.splitlines() if line.startswith("preflight: ") and " below the median" in line
    ]
    assert len(named) == 1 and named[0].startswith(f"preflight: {node} compute "), out[-4000:]
    assert fields["ExitCode"].startswith("1:"), fields  # a node below threshold: exit 1
    record = json.loads((runs / "debug" / "preflight" / f"{job}.json").read_text())
    assert sorted(record["nodes"]) == sorted(r["node"] for r in record["ranks"]) and len(record["nodes"]) == 2
    assert record["nodes"][node]["passed"] is False and record["summary"].endswith(f"below threshold: {node}")


def throttle_now(pid: int) -> str:
    """A CPU quota on `pid` (FACTOR times slower); its node."""
    node = throttle._environ(pid)["SLURMD_NODENAME"]
    done = subprocess.run(
        [sys.executable, "-m", "faults.throttle", "--pid", str(pid), "--factor", str(FACTOR)],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return node


def test_every_job_step_is_checked_before_its_first_step_and_exclude_leaves_a_slow_node_out(
    slurm_cluster, tmp_path
):
    """`exclude` with a spare: the training job's rank 1, slowed from its start, is named by the checks
    before the first step, and the step starts again in place with the spare in its node's place (same
    job, no requeue); the checks run again on the new nodes. `off`: no checks, launched by the line of
    docs/howto/preflight.md as the page writes it, with this test's run folder, 3 steps and one task a
    node after it."""
    from e2e_slurm_jobs import events, job_log, job_output, launch, records, write_config
    from relaytrain.job import RunDir
    from relaytrain.resilience.batch.crash import CrashLog
    from test_howto_slurm import howto_line

    if len(slurm_cluster.nodes) < 3:
        pytest.fail(f"this test needs 3 nodes; the running cluster has {len(slurm_cluster.nodes)}")
    runs = tmp_path / "runs"
    cfg = write_config(tmp_path / "on.toml", runs, "on", steps=3)
    on = ("--nodes", "2", "--spare-nodes", "1", "--tasks-per-node", "1", "--resilience.preflight=exclude")
    jobs = {"on": launch(str(cfg), *on)}
    off = shlex.split(howto_line("preflight.md", "relaytrain launch configs/debug.toml "))
    assert off[:2] == ["relaytrain", "launch"] and "--resilience.preflight=off" in off, off
    profile = REPO / "configs" / "clusters" / "local.toml"
    with pytest.MonkeyPatch.context() as here:
        here.chdir(REPO)  # the page's config path is the checkout's
        jobs["off"] = launch(*off[2:], f"--run.dir={runs}", "--run.name=off", "--train.max_steps=3",
                             "--tasks-per-node", "1", f"--slurm.profile={profile}")  # fmt: skip
    pid = None
    try:
        # rank 1 of the first step, slowed as soon as it runs: long before its checks
        pid = wait_for(lambda: throttle.rank_pid(jobs["on"], 1), 180, "rank 1 of the job", interval=0.05)
        slow = throttle_now(pid)
        fields = {name: wait_job_finished(int(job), timeout=400) for name, job in jobs.items()}
    finally:
        if pid is not None:
            throttle.release(pid)
    run_dir = runs / "on"
    assert all(f["JobState"] == "COMPLETED" for f in fields.values()), (fields, job_log(run_dir, jobs["on"]))
    assert fields["on"]["Restarts"] == "0", fields["on"]  # left out in place: no requeue
    out = job_output(run_dir, jobs["on"])
    assert re.search(rf"^preflight: {slow} compute \d+ % below the median", out, re.M), out[-4000:]
    first = json.loads((run_dir / "preflight" / f"{jobs['on']}.json").read_text())
    assert first["time"] < min(r["time"] for r in records(run_dir, "train"))  # before the first step
    assert len(first["nodes"]) == 2 and all(r["figures"]["gbps"] > 0 for r in first["ranks"])
    assert first["nodes"][slow]["passed"] is False
    (restart,) = [e for e in events(run_dir) if e["event"] == "step_restart"]
    (spare,) = restart["nodes_replaced"]
    assert spare[0] == slow and restart["nodes_left_out"] == [slow] and slow not in restart["nodes"], restart
    (entry,) = CrashLog(RunDir(run_dir)).entries()
    assert (entry["kind"], entry["action"], entry["nodes_implicated"]) == ("preflight", "restart", [slow])
    # the restarted step was checked again, on the nodes without the slow one, and trained there
    again = json.loads((run_dir / "preflight" / f"{jobs['on']}-s1.json").read_text())
    assert slow not in again["nodes"] and spare[1] in again["nodes"], again["nodes"]
    assert max(r["step"] for r in records(run_dir, "train")) == 3
    assert all(r.get("step_restart") == 1 for r in records(run_dir, "train")), "trained before the checks"
    assert (
        "preflight: " not in job_output(runs / "off", jobs["off"])
        and not (runs / "off" / "preflight").exists()
    )


def test_a_node_whose_checkpoint_folder_is_full_is_named(slurm_cluster, tmp_path):
    """Issue 58's case (b): the checkpoint folder is a small full tmpfs on one node only (mounted in that
    node's own mount namespace, as a node's local disk fills up), the other node's is the shared folder.
    Both halves of the storage check must name it, so that either one broken fails the test."""
    from relaytrain.localcluster.cluster import on_node

    runs = tmp_path / "runs"
    folder = runs / "debug" / "checkpoints"
    folder.mkdir(parents=True)
    good, full = slurm_cluster.nodes[:2]
    base = slurm_cluster.base_dir
    mounted = on_node(full, ["mount", "-t", "tmpfs", "-o", "size=1m", "relaytrain-full", str(folder)], base)
    assert mounted.returncode == 0, mounted.stderr
    try:
        on_node(full, ["dd", "if=/dev/zero", f"of={folder}/filler", "bs=64k", "count=64"], base)  # ENOSPC
        seen = on_node(full, ["df", "--output=avail", str(folder)], base).stdout.split()
        assert seen[-1] == "0", seen  # the fault landed: that node sees its checkpoint folder full
        script = tmp_path / "preflight.sh"
        script.write_text(
            f"#!/bin/bash\nexec {sys.executable} -m relaytrain.cli preflight --budget 8 --run.dir={runs}\n"
        )
        job = sbatch("--nodes=2", f"--nodelist={good},{full}", "--ntasks-per-node=1",
                     f"--output={tmp_path}/%j.out", str(script))  # fmt: skip
        fields = wait_job_finished(job, timeout=300)
    finally:
        on_node(full, ["umount", str(folder)], base)
    time.sleep(0.5)
    out = (tmp_path / f"{job}.out").read_text(errors="replace")
    named = [
        line for line in out.splitlines() if line.startswith("preflight: ") and "checkpoint storage" in line
    ]
    assert len(named) == 1 and named[0].startswith(f"preflight: {full} "), out[-4000:]
    # both halves of the storage check named it: the free space short of a save, and the write that failed
    assert re.search(r"checkpoint storage 0\.0 MiB free of the [\d.]+ MiB the run needs", named[0]), named
    assert "checkpoint storage write-read-fsync failed: No space left on device" in named[0], named
    assert fields["ExitCode"].startswith("1:"), fields
    record = json.loads((runs / "debug" / "preflight" / f"{job}.json").read_text())
    assert record["nodes"][full]["passed"] is False and record["nodes"][good]["passed"] is True, record
