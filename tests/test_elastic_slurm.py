"""On the real local Slurm cluster: a `--nodes 1-2` job loses a node, continues on the one left inside the
same allocation (the job step restarted in place: same job, no requeue), and runs on 2 nodes again after
a requeue once the node is back; the global batch and the data position never change."""

from __future__ import annotations

import itertools
import subprocess
import time

import pytest

from e2e_slurm_jobs import (
    FIRST_RUN_ONLY,
    cli,
    events,
    job_log,
    last_step,
    launch,
    marker,
    records,
    setup_override,
    wait_step,
    write_config,
)
from relaytrain.job import RunDir
from relaytrain.job.env import expand_nodelist
from relaytrain.localcluster import cluster as local_cluster
from relaytrain.slurm.jobs import nodes_per_run

import faults
from slurm_fixtures import job_fields, slurm, wait_for, wait_job_finished

pytestmark = pytest.mark.slurm

STEPS = 300
GLOBAL_BATCH, SEQ_LEN = 8, 32  # tests/e2e_slurm_jobs.MODEL
# The job's first run (its job step restarted in place included) sleeps this long after each step, so
# it cannot reach STEPS before STEPS * FIRST_RUN_DELAY_S seconds have passed: every wait the test makes
# in that run has that deadline, so a loaded machine fails a wait by name instead of letting the job
# finish before the test has seen it. The requeued run goes at full speed.
FIRST_RUN_DELAY_S = 0.5


def running_on(job: str, nodes: int, restarts: int) -> bool:
    fields = job_fields(int(job))
    if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
        raise AssertionError(f"job {job} ended early: {fields.get('JobState')}")
    return (
        fields.get("JobState") == "RUNNING"
        and int(fields.get("Restarts", "0")) >= restarts
        and fields.get("NumNodes") == str(nodes)
    )


def idle_nodes(cluster) -> int:
    """Idle nodes of the module's lane."""
    states = local_cluster.node_states(cluster.base_dir)
    return sum(states.get(node) == "idle" for node in cluster.nodes)


def last_step_in_place(run_dir) -> int:
    """The last step trained by the job step restarted in place."""
    return max((r["step"] for r in records(run_dir, "train") if r.get("step_restart") == 1), default=0)


def test_a_node_range_job_continues_in_place_on_fewer_nodes_then_grows_back(slurm_cluster, tmp_path):
    if len(slurm_cluster.nodes) < 2:
        pytest.fail(f"this test needs 2 nodes; the running cluster has {len(slurm_cluster.nodes)}")
    runs = tmp_path / "runs"
    config = write_config(tmp_path / "elastic.toml", runs, "elastic", STEPS)
    run_dir = runs / "elastic"
    # Both nodes free first (a job of the test before may still be completing): the range 1-2 then
    # starts on 2.
    wait_for(lambda: idle_nodes(slurm_cluster) >= 2, 120, "2 idle nodes")
    slow_first_run = FIRST_RUN_ONLY.format(faults.setup_line(step_delay_s=FIRST_RUN_DELAY_S))
    job = launch(str(config), "--nodes", "1-2", "--tasks-per-node", "2", "--checkpoint.interval=5",
                 setup_override(slow_first_run))  # fmt: skip
    first_run_ends = time.monotonic() + STEPS * FIRST_RUN_DELAY_S

    def left() -> float:
        return max(1.0, first_run_ends - time.monotonic())

    doomed = lost = batch_host = None
    try:
        wait_for(lambda: running_on(job, 2, 0), left(), f"job {job} to run on 2 nodes")
        wait_step(run_dir, job, 8, timeout=left())
        # Not the node of the batch shell: losing that one ends the job (NODE_FAIL, Slurm's requeue).
        fields = job_fields(int(job))
        doomed = next(n for n in expand_nodelist(fields["NodeList"]) if n != fields["BatchHost"])
        lost, batch_host = doomed, fields["BatchHost"]
        local_cluster.kill_node(doomed, slurm_cluster.base_dir)
        wait_for(lambda: running_on(job, 1, 0), left(), f"job {job} to go on with the node left")
        wait_for(
            lambda: len([e for e in events(run_dir) if e["event"] == "resize"]) == 1, left(), "the resize"
        )
        resumed_at = [e for e in events(run_dir) if e["event"] == "resume"][-1]["step"]
        wait_for(lambda: last_step_in_place(run_dir) >= resumed_at + 3, left(), "steps on the node left")
        local_cluster.restart_node(doomed, slurm_cluster.base_dir)
        doomed = None
        assert last_step(run_dir) < STEPS, "the first run ended before the test could stop it"
        # A stop that requeues (SIGTERM to the steps, as a preemption). The range 1-2 starts on the nodes
        # free when the requeued job is due: on a loaded machine a node may still be completing the run
        # before (the lost node's step, or this stop's), and the job then starts on one. Held until two of
        # the lane's nodes are idle, as an admin could, the next run gets two.
        code, out = cli("cancel", job, "--signal", "TERM")
        assert code == 0, out

        def requeued() -> bool:
            fields = job_fields(int(job))
            return fields.get("JobState") == "PENDING" and int(fields.get("Restarts", "0")) >= 1

        wait_for(requeued, 300, f"job {job} to be requeued", interval=0.2)
        slurm("scontrol", "hold", job)
        wait_for(lambda: idle_nodes(slurm_cluster) >= 2, 120, "2 idle nodes for the requeued job")
        slurm("scontrol", "release", job)
        fields = wait_job_finished(int(job), timeout=300)
    finally:
        if doomed is not None:
            local_cluster.restart_node(doomed, slurm_cluster.base_dir)
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    assert fields["JobState"] == "COMPLETED", job_log(run_dir, job)
    # The stop's requeue; the lost node cost none. The step that lost the node stays `completing` until
    # the node is back, and the stop's signal may reach the next run's step of the same id too (Slurm
    # delivers it late): then one more stop and requeue, or a restart in place (below), with nothing lost.
    assert int(fields["Restarts"]) >= 1
    starts = [e for e in events(run_dir) if e["event"] in ("start", "resume")]
    keys = ("event", "restart", "step_restart", "nodes", "world_size")
    assert [tuple(e.get(k, 0) for k in keys) for e in starts][:2] == [
        ("start", 0, 0, 2, 4),
        ("resume", 0, 1, 1, 2),
    ]
    # the requeued run on both nodes again (its job step maybe restarted in place after a late
    # cancellation, below, on the same 2 nodes)
    third = tuple(starts[2].get(k) for k in ("event", "restart", "nodes", "world_size"))
    assert third == ("resume", 1, 2, 4), starts
    restart, *late = [e for e in events(run_dir) if e["event"] == "step_restart"]
    assert restart["nodes_lost"] == [lost] and restart["nodes"] == [batch_host], restart
    # Slurm may also deliver the requeue's cancellation of step <job>.0 late, to the next run's step of
    # the same id (its tasks SIGKILLed at start-up, "STEP <job>.0 CANCELLED" in the job log): a crash,
    # restarted in place on the same nodes, no node lost.
    assert all(e["restart"] >= 1 and e["nodes_lost"] == [] for e in late), late
    # A restart in place keeps the nodes of the run it restarts. A run after one more requeue gets the
    # nodes Slurm has free for the range 1-2 then: both, or one while the other is still completing the
    # run before or is down a moment (a loaded machine's slurmd answering late), and resizes to them.
    why = (starts, local_cluster.node_states(slurm_cluster.base_dir))
    for before, after in itertools.pairwise(starts[2:]):
        if after["restart"] == before["restart"]:  # the same run, its job step restarted in place
            assert after["nodes"] == before["nodes"], why
        assert after["nodes"] in (1, 2) and after["world_size"] == 2 * after["nodes"], why
    resizes = [e for e in events(run_dir) if e["event"] == "resize"]
    assert [(e["from_nodes"], e["nodes"], e["from_grad_accum"], e["grad_accum"]) for e in resizes][:2] == [
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
    assert nodes_per_run(RunDir(run_dir), job).startswith("2, 1, 2")
    code, out = cli("status", str(run_dir))
    # the table wraps its nodes cell at 150 columns: "nsnode[1-2] (nodes per run:" / "2, 1, 2)"
    assert code == 0 and "nodes per run:" in out and "2, 1, 2" in out, out
    assert f"{1 + len(late)} in place" in out, out  # the lost node's restart, and any late cancellation
    # across 2 -> 1 -> 2 nodes (data-parallel size 4 -> 2 -> 4): every sample once and in order, the
    # checkpoints intact, the time ledger adding up to sacct's elapsed time of the job's runs within 1 %
    code, out = cli("verify", str(run_dir))
    assert code == 0 and ": OK" in out, out
