"""Crash recovery: a job step that crashed is requeued from the last complete checkpoint, capped per job.

The unit tests drive the end-of-step decision (``relaytrain.resilience.batch.step_end``) with a fake requeue;
the Slurm tests SIGKILL one rank of a real job on the local cluster and check the resumed run against an
uninterrupted one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_slurm_jobs import (
    FIRST_RUN_ONLY,
    assert_losses_match,
    cli,
    complete_checkpoints,
    job_log,
    launch,
    marker,
    records,
    setup_override,
    start_reference,
    wait_step,
    write_config,
)
from relaytrain.config.schema import ResilienceConfig
from relaytrain.job import JobFacts, RunDir
from relaytrain.resilience import requeue
from relaytrain.resilience.batch import crash, step_end
from relaytrain.resilience.run_state import RunState, RunStateFile

import faults
from bench.cluster.harness import rank_pids
from slurm_fixtures import wait_for, wait_job_finished

JOB = {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "2"}


calls_excluded: dict[int, list[tuple[str, ...]]] = {}  # each fake's ExcNodeList per requeue


@pytest.fixture
def requeues(monkeypatch):
    calls: list[str] = []

    def fake(requeue_id: str, exclude=()) -> tuple[bool, str]:
        calls.append(requeue_id)
        excluded.append(tuple(exclude))
        return True, f"scontrol requeue {requeue_id}"

    excluded: list[tuple[str, ...]] = []
    calls_excluded[id(calls)] = excluded

    monkeypatch.setattr(requeue, "scontrol_requeue", fake)
    return calls


def after_step(run_dir, exit_code, cap, requeue_on, log_tail="", env=None) -> bool:
    """The batch script's end-of-step decision for relaytrain's trainer; whether it requeued."""
    r = ResilienceConfig(max_crash_requeues=cap, requeue=requeue_on)
    decision = step_end.end_step(RunDir(run_dir), exit_code, r, job_log_tail=log_tail, env=env)
    return decision.action is step_end.Action.REQUEUE


def write_state(run_dir: Path, status: str, reason: str = "", job_id: str = "41", restart: int = 2, **extra):
    RunStateFile(RunDir(run_dir)).write(
        RunState.of(status, reason, 12, job_id=job_id, restart_count=restart, **extra)
    )


def test_a_user_error_recorded_by_the_run_is_not_a_crash(tmp_path):
    """torchrun exits 1 for a worker's exit 2: a full disk during a save is told by its recorded message."""
    message = "UserError('checkpoint save of step 20 failed: no space')"
    write_state(tmp_path, "failed", "error", message=message)
    got, why = crash.classify(RunStateFile(RunDir(tmp_path)).read(), JobFacts.from_env(JOB), 1)
    assert got is False and "no space" in why


@pytest.mark.parametrize(
    ("status", "reason", "job_id", "code", "is_crash"),
    [
        ("running", "", "41", 137, True),  # a rank SIGKILLed mid-step: no record
        ("failed", "error", "41", 1, True),  # an exception on one rank
        ("failed", "hang", "41", 1, True),  # the watchdog
        ("failed", "nan", "41", 1, False),  # NaN policy: the same data would fail again
        ("failed", "damaged_checkpoint", "41", 1, False),  # no checkpoint loads: the user must decide
        ("stopped", "preemption", "41", 1, False),  # torchrun exits 1 after SIGTERM; the stop decided
        ("finished", "max_steps", "41", 0, False),
        ("stopped", "preemption", "40", 1, True),  # marker of an earlier job: died before writing
        ("stopped", "preemption", "40", 2, False),  # exit 2: a config error, retrying cannot help
    ],
)
def test_classify(tmp_path, status, reason, job_id, code, is_crash):
    write_state(tmp_path, status, reason, job_id=job_id)
    got, why = crash.classify(RunStateFile(RunDir(tmp_path)).read(), JobFacts.from_env(JOB), code)
    assert got is is_crash, why


def test_crash_requeues_until_the_cap_then_records_a_crash_loop(tmp_path, requeues):
    log_tail = (
        "[relaytrain] job 41: restart count 1, 1 node(s)\nsrun: error: node1: task 0: Exited\n"
        "[relaytrain] job 41: restart count 2, 1 node(s)\nsrun: error: node2: task 1: Killed\n"
    )
    for attempt in range(3):
        write_state(tmp_path, "running")
        requeued = after_step(tmp_path, 137, 2, True, log_tail, env=JOB)
        state = RunStateFile(RunDir(tmp_path)).read().as_json()
        assert state is not None
        if attempt < 2:
            assert requeued and requeues == ["41"] * (attempt + 1)
            assert (state["status"], state["reason"], state["requeued"]) == ("failed", "crash", True)
        else:
            assert not requeued and len(requeues) == 2
            assert (state["status"], state["reason"]) == ("failed", "crash_loop")
            assert "max_crash_requeues=2" in state["message"]
        assert state["crash"]["signal"] == "SIGKILL" and state["crash"]["nodes"] == ["node2"]
        assert state["crash_count"] == attempt + 1
    # node2's task died first both times: the second requeue's allocation excludes it
    assert calls_excluded[id(requeues)] == [(), ("node2",)]
    entries = [json.loads(line) for line in (tmp_path / crash.CRASH_LOG_FILE).read_text().splitlines()]
    assert [e["job_id"] for e in entries] == ["41"] * 3
    # A job resubmitted by hand starts with a fresh allowance.
    write_state(tmp_path, "running", job_id="42", restart=0)
    assert after_step(tmp_path, 1, 2, True, env={"SLURM_JOB_ID": "42"})


def test_no_requeue_when_requeue_is_off_or_not_a_crash(tmp_path, requeues):
    write_state(tmp_path, "running")
    assert not after_step(tmp_path, 1, 3, False, env=JOB)
    state = RunStateFile(RunDir(tmp_path)).read().as_json()
    assert state and (state["status"], state["reason"]) == ("failed", "crash")
    assert state["requeue_pending"] is False
    write_state(tmp_path, "stopped", "time_limit_signal")
    assert not after_step(tmp_path, 1, 3, True, env=JOB)
    assert RunStateFile(RunDir(tmp_path)).read().status == "stopped"  # untouched
    assert requeues == []


def test_torchrun_failure_summary_names_the_signal():
    text = "traceback : Signal 9 (SIGKILL) received by PID 4242\n"
    assert crash.torchrun_signals(text) == ["SIGKILL"]
    assert crash.signal_of(137) == "SIGKILL" and crash.signal_of(1) == ""


def test_crash_check_block_of_the_batch_script_and_the_default_cap():
    from relaytrain.config import load_config

    template = (Path(crash.__file__).parents[2] / "slurm" / "templates" / "job.sh.j2").read_text()
    # the driver's module from the entry-point table (relaytrain/entry_points.py), with or without a container
    assert template.count("-m {{ entry.driver }} --run-dir") == 1
    assert "step_end" not in template and "-m relaytrain.program" not in template
    assert load_config(None).resilience.max_crash_requeues == 3


# --------------------------------------------------------------------------------------------------
# On the real local Slurm cluster
# --------------------------------------------------------------------------------------------------


def kill_rank_at(
    run_dir: Path, job_id: str, restart: int, step: int, rank: int = 1, in_place: int = 0
) -> int:
    """SIGKILL one rank once run `restart` of the job (its step restarted in place `in_place` times)
    logged `step`; returns the last logged step."""

    def rows():
        return [
            r
            for r in records(run_dir, "train")
            if r.get("restart") == restart and r.get("step_restart", 0) == in_place
        ]

    def reached():
        return max((r["step"] for r in rows()), default=0) >= step and rank_pids(job_id, rank)

    what = f"run {restart} (step restart {in_place}) of job {job_id} to reach step {step}"
    # A requeued run waits for Slurm to start it again (the suite's other Slurm tests share the cluster).
    wait_for(reached, 360 if restart else 240, what, interval=0.5)
    for pid in rank_pids(job_id, rank):
        os.kill(pid, signal.SIGKILL)
    return max(r["step"] for r in rows())


CRASH_STEPS = 40
CRASH_RESILIENCE = "\n[checkpoint]\ninterval = 10\n"


@pytest.mark.slurm
def test_sigkill_of_one_rank_restarts_the_step_in_place_and_resumes_bit_exact(slurm_cluster, tmp_path):
    """The crashed step starts again inside the same allocation: no requeue, same job, same losses."""
    runs = tmp_path / "runs"
    cfg = write_config(tmp_path / "crash.toml", runs, "crash", CRASH_STEPS)
    cfg.write_text(cfg.read_text() + CRASH_RESILIENCE)
    reference = start_reference(runs / "reference", cfg)
    slow = FIRST_RUN_ONLY.format(faults.setup_line(step_delay_s=0.4))
    job = launch(str(cfg), "--nodes", "1", "--tasks-per-node", "2", setup_override(slow))
    run_dir = runs / "crash"
    try:
        killed_at = kill_rank_at(run_dir, job, 0, 15)
        checkpoints = complete_checkpoints(run_dir)
        fields = wait_job_finished(int(job), timeout=300)
        out, _ = reference.communicate(timeout=300)
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
        if reference.poll() is None:
            reference.kill()
    assert reference.returncode == 0, out[-3000:]
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "0", job_log(run_dir, job)
    resumes = [r for r in records(run_dir, "event") if r["event"] == "resume"]
    assert resumes and resumes[0]["step"] == max(checkpoints) <= killed_at
    assert (resumes[0]["restart"], resumes[0]["step_restart"]) == (0, 1)
    entries = crash.CrashLog(RunDir(run_dir)).entries()
    assert len(entries) == 1 and entries[0]["job_id"] == job and entries[0]["signal"] == "SIGKILL", entries
    assert entries[0]["action"] == "restart" and entries[0]["step_restart"] == 1
    restarts = [r for r in records(run_dir, "event") if r["event"] == "step_restart"]
    assert [(r["step_restart"], r["signal"], r["restart"]) for r in restarts] == [(1, "SIGKILL", 0)]
    assert marker(run_dir)["status"] == "finished"
    code, out = cli("status", str(run_dir))
    assert code == 0 and "1 in place" in out, out
    reference_losses = {r["step"]: r["loss"] for r in records(runs / "reference", "train")}
    assert_losses_match(run_dir, reference_losses)
    code, out = cli("verify", str(run_dir))  # the replayed steps: each sample still once, in order
    assert code == 0 and "(2 segment(s) in the lineage" in out, out


@pytest.mark.slurm
def test_restarts_in_place_then_requeues_then_a_crash_loop_stops_the_job(slurm_cluster, tmp_path):
    """max_step_restarts=1, max_crash_requeues=1: the first crash restarts the step in place, the second
    requeues the job, the third ends it FAILED with crash_loop."""
    runs = tmp_path / "runs"
    cfg = write_config(tmp_path / "loop.toml", runs, "loop", CRASH_STEPS)
    # Two crashes on the one node would keep the requeued run off it (resilience.exclude_node_after, tested
    # on its own): this test is about the counts, so its requeue runs where it ran, not after another
    # Slurm test frees a node.
    caps = "\n[resilience]\nmax_crash_requeues = 1\nmax_step_restarts = 1\nexclude_node_after = 0\n"
    cfg.write_text(cfg.read_text() + CRASH_RESILIENCE + caps)
    slow = setup_override(faults.setup_line(step_delay_s=0.4))
    job = launch(str(cfg), "--nodes", "1", "--tasks-per-node", "2", slow)
    run_dir = runs / "loop"
    try:
        kill_rank_at(run_dir, job, 0, 3)
        kill_rank_at(run_dir, job, 0, 3, in_place=1)
        kill_rank_at(run_dir, job, 1, 3)
        fields = wait_job_finished(int(job), timeout=300)
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    assert fields["JobState"] == "FAILED" and fields["Restarts"] == "1", job_log(run_dir, job)
    state = marker(run_dir)
    assert (state["status"], state["reason"], state["crash_count"]) == ("failed", "crash_loop", 2), state
    entries = crash.CrashLog(RunDir(run_dir)).entries()
    assert [e["action"] for e in entries] == ["restart", "requeue", "fail"], entries
    assert "max_step_restarts=1 reached" in entries[1]["not_restarted_in_place"]
    code, out = cli("status", job, "--runs", str(runs))
    assert code == 0 and "crash_loop" in out, out
    # the ledger against what it did not build: the steps' time against the train records'
    code, out = cli("verify", str(run_dir))
    assert code == 0, out
    # the local cluster's job completion file gives the requeue's Submit (read from the file itself)
    assert "queue: 1 requeue(s) checked against Slurm's Submit to Start (" in out, out
    assert "productive: the ledger's step time of " in out, out


@pytest.mark.slurm
def test_a_restarted_step_whose_only_checkpoint_is_damaged_fails_once_and_keeps_it(slurm_cluster, tmp_path):
    """The crashed step, restarted in place, finds its only checkpoint damaged: it does not start over at
    step 0, the job ends FAILED without a requeue, the checkpoint stays as it was and the status says why."""
    runs = tmp_path / "runs"
    cfg = write_config(tmp_path / "damaged.toml", runs, "damaged", CRASH_STEPS)
    cfg.write_text(cfg.read_text() + "\n[checkpoint]\ninterval = 5\n")
    slow = setup_override(FIRST_RUN_ONLY.format(faults.setup_line(step_delay_s=1)))
    job = launch(str(cfg), "--nodes", "1", "--tasks-per-node", "2", slow)
    run_dir = runs / "damaged"
    step_dir = run_dir / "checkpoints" / "step_5"
    try:
        wait_step(run_dir, job, 5)
        wait_for(lambda: complete_checkpoints(run_dir) == [5], 60, "the checkpoint of step 5")
        shard = sorted(step_dir.glob("*.distcp"))[-1]
        shard.unlink()
        kept = sorted(p.name for p in step_dir.rglob("*"))
        kill_rank_at(run_dir, job, 0, 6)  # before step 10: step_5 is the only checkpoint
        fields = wait_job_finished(int(job), timeout=300)
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    # the step restarted in place finds the damaged checkpoint: no training, no requeue
    assert (fields["JobState"], fields["Restarts"]) == ("FAILED", "0"), job_log(run_dir, job)
    assert not [r for r in records(run_dir, "train") if r.get("step_restart") == 1], "the restart trained"
    state = marker(run_dir)
    assert (state["status"], state["reason"]) == ("failed", "damaged_checkpoint"), state
    assert f"{shard.name} is missing" in state["message"] and state["requeue_requested"] is False
    assert "--checkpoint.start_over_if_damaged=true" in state["message"]
    assert len(crash.CrashLog(RunDir(run_dir)).entries()) == 1  # the SIGKILL; the refusal is not a crash
    assert sorted(p.name for p in step_dir.rglob("*")) == kept and complete_checkpoints(run_dir) == [5]
    code, out = cli("status", job, "--runs", str(runs))
    assert code == 0 and "damaged_checkpoint" in out, out  # the table wraps the message itself


def test_the_requeues_own_sigterm_does_not_cut_the_record_short(tmp_path):
    """`scontrol requeue` ends the batch job, so Slurm's SIGTERM reaches the crash check (a child of the
    batch shell) during the call or at any moment after it returned: it must still record the requeue
    and exit 0 (the batch script logs 'the crash check failed' otherwise)."""
    config = tmp_path / "config.toml"
    config.write_text("")
    run_dir = tmp_path / "run"
    write_state(run_dir, "running")
    snippet = f"""
import os, signal, time
import runpy, sys
from relaytrain.resilience import requeue

def fake(requeue_id):
    os.kill(os.getpid(), signal.SIGTERM)  # Slurm ends the job while scontrol runs
    return True, f"scontrol requeue {{requeue_id}}"

requeue.scontrol_requeue = fake
sys.argv = ["step_end", "--config", {str(config)!r}, "--run-dir", {str(run_dir)!r}, "--exit-code", "137"]
try:
    runpy.run_module("relaytrain.resilience.batch.step_end", run_name="__main__")
except SystemExit as done:
    code = done.code
os.kill(os.getpid(), signal.SIGTERM)  # ... or just after it returned
time.sleep(0.2)
print("exit code", code)
"""
    done = subprocess.run([sys.executable, "-c", snippet], env={**os.environ, **JOB}, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert "requeuing from the last complete checkpoint" in done.stdout
    assert "relaytrain: requeued (scontrol requeue 41)" in done.stdout and "exit code 0" in done.stdout
    state = RunStateFile(RunDir(run_dir)).read().as_json()
    assert state is not None and state["requeued"] is True


def test_a_failed_first_all_reduce_is_a_crash_the_job_step_retries(monkeypatch, capsys):
    """A peer that resets the first all-reduce is the cluster's failure, not the user's: one line, exit 1
    (not the config error's 2), so the end of the step restarts or requeues it as a crash."""
    import types

    from relaytrain import cli
    from relaytrain.errors import InfrastructureError
    from relaytrain.parallel import distributed

    class ResetWork:
        def wait(self, timeout=None):
            raise RuntimeError("Connection reset by peer")

    monkeypatch.setattr(distributed.dist, "all_reduce", lambda *a, **k: ResetWork())
    env = types.SimpleNamespace(rank=1, world_size=2, local_rank=0, node="n2", device="cpu", backend="gloo",
                                is_main=False, num_nodes=2)  # fmt: skip
    with pytest.raises(InfrastructureError) as failed:
        distributed.health_check(env, 5.0)
    assert "Connection reset by peer" in str(failed.value)

    def train(cfg):
        distributed.health_check(env, 5.0)

    monkeypatch.setattr("relaytrain.trainer.train", train)
    code = cli.main(["train", "--train.max_steps=1"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "first all-reduce did not finish" in err, (code, err)
    # the step died before the run wrote its record: exit 1 is a crash, retried
    got, why = crash.classify(None, JobFacts.from_env(JOB), code)
    assert got is True, why
