"""resilience.collective_timeout_s reaches every process group, not only the default one: the device
mesh's groups (pp, dp_replicate, dp_shard, cp, tp and the flattened dp, dp_shard_cp) and the
persistence front's gloo groups are created with the backend's default (NCCL 600 s, gloo 1800 s) unless
set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import child_env

WORKER = Path(__file__).with_name("group_timeout_worker.py")


def test_every_group_gets_the_collective_timeout(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(WORKER)]
        + ["97", "2", "1", "2"],  # timeout, dp_replicate, dp_shard, pp
        cwd=tmp_path,
        # 2 threads a rank, more than a 2-core machine's share over 4 ranks: the rank keeps the
        # OMP_NUM_THREADS it was given (the job script sets it from slurm.cpus_per_task).
        env=child_env(OMP_NUM_THREADS="2"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("groups-rank*.json"))]
    assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3]
    for report in reports:
        assert sorted(report["dims"]) == ["cp", "dp_replicate", "dp_shard", "pp", "tp"]
        # the default group, 5 mesh dims, 2 flattened dims, 3 persistence groups (control, DCP, replicas)
        assert len(report["groups"]) == 11, report
        assert set(report["groups"].values()) == {97.0}, report
        assert report["threads"] == min(2, os.cpu_count()), report  # torch caps it at the cores


def test_a_cpu_rank_without_omp_num_threads_gets_its_share_of_the_cores_it_may_run_on(monkeypatch):
    """Not the machine's cores: those of the process's affinity mask (Slurm's or taskset's)."""
    from relaytrain.parallel.distributed import cpu_threads_per_rank

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {4, 5, 6, 7, 8, 9})
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    assert cpu_threads_per_rank(2, {}) == 3
    assert cpu_threads_per_rank(4, {"OMP_NUM_THREADS": ""}) == 1
    assert cpu_threads_per_rank(8, {}) == 1
    assert cpu_threads_per_rank(2, {"OMP_NUM_THREADS": "5"}) is None
