"""The batch job's driver (relaytrain.resilience.batch.driver): one step after the other with its marker,
Slurm's signal passed on, a restart in place with the nodes left and a fresh port, the pending requeue
when the decision failed, the snapshots freed only when the job ends for good."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from relaytrain.job import RunDir
from relaytrain.job.facts import STEP_RESTARTS_ENV
from relaytrain.job.ports import base_port, choose_port, has_no_listener
from relaytrain.resilience.batch import driver as job_driver
from relaytrain.resilience.batch.crash import CrashLog
from relaytrain.resilience.batch.driver import JobPlan, StepLaunch, requeue_state
from relaytrain.resilience.batch.job_step import SignalForwarder, exit_status
from relaytrain.resilience.batch.step_decision import step_marker
from relaytrain.resilience.run_state import RunState, RunStateFile

from conftest import child_env, fake_tool


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A Slurm job's variables (restored afterwards: the driver sets the step's own) and fake tools."""
    bin_dir = tmp_path / "bin"
    fake_tool(
        bin_dir, "scontrol", '[[ $1 == requeue ]] && echo "requeue $2" >> "$FAKE_LOG.requeue"; exit 0\n'
    )
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "fake"))
    variables = {"SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NTASKS": "4",
                 STEP_RESTARTS_ENV: "0", "MASTER_ADDR": "node1", "MASTER_PORT": "15123"}  # fmt: skip
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    return tmp_path


def write_record(run_dir: Path, status: str, reason: str, step: int, **fields) -> None:
    RunStateFile(RunDir(run_dir)).write(RunState.of(status, reason, step, **fields))


def plan(run_dir: Path, snapshots: bool = False) -> JobPlan:
    return JobPlan(RunDir(run_dir), "", False, snapshots, ["python"], heartbeat_s=0)


def test_a_restart_in_place_overlaps_once_and_narrows_the_step_to_the_nodes_left():
    launch = StepLaunch(["--nodes=2", "--ntasks-per-node=2"], ["python", "x.py"], ["node1", "node2"], 2)
    env = {"SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NTASKS": "4", "MASTER_ADDR": "node1"}
    launch.restart((), "123", env)  # the same nodes
    assert launch.argv() == ["srun", "--nodes=2", "--ntasks-per-node=2", "--overlap", "python", "x.py"]
    assert env["MASTER_PORT"] == str(choose_port("123+1", has_no_listener)) and env["MASTER_ADDR"] == "node1"
    # not the next job's own first port: two jobs sharing a first node joined each other's rendezvous
    assert base_port("123+1") not in (base_port(124), base_port(123))
    launch.restart(("node2",), "123", env)
    assert launch.argv()[3:] == ["--overlap", "--nodes=1", "--nodelist=node2", "--ntasks=2", "python", "x.py"]
    assert (env["SLURM_JOB_NODELIST"], env["SLURM_JOB_NUM_NODES"]) == ("node2", "1")
    assert env["MASTER_ADDR"] == "node2"
    assert "SLURM_NTASKS" not in env and env["MASTER_PORT"] == str(choose_port("123+2", has_no_listener))
    launch.restart(("node1",), "123", env)  # a third start: its placement replaces the second's
    assert launch.argv()[3:] == ["--overlap", "--nodes=1", "--nodelist=node1", "--ntasks=2", "python", "x.py"]


def test_only_a_listener_takes_a_port():
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", 0))
        port = sock.getsockname()[1]
        assert has_no_listener(port)  # bound, not listening: torch's TCPStore could still bind
        sock.listen()
        assert not has_no_listener(port)


def test_the_run_record_says_pending_and_asked(tmp_path):
    assert requeue_state(RunDir(tmp_path)) == (False, False)
    RunStateFile(RunDir(tmp_path)).write(
        RunState.of("stopped", "time_budget", 5, requeue_requested=True, requeue_pending=True)
    )
    assert requeue_state(RunDir(tmp_path)) == (True, True)
    write_record(tmp_path, "stopped", "time_limit_signal", 7, requeued=True)
    assert requeue_state(RunDir(tmp_path)) == (False, True)
    write_record(tmp_path, "finished", "", 9)
    assert requeue_state(RunDir(tmp_path)) == (False, False)


def test_a_signal_that_came_between_steps_goes_to_the_next_step():
    assert exit_status(-9) == 137 and exit_status(3) == 3
    forwarder = SignalForwarder("USR2", pending="USR2", ready_timeout_s=0.5)
    # `sleep` never takes SIGUSR2: after the timeout it gets it all the same, and dies of it
    assert forwarder.run(["sleep", "30"]) == 128 + 12
    assert forwarder.pending == ""


# A step that dies of SIGUSR2 for its first half second, as srun does before it blocks its signals,
# then takes it: exit 0 on the signal, 1 without one.
STARTS_SLOWLY = (
    "import signal, sys, time; time.sleep(0.5); "
    "signal.signal(signal.SIGUSR2, lambda *_: sys.exit(0)); time.sleep(30); sys.exit(1)"
)


def test_a_signal_is_held_until_the_starting_step_takes_it():
    """Slurm's early signal as the step starts: handed over (pending) or arriving during its start-up."""
    forwarder = SignalForwarder("USR2", pending="USR2")
    assert forwarder.run([sys.executable, "-c", STARTS_SLOWLY]) == 0 and forwarder.pending == ""

    forwarder = SignalForwarder("USR2")
    previous = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    forwarder.install()
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR2)).start()  # while the step starts
        assert forwarder.run([sys.executable, "-c", STARTS_SLOWLY]) == 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_a_crashed_step_restarts_in_place_then_the_job_frees_its_snapshots(job, capfd):
    fake_tool(job / "bin", "srun",
         'if [[ $* == *snapshot* ]]; then echo "$*" >> "$FAKE_LOG.cleanup"; exit 0; fi\n'
         'echo "step $RELAYTRAIN_STEP_RESTARTS $*" >> "$FAKE_LOG.steps"\n'
         '[[ $RELAYTRAIN_STEP_RESTARTS == 0 ]] && exit 137; exit 0\n')  # fmt: skip
    launch = StepLaunch(["--ntasks-per-node=1"], ["python", "t.py"], ["node1", "node2"], 1)
    run_dir = job / "run"
    assert job_driver.drive(plan(run_dir, snapshots=True), launch, SignalForwarder("USR2")) == 0
    first, second = (job / "fake.steps").read_text().splitlines()
    assert first == "step 0 --ntasks-per-node=1 python t.py"
    assert second == "step 1 --ntasks-per-node=1 --overlap python t.py"
    out = capfd.readouterr().out
    assert f"{step_marker(0, 0)} on node1,node2" in out and f"{step_marker(0, 1)} on node1,node2" in out
    assert "job step finished with exit code 137" in out and "restarting the job step in place (1)" in out
    (cleanup,) = (job / "fake.cleanup").read_text().splitlines()
    assert cleanup.startswith("--overlap --nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist=node1,node2")
    assert cleanup.endswith("-m relaytrain.checkpoint.snapshot cleanup --config ")
    assert [e["action"] for e in CrashLog(RunDir(run_dir)).entries()] == ["restart"]


def test_a_requeued_job_keeps_its_snapshots(job):
    run_dir = job / "run"
    fake_tool(job / "bin", "srun", '[[ $* == *snapshot* ]] && echo cleanup >> "$FAKE_LOG.cleanup"; exit 0\n')
    RunStateFile(RunDir(run_dir)).write(
        RunState.of("stopped", "time_limit_signal", 5, requeue_requested=True, requeued=True)
    )
    launch = StepLaunch([], ["python", "t.py"], ["node1"], 1)
    assert job_driver.drive(plan(run_dir, snapshots=True), launch, SignalForwarder("")) == 0
    assert not (job / "fake.cleanup").exists()


def test_when_the_decision_fails_the_pending_requeue_is_still_done(job, monkeypatch, capfd):
    def broken(*_args, **_kwargs):
        raise RuntimeError("the decision broke")

    monkeypatch.setattr(job_driver, "after_step", broken)
    fake_tool(job / "bin", "srun", "exit 75\n")
    run_dir = job / "run"
    RunStateFile(RunDir(run_dir)).write(
        RunState.of("stopped", "time_budget", 5, requeue_requested=True, requeue_pending=True)
    )
    launch = StepLaunch([], ["python", "t.py"], ["node1"], 1)
    assert job_driver.drive(plan(run_dir), launch, SignalForwarder("")) == 75
    assert (job / "fake.requeue").read_text().splitlines() == ["requeue 123"]
    out = capfd.readouterr()
    assert "RuntimeError: the decision broke" in out.err and "the crash check failed" in out.out
    assert "the run asked for a requeue it could not do: scontrol requeue 123" in out.out


def test_the_decision_reads_only_its_own_steps_part_of_the_job_log(job, tmp_path):
    """The marker the driver logs before a step is the one the decision looks for: an earlier step's
    `srun: error` lines in the same output file are not this crash's."""
    log_file = tmp_path / "slurm-123.out"
    log_file.write_text("srun: error: old9: task 0: Killed\n")  # an earlier run of the job
    fake_tool(job / "bin", "srun",
         '[[ $RELAYTRAIN_STEP_RESTARTS == 0 ]] || exit 0\n'
         'echo "srun: error: node2: task 1: Killed"; exit 137\n')  # fmt: skip
    command = [sys.executable, "-m", "relaytrain.resilience.batch.driver", "--run-dir", str(tmp_path / "run"),
               "--config", "", "--nodes", "node1,node2", "--", "python", "t.py"]  # fmt: skip
    env = child_env(SLURM_JOB_ID="123")
    with open(log_file, "a") as out:
        done = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=120)
    assert done.returncode == 0, log_file.read_text()
    (crash,) = [json.loads(line) for line in (tmp_path / "run" / "crashes.jsonl").read_text().splitlines()]
    assert crash["nodes"] == ["node2"] and crash["action"] == "restart", crash


def test_a_job_that_replaced_a_node_frees_its_snapshots_too_and_records_its_steps(job):
    """The spare node3 trains in node2's place; at the end the snapshots go from the nodes that trained
    last and, in a cleanup of its own, from node2 (a node that failed may be gone). The driver's `job`
    records say when the job and each step began and ended (the time ledger's)."""
    fake_tool(job / "bin", "srun",
         'if [[ $* == *snapshot* ]]; then echo "$*" >> "$FAKE_LOG.cleanup"; exit 0; fi\n'
         '[[ $RELAYTRAIN_STEP_RESTARTS == 0 ]] && exit 137; exit 0\n')  # fmt: skip
    launch = StepLaunch(["--ntasks-per-node=1"], ["python", "t.py"], ["node1", "node3"], 1)
    launch.order = ["node1", "node2", "node3"]  # the spare node3 took node2's place before the job ends
    assert launch.replaced == ["node2"]
    run_dir = job / "run"
    job_driver.drive(plan(run_dir, snapshots=True), launch, SignalForwarder(""))
    cleanups = (job / "fake.cleanup").read_text().splitlines()
    assert [c.split("--nodelist=")[1].split()[0] for c in cleanups] == ["node1,node3", "node2"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [
        (r["event"], r.get("step_restart", 0), r.get("exit_code")) for r in records if r["kind"] == "job"
    ]
    assert steps == [("job_start", 0, None), ("step_start", 0, None), ("step_end", 0, 137),
                     ("step_start", 1, None), ("step_end", 1, 0), ("job_end", 1, 0)]  # fmt: skip
