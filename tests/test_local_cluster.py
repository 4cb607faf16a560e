"""End-to-end tests of `relaytrain cluster up|status|down` on a real local Slurm cluster."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from relaytrain.errors import UserError
from relaytrain.localcluster import cluster as local_cluster
from relaytrain.localcluster import commands as cluster_commands
from relaytrain.localcluster import daemons, net

import needs
import slurm_fixtures
from slurm_fixtures import job_fields, sbatch, slurm, wait_for, wait_job_finished


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="relaytrain")
    cluster_commands.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def needs_two_nodes(info) -> None:
    if len(info.nodes) < 2:
        pytest.fail(f"this test needs a cluster of at least 2 nodes, the running one has {len(info.nodes)}")


@pytest.mark.slurm
def test_up_is_idempotent_and_status_shows_the_cluster(slurm_cluster, capsys):
    # On a healthy cluster: a node an earlier test killed, or one Slurm marked down while a loaded
    # machine kept its slurmd from answering in time (SlurmdTimeout), is back in service first.
    for name in slurm_cluster.nodes:
        local_cluster.restart_node(name, slurm_cluster.base_dir)
    assert run_cli("cluster", "up", "--nodes", str(len(slurm_cluster.nodes)),
                   "--cpus-per-node", str(slurm_cluster.cpus_per_node)) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "already up" in out, (out, local_cluster.node_states(slurm_cluster.base_dir))
    assert f"export SLURM_CONF={slurm_cluster.slurm_conf}" in out
    again = local_cluster.cluster_up(len(slurm_cluster.nodes), slurm_cluster.cpus_per_node)
    assert again.started is False and again.slurm_conf == slurm_cluster.slurm_conf

    with pytest.raises(UserError, match="cluster down"):
        local_cluster.cluster_up(len(slurm_cluster.nodes) + 1, slurm_cluster.cpus_per_node)

    assert run_cli("cluster", "status") == 0
    out = capsys.readouterr().out
    assert "slurmctld" in out and "running" in out and "PARTITION" in out and "JOBID" in out
    assert run_cli("cluster", "status", "--json") == 0
    status = json.loads(capsys.readouterr().out)
    assert status["up"] is True
    assert set(status["nodes"]) == set(slurm_cluster.nodes)
    assert all(status["daemons"].values())


@pytest.fixture(scope="module")
def two_by_two_job(slurm_cluster, tmp_path_factory):
    needs_two_nodes(slurm_cluster)
    out = tmp_path_factory.mktemp("job") / "tasks.out"
    task = 'echo "$SLURM_PROCID $SLURMD_NODENAME $(hostname) $(hostname -I)"'
    job_id = sbatch("--nodes=2", "--ntasks-per-node=2", f"--output={out}", f"--wrap=srun sh -c '{task}'")
    fields = wait_job_finished(job_id, timeout=60)
    return job_id, fields, out.read_text().split("\n")


@pytest.mark.slurm
def test_two_node_job_runs_tasks_on_two_distinct_nodes(two_by_two_job):
    _, fields, lines = two_by_two_job
    assert fields["JobState"] == "COMPLETED"
    rows = [line.split() for line in lines if line.strip()]
    assert sorted(int(row[0]) for row in rows) == [0, 1, 2, 3]
    by_node = {row[1]: (row[2], row[3]) for row in rows}
    assert len(by_node) == 2, rows
    for node, (hostname, address) in by_node.items():
        assert hostname == node  # each node has its own UTS namespace
        assert address == net.node_addr(net.node_index(node))  # ... and its own network namespace


@pytest.mark.slurm
def test_sacct_completion_query_reports_finished_job(two_by_two_job):
    job_id = two_by_two_job[0]

    def record():
        out = slurm("sacct", "-c", "-j", str(job_id), "-n", "-P", "-o", "jobid,state,exitcode,nnodes,ncpus")
        return out.strip()

    assert wait_for(record, 15, "the jobcomp record").split("|")[:4] == [str(job_id), "COMPLETED", "0:0", "2"]


ALL_REDUCE = """
    import os, socket, subprocess
    import torch, torch.distributed as dist
    nodes = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                           capture_output=True, text=True, check=True).stdout.split()
    os.environ["MASTER_ADDR"] = nodes[0]
    os.environ["MASTER_PORT"] = str(20000 + int(os.environ["SLURM_JOB_ID"]) % 10000)
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    print(rank, socket.gethostname(), value.item(), flush=True)
    dist.destroy_process_group()
"""


@pytest.mark.slurm
def test_torch_gloo_all_reduce_across_two_nodes(slurm_cluster, tmp_path):
    needs_two_nodes(slurm_cluster)
    script = tmp_path / "all_reduce.py"
    script.write_text(textwrap.dedent(ALL_REDUCE))
    out = tmp_path / "all_reduce.out"
    job_id = sbatch("--nodes=2", "--ntasks-per-node=1", f"--output={out}",
                    f"--wrap=srun {sys.executable} {script}")  # fmt: skip
    fields = wait_job_finished(job_id, timeout=150)
    text = out.read_text()
    assert fields["JobState"] == "COMPLETED", text
    rows = sorted(line.split() for line in text.splitlines() if line[:1].isdigit())
    assert [row[0] for row in rows] == ["0", "1"], text
    assert {row[1] for row in rows} == set(slurm_cluster.nodes[:2])
    assert all(float(row[2]) == 3.0 for row in rows)


def restart_marker_job(tmp_path: Path, name: str, *args: str) -> tuple[int, Path]:
    """A requeue-able job that logs each run's SLURM_RESTART_COUNT and node, then waits to be stopped."""
    out = tmp_path / f"{name}.out"
    body = 'echo "run ${SLURM_RESTART_COUNT:-0} $SLURMD_NODENAME"; sleep 300 & wait'
    job_id = sbatch("--requeue", "--open-mode=append", f"--job-name={name}", f"--output={out}", *args,
                    f"--wrap={body}")  # fmt: skip
    return job_id, out


def runs(out: Path) -> list[list[str]]:
    text = out.read_text() if out.exists() else ""
    return [line.split()[1:] for line in text.splitlines() if line.startswith("run ")]


@pytest.mark.slurm
def test_high_partition_preempts_and_requeues_debug_job(slurm_cluster, tmp_path):
    nodes, cpus = len(slurm_cluster.nodes), slurm_cluster.cpus_per_node
    whole_cluster = (f"--nodes={nodes}", f"--ntasks-per-node={cpus}")
    low, low_out = restart_marker_job(tmp_path, "low", "--partition=debug", *whole_cluster)
    try:
        wait_for(lambda: runs(low_out), 30, "the debug job to start")
        high = sbatch("--partition=high", *whole_cluster, f"--output={tmp_path / 'high.out'}", "--wrap=true")
        assert wait_job_finished(high, timeout=90)["JobState"] == "COMPLETED"
        wait_for(lambda: len(runs(low_out)) >= 2, 60, "the preempted job to run again")
        assert [run[0] for run in runs(low_out)] == ["0", "1"]
        assert job_fields(low)["Restarts"] == "1"
    finally:
        slurm("scancel", str(low))


@pytest.mark.slurm
def test_killed_node_is_marked_down_and_its_job_requeued(slurm_cluster, tmp_path):
    needs_two_nodes(slurm_cluster)
    job_id, out = restart_marker_job(tmp_path, "victim", "--nodes=1")
    victim = None
    try:
        victim = wait_for(lambda: runs(out) and runs(out)[0][1], 30, "the job to start")
        killed = local_cluster.kill_node(victim)
        assert killed and not any(daemons.pid_alive(pid) for pid in killed)
        wait_for(lambda: local_cluster.node_states(slurm_cluster.base_dir).get(victim, "").startswith("down"),
                 60, f"slurmctld to mark {victim} down")  # fmt: skip
        wait_for(lambda: len(runs(out)) >= 2, 60, "the job to run again on another node")
        second_run = runs(out)[1]
        assert second_run[0] == "1" and second_run[1] != victim
    finally:
        slurm("scancel", str(job_id))
        if victim:
            local_cluster.restart_node(victim)
    assert local_cluster.node_states(slurm_cluster.base_dir)[victim] == "idle"


@pytest.mark.slurm
def test_down_removes_everything_and_up_restores(slurm_cluster):
    if not daemons.is_root():
        needs.skip_or_fail("stopping and restarting the cluster needs root")
    base = slurm_cluster.base_dir
    pids = [daemons.read_pid(p) for p in sorted((base / "run").glob("*.pid"))]
    assert len(pids) == len(slurm_cluster.nodes) + 1
    sbatch("--wrap=sleep 300", "--output=/dev/null")
    try:
        assert local_cluster.cluster_down(base) is True
        assert not any(daemons.pid_alive(pid) for pid in pids)
        assert net.our_namespaces() == []
        assert net.HOSTS_MARKER not in Path("/etc/hosts").read_text()
        assert local_cluster.cluster_status(base)["up"] is False
        assert run_cli("cluster", "status", "--base-dir", str(base)) == 1
        assert local_cluster.cluster_down(base) is False
    finally:
        # Later tests in the session share this cluster.
        info = local_cluster.cluster_up(len(slurm_cluster.nodes), slurm_cluster.cpus_per_node, base)
    assert info.started and local_cluster.cluster_status(base)["up"] is True
    assert os.environ["SLURM_CONF"] == str(info.slurm_conf)


def test_hosts_entries_are_added_once_and_removed_cleanly(tmp_path, monkeypatch):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n10.0.0.5 other\n")
    monkeypatch.setattr(net, "HOSTS_FILE", hosts)
    net.set_hosts_entries(2)
    net.set_hosts_entries(2)
    lines = hosts.read_text().splitlines()
    assert lines[:2] == ["127.0.0.1 localhost", "10.0.0.5 other"]
    assert lines[2:] == [f"10.250.0.1 nsctl {net.HOSTS_MARKER}", f"10.250.0.11 nsnode1 {net.HOSTS_MARKER}",
                         f"10.250.0.12 nsnode2 {net.HOSTS_MARKER}"]  # fmt: skip
    net.set_hosts_entries(1)
    assert hosts.read_text().count(net.HOSTS_MARKER) == 2
    net.remove_hosts_entries()
    assert hosts.read_text() == "127.0.0.1 localhost\n10.0.0.5 other\n"


def test_up_without_root_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(daemons, "is_root", lambda: False)
    monkeypatch.setattr(daemons, "missing_packages", lambda: ["munge", "slurmctld"])
    with pytest.raises(UserError, match="as root run: apt-get update && .*apt-get install .*munge slurmctld"):
        local_cluster.cluster_up(base_dir=tmp_path)
    monkeypatch.setattr(daemons, "missing_packages", lambda: [])
    with pytest.raises(UserError, match="needs root: sudo relaytrain cluster up"):
        local_cluster.cluster_up(base_dir=tmp_path)
    with pytest.raises(UserError, match="--nodes must be between 1 and"):
        local_cluster.cluster_up(nodes=0, base_dir=tmp_path)


def test_fixture_skips_locally_but_fails_under_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs root"):
        slurm_fixtures._give_up("starting one needs root")
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="CI is set"):
        slurm_fixtures._give_up("starting one needs root")
