"""One writer per run directory: run.lock (take, refuse a live holder, take over a dead one; racing
starts are in test_run_lock_race.py), two `relaytrain train` at once, a refusal on every rank, the
crash check after a refused step, and
`relaytrain launch` refusing a run directory whose job is still queued (fake and real Slurm)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from relaytrain.config.schema import ResilienceConfig
from relaytrain.errors import UserError
from relaytrain.job import RunDir
from relaytrain.resilience.batch import crash, step_end
from relaytrain.resilience.run_lock import Holder, RunLock, process_start
from relaytrain.resilience.run_state import RunState, RunStateFile
from relaytrain.slurm.submit import read_jobs
from tiny_config import TINY_TOML

import faults
from conftest import REPO, child_env, fake_tool, run_torchrun
from slurm_fixtures import job_fields, slurm, wait_for


@pytest.fixture
def no_job(monkeypatch):
    for key in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_ARRAY_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    proc.kill()
    proc.wait()


def write_lock(run_dir: Path, **fields) -> Holder:
    fields = {"host": socket.gethostname(), "since": "2026-11-24T00:00:00", "command": "relaytrain train",
              "token": os.urandom(16).hex(), **fields}  # fmt: skip
    holder = Holder(**fields)
    run_dir.mkdir(parents=True, exist_ok=True)
    RunDir(run_dir).lock.write_text(holder.text())
    return holder


def squeue_says(tmp_path: Path, monkeypatch, output: str) -> None:
    """A squeue on PATH that prints `output` for `squeue -h -j ID -o '%i %T'` (and records the call)."""
    fake_tool(tmp_path / "bin", "squeue", f'echo "$*" >> {tmp_path}/squeue.calls\nprintf "{output}"\n')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")


def test_take_and_release(tmp_path, no_job):
    lock = RunLock(RunDir(tmp_path / "run")).acquire("relaytrain train")
    holder, alive, why = RunLock(RunDir(tmp_path / "run")).current_holder()
    assert holder.pid == os.getpid() and holder.host == socket.gethostname() and holder.pid_start
    assert (alive, why) == (False, "held by this process")  # the same process may take it again
    lock.release()
    assert not RunDir(tmp_path / "run").lock.exists()
    assert [p.name for p in (tmp_path / "run").iterdir()] == []  # no temporary file left


def test_a_live_holder_on_this_host_is_refused_by_name(tmp_path, no_job, sleeper):
    run_dir = tmp_path / "run"
    write_lock(run_dir, pid=sleeper.pid, pid_start=process_start(sleeper.pid))
    with pytest.raises(UserError) as refused:
        RunLock(RunDir(run_dir)).acquire("relaytrain train")
    message = str(refused.value)
    assert f"is in use by relaytrain train (pid {sleeper.pid} on {socket.gethostname()} since " in message
    assert "; its process is running): wait for it to end, or choose another --run.name" in message
    assert json.loads(RunDir(run_dir).lock.read_text())["pid"] == sleeper.pid  # untouched


@pytest.mark.parametrize("how", ["dead", "recycled"])
def test_a_dead_or_recycled_holder_is_taken_over_with_one_log_line(tmp_path, no_job, sleeper, caplog, how):
    run_dir = tmp_path / "run"
    if how == "dead":
        done = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True)
        pid, start = int(done.stdout), "x:1"
    else:  # the recorded pid runs, but it is another process that got the number later
        pid, start = sleeper.pid, process_start(sleeper.pid).split(":")[0] + ":1"
    write_lock(run_dir, pid=pid, pid_start=start)
    with caplog.at_level(logging.WARNING, logger="relaytrain.resilience.run_lock"):
        lock = RunLock(RunDir(run_dir)).acquire("relaytrain train")
    assert lock.holder.pid == os.getpid()
    assert json.loads(RunDir(run_dir).lock.read_text())["token"] == lock.holder.token
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"(pid {pid} on " in lines[0] and "its process has ended" in lines[0], lines
    lock.release()


def test_a_slurm_holder_is_alive_while_its_job_may_run(tmp_path, no_job, monkeypatch):
    run_dir = tmp_path / "run"
    write_lock(run_dir, job_id="777", pid=1, host="node9")
    squeue_says(tmp_path, monkeypatch, "777 PENDING\\n")
    with pytest.raises(UserError, match=r"in use by job 777 .*the job is PENDING.*relaytrain cancel 777"):
        RunLock(RunDir(run_dir)).acquire("relaytrain train")
    squeue_says(tmp_path, monkeypatch, "")  # ended and gone from the queue
    RunLock(RunDir(run_dir)).acquire("relaytrain train").release()
    assert "-j 777 -o %i %T" in (tmp_path / "squeue.calls").read_text()


def test_a_requeued_job_takes_over_its_own_earlier_runs_lock(tmp_path, no_job, monkeypatch):
    run_dir = tmp_path / "run"
    write_lock(run_dir, job_id="777", restart_count=0, pid=1, host="node9")
    squeue_says(tmp_path, monkeypatch, "777 RUNNING\\n")
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lock = RunLock(RunDir(run_dir)).acquire("relaytrain train")
    assert lock.holder.job_id == "777" and lock.holder.restart_count == 1
    assert not (tmp_path / "squeue.calls").exists()  # its own job: no need to ask Slurm
    lock.release()


def test_a_holder_elsewhere_that_slurm_cannot_vouch_for_counts_as_alive(tmp_path, no_job, monkeypatch):
    run_dir = tmp_path / "run"
    write_lock(run_dir, job_id="777", pid=1, host="node9")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no squeue here
    with pytest.raises(UserError, match="Slurm cannot be asked"):
        RunLock(RunDir(run_dir)).acquire("relaytrain train")


def test_release_leaves_a_lock_another_start_took_over(tmp_path, no_job):
    lock = RunLock(RunDir(tmp_path / "run")).acquire("relaytrain train")
    other = write_lock(tmp_path / "run", pid=1, pid_start="x:1")
    lock.release()
    assert json.loads(RunDir(tmp_path / "run").lock.read_text())["token"] == other.token


def test_the_crash_check_leaves_a_run_directory_it_was_refused(tmp_path):
    run_dir = tmp_path / "run"
    RunStateFile(RunDir(run_dir)).write(RunState.of("running", "", 5, job_id="100", restart_count=0))
    before = (run_dir / "run_state.json").read_text()
    log_tail = (
        "[relaytrain 2026-11-24T00:00:00] job 200: restart count 0, 1 node(s)\n"
        f"relaytrain: error: the run directory {run_dir} is in use by job 100 (...): wait for it to end\n"
    )
    env = {"SLURM_JOB_ID": "200"}
    decision = step_end.end_step(RunDir(run_dir), 1, ResilienceConfig(), job_log_tail=log_tail, env=env)
    assert decision.action is step_end.Action.FAIL and "in use by another run" in decision.reason
    assert (run_dir / "run_state.json").read_text() == before
    assert not (run_dir / crash.CRASH_LOG_FILE).exists()


# -- relaytrain train ---------------------------------------------------------------------------

TRAIN = TINY_TOML + "max_steps = 100000\neval_every = 0\n\n[metrics]\nlog_every = 1\ntensorboard = false\n"


def start_train(tmp_path: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "relaytrain.cli", "train", str(tmp_path / "lock.toml"),
         f"--run.dir={tmp_path / 'runs'}", "--run.name=lock", "--checkpoint.enabled=false"],
        cwd=tmp_path, env=child_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def events(run_dir: Path) -> list[str]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["event"] for r in map(json.loads, lines) if r.get("kind") == "event"]


def test_two_trainings_started_at_once_one_trains_the_other_is_refused(tmp_path):
    (tmp_path / "lock.toml").write_text(TRAIN)
    run_dir = tmp_path / "runs" / "lock"
    procs = [start_train(tmp_path, **faults.env(step_delay_s=0.2)) for _ in range(2)]
    try:
        # The loser ends on its own; the winner trains until it is told to stop.
        loser = wait_for(lambda: next((p for p in procs if p.poll() is not None), None), 120, "a refusal")
        winner = procs[1 - procs.index(loser)]
        out, err = loser.communicate()
        assert loser.returncode == 2, out + err
        assert err.count("relaytrain: error:") == 1 and "Traceback" not in err, err
        assert f"is in use by relaytrain train (pid {winner.pid} on " in err, err
        wait_for(lambda: "start" in events(run_dir) if (run_dir / "metrics.jsonl").exists() else False,
                 120, "the winner's start event")  # fmt: skip
        winner.send_signal(signal.SIGTERM)  # a graceful stop releases the lock
        out, err = winner.communicate(timeout=120)
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
    assert json.loads((run_dir / "run_state.json").read_text())["status"] == "stopped", out + err
    assert events(run_dir).count("start") == 1 and "stop" in events(run_dir)
    assert not RunDir(run_dir).lock.exists()


@pytest.mark.slow
def test_a_refusal_stops_every_rank_with_one_line(tmp_path, sleeper):
    (tmp_path / "lock.toml").write_text(TRAIN.replace("100000", "3"))
    run_dir = tmp_path / "runs" / "lock"
    write_lock(run_dir, pid=sleeper.pid, pid_start=process_start(sleeper.pid))
    args = ["train", str(tmp_path / "lock.toml"), f"--run.dir={tmp_path / 'runs'}", "--run.name=lock"]
    done = run_torchrun(2, args, tmp_path, timeout=180)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert output.count(f"is in use by relaytrain train (pid {sleeper.pid} ") == 1, output
    assert sorted(p.name for p in run_dir.iterdir()) == ["run.lock"]  # nothing written beside it


# -- relaytrain launch --------------------------------------------------------------------------


def launch_config(tmp_path: Path) -> Path:
    path = tmp_path / "lock.toml"
    path.write_text(
        f'[run]\nname = "lock"\ndir = "{tmp_path / "runs"}"\n' + TRAIN.replace("100000", "3")
        + f'\n[slurm]\nprofile = "{REPO / "configs" / "clusters" / "local.toml"}"\n'
    )  # fmt: skip
    return path


def cli(*args: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "relaytrain.cli", *args], capture_output=True, text=True,
                          env=child_env(), timeout=120)  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def test_launch_refuses_a_run_directory_whose_job_is_still_queued(tmp_path, no_job, monkeypatch):
    cfg = launch_config(tmp_path)
    slurm_dir = tmp_path / "runs" / "lock" / "slurm"
    slurm_dir.mkdir(parents=True)
    (slurm_dir / "jobs.jsonl").write_text(json.dumps({"job_id": "555"}) + "\n")
    (slurm_dir / "config.toml").write_text("# the queued job's config\n")
    squeue_says(tmp_path, monkeypatch, "555 PENDING\\n")
    code, out = cli("launch", str(cfg), "--dry-run")
    assert code == 2 and out.count("\n") == 1, out
    assert "is in use by job 555 (submitted for it, PENDING)" in out and "relaytrain cancel 555" in out
    assert (slurm_dir / "config.toml").read_text() == "# the queued job's config\n"  # not rewritten
    code, out = cli("launch", str(cfg), "--dry-run", "--after", "555")  # it starts after 555 ended
    assert code == 0, out


def test_sweep_refuses_a_point_whose_array_task_is_still_queued(tmp_path, no_job, monkeypatch):
    cfg = launch_config(tmp_path)
    point = tmp_path / "runs" / "lock-1" / "slurm"
    point.mkdir(parents=True)
    (point / "jobs.jsonl").write_text(json.dumps({"job_id": "555_1"}) + "\n")
    squeue_says(tmp_path, monkeypatch, "555_1 RUNNING\n")
    code, out = cli("sweep", str(cfg), "--grid", "optim.lr=1e-3,2e-3", "--dry-run")
    assert code == 2 and "lock-1 is in use by job 555_1 (submitted for it, RUNNING)" in out, out
    assert not (tmp_path / "runs" / "lock-sweep").exists()


@pytest.mark.slurm
def test_resubmitting_a_run_whose_job_is_pending_is_refused(slurm_cluster, tmp_path):
    cfg = launch_config(tmp_path)
    jobs_file = RunDir(tmp_path / "runs" / "lock").jobs
    hold = "--slurm.extra_sbatch=['--hold']"  # stays PENDING until released
    code, out = cli("launch", str(cfg), "--nodes", "1", "--tasks-per-node", "1", hold)
    assert code == 0, out
    job = out.split("submitted job ")[1].split()[0]
    try:
        assert job_fields(int(job))["JobState"] == "PENDING"
        code, out = cli("launch", str(cfg), "--nodes", "1", "--tasks-per-node", "1")
        assert code == 2, out
        assert f"is in use by job {job} (submitted for it, PENDING)" in out, out
        assert f"relaytrain cancel {job}" in out and "submitted job" not in out
        assert len(read_jobs(jobs_file)) == 1  # nothing else was submitted
        queued = slurm("squeue", "-h", "-n", "lock", "-o", "%i").split()
        assert [j for j in queued if int(j) > int(job)] == [], queued
    finally:
        slurm("scancel", *{str(entry["job_id"]) for entry in read_jobs(jobs_file)})
    wait_for(lambda: job_fields(int(job))["JobState"] == "CANCELLED", 60, f"job {job} to be cancelled")
    code, out = cli("launch", str(cfg), "--nodes", "1", "--tasks-per-node", "1", "--dry-run")
    assert code == 0, out
