"""Pytest fixture and helpers for tests that run on a real local Slurm cluster.

tests/conftest.py makes the fixture visible to every test file with::

    from slurm_fixtures import slurm_cluster  # noqa: F401

Tests using it are marked ``@pytest.mark.slurm``. The session's cluster is reused when it is already
up (a developer's `relaytrain cluster up`) or started and stopped at the end of the session: the
session's last step, not a worker's, under xdist (a worker that started it and finished its tests first
would otherwise cancel the other lanes' jobs as it stopped the cluster). It skips only where Slurm
cannot be started here; with ``CI`` set it fails instead of skipping.

Each lane of tests/slurm_grouping.py gets nodes of its own: the cluster has ``NODES_PER_LANE`` nodes a
lane, and each lane's jobs go to partitions that hold only its nodes (lane 1 keeps the cluster's own
`debug` and `high`, restricted to its nodes; lane K gets `debugK` and `highK`). A module's
``slurm_cluster`` is its lane's view: its nodes, its partitions, and the environment (SBATCH_PARTITION
and its kin) that sends every job the module submits there. So two lanes never share a node, and a
module that kills nodes, times ranks or needs idle nodes has its lane's nodes to itself. A module that
needs the whole cluster (it stops the cluster, or starts clusters of its own) sees every node in the
cluster's own partitions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from relaytrain.errors import UserError
from relaytrain.localcluster import cluster as local_cluster
from relaytrain.localcluster.daemons import install_command, is_root, missing_packages

import needs
from slurm_grouping import LANE_COUNT, lane_number, needs_whole_cluster, worker_dir

# Under xdist, the worker that started the cluster leaves this note for the controller, which stops the
# cluster once every worker has finished (tests/slurm_grouping.py's pytest_sessionfinish).
STARTED_NOTE = "cluster-started"

# Nodes a lane: 3, so a 2-node job has a spare in its lane (tests/test_spare_slurm.py).
NODES_PER_LANE = 3
CLUSTER_NODES = NODES_PER_LANE * LANE_COUNT
CLUSTER_CPUS_PER_NODE = 4
# What the bench harness (bench/cluster/harness.py) preempts a job with.
PREEMPT_PARTITION_ENV = "RELAYTRAIN_PREEMPT_PARTITION"
# The cluster's own partitions' settings (relaytrain/localcluster/templates/slurm.conf.j2), for a lane's.
JOBS_PARTITION = ("PriorityTier=1", "GraceTime=5")
PREEMPTING_PARTITION = ("PriorityTier=10", "PreemptMode=OFF")
FINISHED_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}


def _why_slurm_cannot_start() -> str | None:
    if is_root():
        missing = missing_packages()
        if missing and shutil.which("apt-get") is None:
            return f"Slurm is not installed ({', '.join(missing)}) and there is no apt-get to install it"
        return None
    missing = missing_packages()
    if missing:
        return f"Slurm is not installed and this is not root; as root run: {install_command(missing)}"
    return "no local Slurm cluster is up and starting one needs root: sudo relaytrain cluster up"


def _the_suites_cluster():
    """(ClusterInfo, started here): the running cluster when it fits the suite, else one (re)started."""
    info = local_cluster.running_cluster()
    if info is not None and (
        not local_cluster.has_node_memory(info.base_dir) or len(info.nodes) < CLUSTER_NODES
    ):
        # Nodes without private /dev/shm (an older relaytrain started them), or fewer nodes than the
        # suite needs: restarted in place, under the Slurm test lock like every use of the cluster, and
        # left up like the one it replaces.
        nodes = max(len(info.nodes), CLUSTER_NODES)
        local_cluster.cluster_down(info.base_dir)
        info = local_cluster.cluster_up(nodes=nodes, cpus_per_node=info.cpus_per_node)
    if info is not None:
        return info, False
    reason = _why_slurm_cannot_start()
    if reason:
        _give_up(reason)
    try:
        # cluster_up waits for a start already in progress (another process) and reuses it.
        info = local_cluster.cluster_up(nodes=CLUSTER_NODES, cpus_per_node=CLUSTER_CPUS_PER_NODE)
    except (UserError, RuntimeError, OSError, subprocess.SubprocessError) as error:
        pytest.fail(f"could not start the local Slurm cluster: {error}", pytrace=False)
    return info, info.started


def _give_up(reason: str) -> None:
    needs.skip_or_fail(f"Slurm tests need the local cluster: {reason}")


@pytest.fixture(scope="session")
def suite_cluster(pytestconfig):
    """The running local cluster (ClusterInfo), with SLURM_CONF exported for the whole session."""
    # The lanes' workers ask at once: one looks and starts or restarts, the others then find it up (a
    # second restart would cancel the first lane's jobs).
    with open(Path(tempfile.gettempdir()) / "relaytrain-suite-cluster.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        info, started_here = _the_suites_cluster()
    try:
        with _exported(info.env):
            yield info
    finally:
        if started_here:
            folder = worker_dir(pytestconfig)
            if folder is None:
                local_cluster.cluster_down(info.base_dir)
            else:  # other workers may still have jobs on it
                (folder / STARTED_NOTE).write_text(str(info.base_dir))


@dataclasses.dataclass(frozen=True)
class LaneCluster(local_cluster.ClusterInfo):
    """A module's view of the cluster: its lane's nodes and partitions (every node for a module that needs
    the whole cluster)."""

    partition: str = "debug"  # where the module's jobs run
    preempting_partition: str = "high"  # a job here preempts those of `partition`

    @property
    def env(self) -> dict[str, str]:
        # sbatch, salloc and srun read their default partition from these; the bench harness its own.
        return {
            **super().env,
            "SBATCH_PARTITION": self.partition,
            "SALLOC_PARTITION": self.partition,
            "SLURM_PARTITION": self.partition,
            PREEMPT_PARTITION_ENV: self.preempting_partition,
        }


def lane_partitions(lane: int) -> tuple[str, str]:
    """A lane's partitions: its jobs' and the one that preempts them."""
    return ("debug", "high") if lane == 1 else (f"debug{lane}", f"high{lane}")


def lane_nodes(info, lane: int) -> tuple[str, ...]:
    return tuple(info.nodes[(lane - 1) * NODES_PER_LANE : lane * NODES_PER_LANE])


def _partition_nodes(name: str) -> str | None:
    done = subprocess.run(["scontrol", "show", "partition", name], capture_output=True, text=True, timeout=30)
    found = re.search(r"\bNodes=(\S+)", done.stdout) if done.returncode == 0 else None
    return found.group(1) if found else None


def _set_partition(name: str, nodes: str, options: tuple[str, ...]) -> None:
    verb = "update" if _partition_nodes(name) is not None else "create"
    slurm(
        "scontrol", verb, f"PartitionName={name}", f"Nodes={nodes}", "State=UP", "MaxTime=INFINITE", *options
    )


def set_lanes(info, split: bool) -> None:
    """Give each lane its nodes (``split``), or give the cluster's own partitions every node back. Idempotent,
    one caller at a time (the lanes' workers set them up at once)."""
    with open(Path(info.base_dir) / "suite-lanes.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not split:
            for name, options in zip(lane_partitions(1), (JOBS_PARTITION, PREEMPTING_PARTITION), strict=True):
                _set_partition(name, "ALL", options)
            return
        for lane in range(1, LANE_COUNT + 1):
            nodes = ",".join(lane_nodes(info, lane))
            for name, options in zip(
                lane_partitions(lane), (JOBS_PARTITION, PREEMPTING_PARTITION), strict=True
            ):
                _set_partition(name, nodes, options)


def lane_view(info, module: str) -> LaneCluster:
    """The module's view of the session's cluster, its partitions set up for it."""
    fields = {
        field.name: getattr(info, field.name) for field in dataclasses.fields(local_cluster.ClusterInfo)
    }
    if needs_whole_cluster(module):
        set_lanes(info, split=False)
        return LaneCluster(**fields)
    lane = lane_number(module)
    set_lanes(info, split=True)
    jobs, preempting = lane_partitions(lane)
    return LaneCluster(
        **{**fields, "nodes": lane_nodes(info, lane)}, partition=jobs, preempting_partition=preempting
    )


@pytest.fixture(scope="module")
def slurm_cluster(suite_cluster, request):
    """The local cluster as this module sees it (LaneCluster), its environment exported while it runs."""
    view = lane_view(suite_cluster, request.node.nodeid)
    with _exported(view.env):
        yield view


@contextlib.contextmanager
def _exported(env: dict[str, str]):
    """``env`` in os.environ while the block runs; what was there before, after it."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def stop_the_cluster_a_worker_started(folder) -> None:
    """Controller, after every worker has finished: stop the cluster a worker started this session."""
    note = folder / STARTED_NOTE
    if note.is_file():
        local_cluster.cluster_down(note.read_text())


def slurm(*args: str, timeout: float = 30.0) -> str:
    """Run a Slurm client command (SLURM_CONF comes from the fixture) and return its stdout."""
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def sbatch(*args: str) -> int:
    """Submit a batch job; returns its id."""
    return int(slurm("sbatch", "--parsable", *args).strip().split(";")[0])


def job_fields(job_id: int) -> dict[str, str]:
    """``scontrol show job`` as a dict (JobState, Restarts, NodeList, Reason...)."""
    text = slurm("scontrol", "show", "job", str(job_id))
    return dict(re.findall(r"(?:^|\s)(\w+)=(\S*)", text))


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5):
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def wait_job_finished(job_id: int, timeout: float = 120.0) -> dict[str, str]:
    """Wait until the job reaches a final state; returns its ``scontrol show job`` fields."""

    def finished():
        fields = job_fields(job_id)
        return fields if fields.get("JobState") in FINISHED_STATES else None

    return wait_for(finished, timeout, f"job {job_id} to finish")
