"""On the real local Slurm cluster: a `--nodes 1-2` job loses a node, continues on the one left, and
runs on 2 nodes again once the node is back; the global batch and the data position never change."""

from __future__ import annotations

import subprocess

import pytest

from e2e_slurm_jobs import (
    cli,
    events,
    job_log,
    launch,
    marker,
    records,
    setup_override,
    wait_step,
    write_config,
)
from relaytrain.localcluster import cluster as local_cluster
from relaytrain.slurm.jobs import nodes_per_run

from slurm_fixtures import job_fields, wait_for, wait_job_finished

pytestmark = pytest.mark.slurm

STEPS = 60
GLOBAL_BATCH, SEQ_LEN = 8, 32  # tests/e2e_slurm_jobs.MODEL


def running_on(job: str, nodes: int, restarts: int) -> bool:
    fields = job_fields(int(job))
    if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
        raise AssertionError(f"job {job} ended early: {fields.get('JobState')}")
    return (
        fields.get("JobState") == "RUNNING"
        and int(fields.get("Restarts", "0")) >= restarts
        and fields.get("NumNodes") == str(nodes)
    )


def test_a_node_range_job_continues_on_fewer_nodes_then_grows_back(slurm_cluster, tmp_path):
    if len(slurm_cluster.nodes) < 2:
        pytest.fail(f"this test needs 2 nodes; the running cluster has {len(slurm_cluster.nodes)}")
    runs = tmp_path / "runs"
    config = write_config(tmp_path / "elastic.toml", runs, "elastic", STEPS)
    run_dir = runs / "elastic"
    job = launch(str(config), "--nodes", "1-2", "--tasks-per-node", "2", "--checkpoint.interval=5",
                 setup_override("export RELAYTRAIN_STEP_DELAY_S=0.5"))  # fmt: skip
    doomed = None
    try:
        wait_for(lambda: running_on(job, 2, 0), 120, f"job {job} to run on 2 nodes")
        wait_step(run_dir, job, 8)
        doomed = job_fields(int(job))["BatchHost"]
        local_cluster.kill_node(doomed, slurm_cluster.base_dir)
        wait_for(lambda: running_on(job, 1, 1), 240, f"job {job} to be requeued onto the node left")
        wait_for(lambda: len([e for e in events(run_dir) if e["event"] == "resize"]) == 1, 120, "the resize")
        resumed_at = [e for e in events(run_dir) if e["event"] == "resume"][-1]["step"]
        wait_step(run_dir, job, resumed_at + 3)
        local_cluster.restart_node(doomed, slurm_cluster.base_dir)
        doomed = None
        # A stop that requeues (SIGTERM to the steps, as a preemption): the next run gets both nodes.
        code, out = cli("cancel", job, "--signal", "TERM")
        assert code == 0, out
        fields = wait_job_finished(int(job), timeout=300)
    finally:
        if doomed is not None:
            local_cluster.restart_node(doomed, slurm_cluster.base_dir)
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    assert fields["JobState"] == "COMPLETED", job_log(run_dir, job)
    assert int(fields["Restarts"]) == 2
    starts = [e for e in events(run_dir) if e["event"] in ("start", "resume")]
    assert [(e["event"], e["restart"], e["nodes"], e["world_size"]) for e in starts] == [
        ("start", 0, 2, 4),
        ("resume", 1, 1, 2),
        ("resume", 2, 2, 4),
    ]
    resizes = [e for e in events(run_dir) if e["event"] == "resize"]
    assert [(e["from_nodes"], e["nodes"], e["from_grad_accum"], e["grad_accum"]) for e in resizes] == [
        (2, 1, 1, 2),  # 8 sequences over dp 4 -> 2 per rank, 1 micro batch of 2; over dp 2 -> 2 x 2
        (1, 2, 2, 1),
    ]
    train = records(run_dir, "train")
    assert {r["step"] for r in train} == set(range(1, STEPS + 1))
    last = max(train, key=lambda r: (r["step"], r["time"]))
    # the data position is samples consumed: the same global batch at every step, whatever the layout
    assert last["tokens_seen"] == STEPS * GLOBAL_BATCH * SEQ_LEN
    for r in train:
        assert r["tokens_seen"] == r["step"] * GLOBAL_BATCH * SEQ_LEN
    assert marker(run_dir)["status"] == "finished"
    assert nodes_per_run(run_dir, job) == "2, 1, 2"
    code, out = cli("status", str(run_dir))
    # the table wraps its nodes cell at 150 columns: "nsnode[1-2] (nodes per run:" / "2, 1, 2)"
    assert code == 0 and "nodes per run:" in out and "2, 1, 2)" in out, out
