"""Stragglers on the real local Slurm cluster: a rank slowed from outside the run is named.

One job of 2 nodes x 1 task trains the benchmark's small model (bench/cluster/stragglers.py's
QUICK_TRIAL_MODEL: a forward phase of 50-115 ms and an optimizer phase of about 30 ms, both above the
20 ms floor of phases timed by the host's clock) for ``STEPS`` steps with the default straggler settings.
Rank 1's process gets a CPU quota of a quarter of its one compute thread once the run has logged a few
steps (``python -m faults.throttle``, from outside the job), lifted once it is named: one ``straggler:``
line names rank 1 and its node within 50 steps, a ``straggler`` event is in metrics.jsonl and
``relaytrain status`` shows it.

A clean run names no straggler only where each rank's cores run nothing else (docs/resilience.md,
"Where the rule holds"): on this machine's 2 shared cores the kept trials gave false reports in 7 of 12
(docs/benchmarks.md), and a clean job beside this one did in the suite's runs of 2026-12-07 (rank 0 17 %,
rank 1 15 % slower in forward). That claim is the benchmark's (``python -m bench.stragglers --test``),
not this module's.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e_slurm_jobs import cli, job_output, launch, records

import faults
import faults.throttle as throttle
from bench.cluster.stragglers import QUICK_TRIAL_MODEL, straggler_config
from conftest import REPO
from slurm_fixtures import job_fields, wait_for, wait_job_finished

pytestmark = pytest.mark.slurm

STEPS = 70  # the throttle at step 10, then 60 steps: the shipped rule names within 45
FACTOR = 4.0  # a quarter of a CPU: it bites even when the suite loads the 2 shared cores
THROTTLE_AT_STEP = 10
NODES = ("--nodes", "2", "--tasks-per-node", "1")


def straggler_lines(run_dir: Path, job: str) -> list[str]:
    return [line for line in job_output(run_dir, job).splitlines() if "straggler: " in line]


@pytest.fixture(scope="module")
def stragglers(slurm_cluster, tmp_path_factory):
    base = tmp_path_factory.mktemp("stragglers")
    runs = base / "runs"
    jobs: dict[str, str] = {}
    pid = None
    try:
        cfg = base / "slow.toml"
        cfg.write_text(straggler_config("slow", runs, STEPS, QUICK_TRIAL_MODEL))
        jobs["slow"] = launch(str(cfg), *NODES)

        def reached():
            step = max((r["step"] for r in records(runs / "slow", "train")), default=0)
            return step >= THROTTLE_AT_STEP and throttle.rank_pid(jobs["slow"], 1)

        pid = wait_for(reached, 120, f"job {jobs['slow']} to reach step {THROTTLE_AT_STEP}", interval=0.2)
        done = subprocess.run(
            [sys.executable, "-m", "faults.throttle", "--pid", str(pid), "--factor", str(FACTOR)],
            cwd=REPO, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        throttled_at = max(r["step"] for r in records(runs / "slow", "train"))
        node = throttle._environ(pid)["SLURMD_NODENAME"]

        def named_or_ended():
            named = any(r.get("event") == "straggler" for r in records(runs / "slow", "event"))
            return named or job_fields(int(jobs["slow"])).get("JobState") not in ("RUNNING", "PENDING")

        # Once the rank is named, the rest of the run goes at full speed, not a quarter-speed tail.
        wait_for(named_or_ended, 600, f"job {jobs['slow']} to name a straggler", interval=0.5)
        throttle.release(pid)
        fields = {name: wait_job_finished(int(job), timeout=600) for name, job in jobs.items()}
        yield {"runs": runs, "jobs": jobs, "fields": fields, "landed": done.stdout, "node": node,
               "throttled_at": throttled_at, "time": time.time()}  # fmt: skip
    finally:
        if pid is not None:
            throttle.release(pid)
        subprocess.run(["scancel", *jobs.values()], capture_output=True, timeout=30)


def test_a_throttled_rank_is_named_with_its_node_within_50_steps(stragglers):
    runs, job, node = stragglers["runs"], stragglers["jobs"]["slow"], stragglers["node"]
    assert faults.landed(stragglers["landed"]), stragglers["landed"]
    assert stragglers["fields"]["slow"]["JobState"] == "COMPLETED"
    lines = straggler_lines(runs / "slow", job)
    assert lines, job_output(runs / "slow", job)[-4000:]
    assert f"straggler: rank 1 on {node} " in lines[0], lines
    assert re.search(r"% slower in (forward|optimizer) since step ", lines[0]), lines  # what a quota slows
    events = [r for r in records(runs / "slow", "event") if r.get("event") == "straggler"]
    assert events and events[0]["rank"] == 1 and events[0]["node"] == node, events
    assert events[0]["step"] - stragglers["throttled_at"] <= 50, (events, stragglers["throttled_at"])
    assert events[0]["slower"] > 0.15 and events[0]["action"] == "report"
    timed = records(runs / "slow", "rank_times")
    assert timed, "no per-rank times recorded"
    # every rank timed its layers' forward computation (the first window may hold no whole step)
    assert all(r[f"rank{k}_forward_fastest_s"] > 0 for r in timed[1:] for k in (0, 1)), timed[-1]
    code, out = cli("status", str(runs / "slow"))
    assert code == 0 and f"rank 1 on {node}" in out, out
