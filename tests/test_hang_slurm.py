"""Hangs on the real local Slurm cluster: found in well under a minute, named, and restarted in place.

Four jobs of 2 nodes x 1 task run at once (one module fixture), each with in-memory snapshots every 5
steps and a hang floor of 10 s (``resilience.hang_floor_s``), the first run slowed by a step delay:

* rank 1, then (another job) rank 0, is stopped with SIGSTOP from outside the job (rank 0 also hosts
  the rendezvous store): the node watchers see it in state T, the monitor names it and its node in one
  ``hang detected:`` line, writes ``logs/hang-step<N>.md`` with every rank's state and stacks, the step is
  ended and restarted in place from the snapshot, and the run ends with the uninterrupted run's losses;
* rank 1 blocks opening a FIFO that no one writes (a dead mount's stand-in) in its data phase
  (``RELAYTRAIN_FAULT_FIFO_AT_STEP``): named with the data phase;
* rank 1 runs 8x slower from step 2 (``RELAYTRAIN_FAULT_SLOW_FACTOR``): reported as ``straggler hint:``, never
  as a hang, no restart;
* rank 1 is SIGKILLed from outside and rank 0 stops itself in the rendezvous of the restart in place that
  follows (``RELAYTRAIN_FAULT_STOP_IN_PHASE``, job step 1): the restarted step hangs in its start-up, is
  named with the rendezvous phase, and is restarted in place again (no requeue: a hang the monitor ended
  is no crash loop).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from e2e_slurm_jobs import (
    FIRST_RUN_ONLY,
    assert_losses_match,
    cli,
    job_log,
    launch,
    records,
    setup_override,
    start_reference,
    write_config,
)
from relaytrain.job import RunDir
from relaytrain.resilience.batch.crash import CrashLog

import faults
from bench.cluster.harness import node_of, rank_pids
from slurm_fixtures import wait_for, wait_job_finished

pytestmark = pytest.mark.slurm

STEPS = 24
CONFIG = """
[checkpoint]
interval = 1000
snapshot_every = 5

[resilience]
hang_floor_s = 10
"""
NODES = ("--nodes", "2", "--tasks-per-node", "1")


def slowed(**fault: object) -> str:
    return setup_override(FIRST_RUN_ONLY.format(faults.setup_line(step_delay_s=0.3, **fault)))


def stop_rank_at(run_dir: Path, job: str, rank: int, step: int) -> tuple[int, str, float]:
    """SIGSTOP the rank once the run logged `step`: (pid, node, when)."""

    def reached():
        return max((r["step"] for r in records(run_dir, "train")), default=0) >= step and rank_pids(job, rank)

    wait_for(reached, 240, f"job {job} to reach step {step}", interval=0.5)
    pid = rank_pids(job, rank)[0]
    os.kill(pid, signal.SIGSTOP)
    return pid, node_of(pid), time.time()


@pytest.fixture(scope="module")
def hangs(slurm_cluster, tmp_path_factory):
    base = tmp_path_factory.mktemp("hangs")
    runs = base / "runs"
    cfg = write_config(base / "hang.toml", runs, "hang", STEPS)
    cfg.write_text(cfg.read_text() + CONFIG)
    reference = start_reference(runs / "reference", cfg)
    jobs: dict[str, str] = {}
    stopped: dict[str, tuple[int, str, float]] = {}
    try:
        for name in ("stop1", "stop0"):
            jobs[name] = launch(str(cfg), "--name", name, *NODES, slowed())
        jobs["fifo"] = launch(str(cfg), "--name", "fifo", *NODES, slowed(fifo_at_step=8, rank=1))
        # 8x: about a minute of slow steps, the monitor's window (its report wants 10 looks that held at
        # one instant with the ranks apart, and many looks fall while a rank moves)
        slow = slowed(slow_factor=8, slow_from_step=2, rank=1)
        jobs["slow"] = launch(str(cfg), "--name", "slow", *NODES, slow)
        restart = slowed(rank=0, stop_in_phase="rendezvous", stop_in_job_step=1)
        jobs["restart"] = launch(str(cfg), "--name", "restart", *NODES, restart)
        for name, rank in (("stop1", 1), ("stop0", 0)):
            stopped[name] = stop_rank_at(runs / name, jobs[name], rank, 8)
        pid, _node, _when = stop_rank_at(runs / "restart", jobs["restart"], 1, 8)
        os.kill(pid, signal.SIGKILL)  # the restart in place follows; rank 0 stops itself in its rendezvous
        fields = {name: wait_job_finished(int(job), timeout=600) for name, job in jobs.items()}
        out, _ = reference.communicate(timeout=300)
        assert reference.returncode == 0, out[-3000:]
        losses = {r["step"]: r["loss"] for r in records(runs / "reference", "train")}
        yield {"runs": runs, "jobs": jobs, "fields": fields, "stopped": stopped, "losses": losses}
    finally:
        for pid, _node, _when in stopped.values():
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
        subprocess.run(["scancel", *jobs.values()], capture_output=True, timeout=30)
        if reference.poll() is None:
            reference.kill()


def hang_lines(run_dir: Path, job: str) -> list[str]:
    text = (run_dir / "slurm" / f"{job}.out").read_text(errors="replace")
    return [line for line in text.splitlines() if line.startswith("hang detected: ")]


def assert_named_and_restarted(hangs, name: str, rank: int, node: str, phase: str) -> dict:
    run_dir, job = hangs["runs"] / name, hangs["jobs"][name]
    log = job_log(run_dir, job)
    fields = hangs["fields"][name]
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "0", log
    lines = hang_lines(run_dir, job)
    assert len(lines) == 1, log
    assert lines[0].startswith(f"hang detected: rank {rank} on {node} in {phase}"), lines[0]
    entries = CrashLog(RunDir(run_dir)).entries()
    assert len(entries) == 1 and entries[0]["action"] == "restart", entries
    hang = entries[0]["hang"]
    assert [(c["rank"], c["node"]) for c in hang["culprits"]] == [(rank, node)], hang
    report = (run_dir / hang["report"]).read_text()
    assert f"rank {rank}" in report and "Python stacks" in report, report[:2000]
    assert_losses_match(run_dir, hangs["losses"])
    code, out = cli("status", str(run_dir))
    assert code == 0 and f"rank {rank} on {node}" in out, out
    return hang


@pytest.mark.parametrize("rank", [1, 0])
def test_a_stopped_rank_is_named_within_the_floor_and_the_step_restarts_in_place(hangs, rank):
    name = f"stop{rank}"
    _pid, node, stopped_at = hangs["stopped"][name]
    assert_named_and_restarted(hangs, name, rank, node, "")
    run_dir = hangs["runs"] / name
    report = next((run_dir / "logs").glob("hang-step*.md")).read_text()
    assert "state T" in report, report[:2000]
    crash_time = CrashLog(RunDir(run_dir)).entries()[0]["time"]
    assert crash_time - stopped_at < 60, "detection and the end of the step took a minute or more"


def test_a_rank_blocked_on_a_dead_file_is_named_in_its_data_phase(hangs):
    run_dir, job = hangs["runs"] / "fifo", hangs["jobs"]["fifo"]
    assert faults.landed(job_log(run_dir, job) + (run_dir / "slurm" / f"{job}.out").read_text())
    hang = CrashLog(RunDir(run_dir)).entries()[0]["hang"]
    node = hang["culprits"][0]["node"]
    assert_named_and_restarted(hangs, "fifo", 1, node, "data")


def test_a_slow_rank_is_reported_slow_and_never_restarted(hangs):
    run_dir, job = hangs["runs"] / "slow", hangs["jobs"]["slow"]
    text = (run_dir / "slurm" / f"{job}.out").read_text(errors="replace")
    fields = hangs["fields"]["slow"]
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "0", text[-4000:]
    assert not hang_lines(run_dir, job) and not CrashLog(RunDir(run_dir)).entries(), text[-4000:]
    slow = [line for line in text.splitlines() if "straggler hint: rank 1 " in line]
    assert slow, text[-4000:]
    assert_losses_match(run_dir, hangs["losses"])


def test_a_restarted_step_hung_in_its_rendezvous_is_named_and_restarted_in_place_again(hangs):
    run_dir, job = hangs["runs"] / "restart", hangs["jobs"]["restart"]
    log = job_log(run_dir, job) + (run_dir / "slurm" / f"{job}.out").read_text(errors="replace")
    assert any("SIGSTOP in rendezvous on rank 0" in text for text in faults.landed(log)), log[-4000:]
    fields = hangs["fields"]["restart"]
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "0", log[-4000:]
    killed, hung = CrashLog(RunDir(run_dir)).entries()
    assert (killed["action"], "hang" in killed) == ("restart", False), killed
    assert hung["action"] == "restart" and hung["step_restart"] == 2, hung
    assert [(c["rank"], c["phase"]) for c in hung["hang"]["culprits"]] == [(0, "rendezvous")], hung
    (line,) = hang_lines(run_dir, job)
    assert line.startswith("hang detected: rank 0 on ") and " in rendezvous" in line, line
    assert_losses_match(run_dir, hangs["losses"])
