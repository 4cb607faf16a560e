"""Pytest fixture and helpers for tests that run on a real local Slurm cluster.

tests/conftest.py makes the fixture visible to every test file with::

    from slurm_fixtures import slurm_cluster  # noqa: F401

Tests using it are marked ``@pytest.mark.slurm``. The fixture reuses a cluster that is already up
(a developer's `relaytrain cluster up`) or starts one and stops it at the end of the session: the
session's last step, not a worker's, under xdist (a worker that started it and finished its tests first
would otherwise cancel the other lane's jobs as it stopped the cluster). It skips
only where Slurm cannot be started here; with ``CI`` set it fails instead of skipping.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

import pytest

from relaytrain.errors import UserError
from relaytrain.localcluster import cluster as local_cluster
from relaytrain.localcluster.daemons import install_command, is_root, missing_packages

import needs
from slurm_grouping import worker_dir

# Under xdist, the worker that started the cluster leaves this note for the controller, which stops the
# cluster once every worker has finished (tests/slurm_grouping.py's pytest_sessionfinish).
STARTED_NOTE = "cluster-started"

# The suite's cluster: 3 nodes, so a 2-node job has a spare (tests/test_spare_slurm.py).
CLUSTER_NODES = 3
CLUSTER_CPUS_PER_NODE = 4
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


def _give_up(reason: str) -> None:
    needs.skip_or_fail(f"Slurm tests need the local cluster: {reason}")


@pytest.fixture(scope="session")
def slurm_cluster(pytestconfig):
    """A running local cluster (ClusterInfo), with SLURM_CONF exported for the whole session."""
    info = local_cluster.running_cluster()
    started_here = False
    if info is not None and (
        not local_cluster.has_node_memory(info.base_dir) or len(info.nodes) < CLUSTER_NODES
    ):
        # Nodes without private /dev/shm (an older relaytrain started them), or fewer nodes than the
        # suite needs: restarted in place, under the Slurm test lock like every use of the cluster, and
        # left up like the one it replaces.
        nodes = max(len(info.nodes), CLUSTER_NODES)
        local_cluster.cluster_down(info.base_dir)
        info = local_cluster.cluster_up(nodes=nodes, cpus_per_node=info.cpus_per_node)
    if info is None:
        reason = _why_slurm_cannot_start()
        if reason:
            _give_up(reason)
        try:
            # cluster_up waits for a start already in progress (another process) and reuses it.
            info = local_cluster.cluster_up(nodes=CLUSTER_NODES, cpus_per_node=CLUSTER_CPUS_PER_NODE)
        except (UserError, RuntimeError, OSError, subprocess.SubprocessError) as error:
            pytest.fail(f"could not start the local Slurm cluster: {error}", pytrace=False)
        started_here = info.started
    saved = {key: os.environ.get(key) for key in info.env}
    os.environ.update(info.env)
    try:
        yield info
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if started_here:
            folder = worker_dir(pytestconfig)
            if folder is None:
                local_cluster.cluster_down(info.base_dir)
            else:  # other workers may still have jobs on it
                (folder / STARTED_NOTE).write_text(str(info.base_dir))


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
