"""`relaytrain preflight` in a real Slurm allocation of 2 nodes: run as a job step, one task per node, it
names the node whose rank a CPU quota slows from outside (faults.throttle, as the straggler tests do), in
one line, and writes both nodes' results to the run's preflight folder."""

from __future__ import annotations

import json
import re
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


def test_every_job_step_is_checked_before_its_first_step_unless_off(slurm_cluster, tmp_path):
    from e2e_slurm_jobs import job_output, launch, records, write_config

    runs = tmp_path / "runs"
    jobs = {}
    for name, value in (("on", "report"), ("off", "off")):
        cfg = write_config(tmp_path / f"{name}.toml", runs, name, steps=3)
        jobs[name] = launch(
            str(cfg), "--nodes", "2", "--tasks-per-node", "1", f"--resilience.preflight={value}"
        )
    fields = {name: wait_job_finished(int(job), timeout=300) for name, job in jobs.items()}
    assert all(f["JobState"] == "COMPLETED" for f in fields.values()), fields
    out = job_output(runs / "on", jobs["on"])
    # its summary (the shared cores may make a clean node look slow: it is named, and the run goes on)
    told = re.compile(r"^preflight: (2 node\(s\) passed|1 of 2 node\(s\) below threshold: \S+) in ", re.M)
    assert told.search(out), out[-4000:]
    record = json.loads((runs / "on" / "preflight" / f"{jobs['on']}.json").read_text())
    assert record["time"] < min(r["time"] for r in records(runs / "on", "train"))  # before the first step
    assert len(record["nodes"]) == 2 and all(r["figures"]["gbps"] > 0 for r in record["ranks"])
    assert (
        "preflight: " not in job_output(runs / "off", jobs["off"])
        and not (runs / "off" / "preflight").exists()
    )
