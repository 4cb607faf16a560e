"""On the real local Slurm cluster (3 nodes): spare nodes and bad nodes.

* `--nodes 2 --spare-nodes 1`: a training node is killed; the step restarts in place on the other
  training node and the spare: same job, `Restarts=0`, world size 2 on 2 nodes, no resize, the losses
  bit-identical to an uninterrupted run (computed here, at the same time).
* `--nodes 1 --spare-nodes 2`: the training node's rank is killed twice; the second failure excludes the
  node (resilience.exclude_node_after=2), the third step runs on a spare, and `relaytrain status` lists the
  excluded node and why.

One module fixture runs both jobs and the reference concurrently.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from e2e_slurm_jobs import (
    assert_losses_match,
    cli,
    events,
    job_log,
    job_output,
    launch,
    records,
    setup_override,
    start_reference,
    wait_step,
    write_config,
)
from relaytrain.job import RunDir
from relaytrain.job.env import expand_nodelist
from relaytrain.localcluster import cluster as local_cluster
from relaytrain.resilience.batch.crash import CrashLog

import faults
from bench.cluster.harness import rank_pids
from slurm_fixtures import job_fields, wait_for, wait_job_finished

pytestmark = pytest.mark.slurm

STEPS = 30
SNAPSHOTS = "\n[checkpoint]\ninterval = 10\nsnapshot_every = 1\n"
SLOW = setup_override(faults.setup_line(step_delay_s=0.5))


def in_place_rows(run_dir, in_place: int) -> list[dict]:
    return [r for r in records(run_dir, "train") if r.get("step_restart", 0) == in_place]


def kill_rank_once_running(run_dir, job: str, in_place: int, seconds: float) -> None:
    """SIGKILL rank 0 once the step started `in_place` times has trained for `seconds` (a restarted
    step that fails sooner than 20 s after its launch counts as failing at start-up)."""
    wait_for(lambda: in_place_rows(run_dir, in_place) and rank_pids(job, 0), 120, f"step {in_place} of {job}")
    time.sleep(seconds)
    for pid in rank_pids(job, 0):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def spares(slurm_cluster, tmp_path_factory):
    if len(slurm_cluster.nodes) < 3:
        pytest.fail(f"this module needs 3 nodes; the running cluster has {len(slurm_cluster.nodes)}")
    base = tmp_path_factory.mktemp("spares")
    runs = base / "runs"
    config = write_config(base / "spares.toml", runs, "spare", STEPS)
    config.write_text(config.read_text() + SNAPSHOTS)
    reference = start_reference(runs / "reference", config)
    replace = exclude = ""
    killed = None
    try:
        replace = launch(str(config), "--nodes", "2", "--spare-nodes", "1", "--tasks-per-node", "1", SLOW)
        exclude = launch(str(config), "--name", "exclude", "--nodes", "1", "--spare-nodes", "2",
                         "--tasks-per-node", "1", "--train.max_steps=60", SLOW)  # fmt: skip
        out = {"runs": runs, "replace": replace, "exclude": exclude}
        wait_step(runs / "spare", replace, 6)
        fields = job_fields(int(replace))
        nodes = expand_nodelist(fields["NodeList"])
        killed = nodes[1]  # the second training node (the first runs the batch shell)
        out["killed"], out["spare"] = killed, nodes[2]
        out["killed_at"] = time.time()
        local_cluster.kill_node(killed, slurm_cluster.base_dir)
        kill_rank_once_running(runs / "exclude", exclude, 0, 4)
        kill_rank_once_running(runs / "exclude", exclude, 1, 16)
        out["replace_fields"] = wait_job_finished(int(replace), timeout=240)
        out["exclude_fields"] = wait_job_finished(int(exclude), timeout=240)
        out["reference_out"], _ = reference.communicate(timeout=120)
    finally:
        for job in filter(None, (replace, exclude)):
            subprocess.run(["scancel", job], capture_output=True, timeout=30)
        if reference.poll() is None:
            reference.kill()
        if killed is not None:
            local_cluster.restart_node(killed, slurm_cluster.base_dir)
    assert reference.returncode == 0, out["reference_out"][-3000:]
    return out


def test_a_spare_replaces_a_killed_node_in_place_bit_exact(spares):
    run_dir, job = spares["runs"] / "spare", spares["replace"]
    fields = spares["replace_fields"]
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "0", job_log(run_dir, job)
    (restart,) = [e for e in events(run_dir) if e["event"] == "step_restart"]
    training = [n for n in expand_nodelist(fields["NodeList"]) if n != spares["killed"]]
    assert restart["nodes_lost"] == [spares["killed"]] and restart["nodes_replaced"] == [
        [spares["killed"], spares["spare"]]
    ], restart
    assert restart["nodes"] == [training[0], spares["spare"]]
    starts = [e for e in events(run_dir) if e["event"] in ("start", "resume")]
    assert [(e.get("step_restart", 0), e["nodes"], e["world_size"]) for e in starts] == [(0, 2, 2), (1, 2, 2)]
    assert not [e for e in events(run_dir) if e["event"] == "resize"]
    assert_losses_match(
        run_dir, {r["step"]: r["loss"] for r in records(spares["runs"] / "reference", "train")}
    )
    assert f"spare {spares['spare']} in place of {spares['killed']}" in job_output(run_dir, job)
    assert "1 of 2 rank file(s) from a peer node" in job_output(run_dir, job)  # the snapshot's replica


def test_a_node_implicated_twice_is_excluded_and_the_third_step_runs_without_it(spares):
    run_dir, job = spares["runs"] / "exclude", spares["exclude"]
    fields = spares["exclude_fields"]
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "0", job_log(run_dir, job)
    first, second = CrashLog(RunDir(run_dir)).entries()
    bad = first["nodes_implicated"][0]
    assert second["nodes_implicated"] == [bad] and bad in second["nodes_excluded"], second
    third = [e for e in events(run_dir) if e["event"] == "step_restart"][-1]
    assert bad not in third["nodes"] and third["nodes_left_out"] == [bad], third
    code, out = cli("status", str(run_dir))
    assert code == 0 and "excluded node" in out and bad in out and "exclude_node_after=2" in out, out
