"""Alerts on the real local Slurm cluster: a job whose rank is killed once restarts in place and finishes;
a local HTTP receiver (the test's, reached from the nodes at the controller's address) gets the run's
events in order, each once. A second job with the receiver down trains the same losses as a run without
[notify], and its run record counts the failed deliveries."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from e2e_slurm_jobs import (
    FIRST_RUN_ONLY,
    assert_losses_match,
    job_log,
    job_output,
    launch,
    records,
    setup_override,
    start_reference,
    write_config,
)
from relaytrain.localcluster.net import CONTROLLER_ADDR
from test_crash_recovery import CRASH_RESILIENCE, CRASH_STEPS, kill_rank_at
from test_notify import Receiver

import faults
from slurm_fixtures import wait_job_finished


def url_file(path: Path, url: str) -> Path:
    path.write_text(url + "\n")
    path.chmod(0o600)
    return path


def notify_record(run_dir: Path) -> dict:
    (record,) = [r for r in records(run_dir, "job") if r.get("event") == "notify"]
    return record


@pytest.mark.slurm
def test_a_crashed_and_finished_job_tells_the_receiver_and_a_dead_receiver_changes_no_loss(
    slurm_cluster, tmp_path
):
    runs = tmp_path / "runs"
    receiver = Receiver(host="0.0.0.0")  # the nodes reach this machine at the controller's address
    port = receiver.server.server_address[1]
    with socket.socket() as s:  # a port where nothing listens: the receiver is down
        s.bind(("0.0.0.0", 0))
        down_port = s.getsockname()[1]
    hook = url_file(tmp_path / "hook", f"http://{CONTROLLER_ADDR}:{port}/hook")
    dead = url_file(tmp_path / "dead", f"http://{CONTROLLER_ADDR}:{down_port}/hook")
    plain = write_config(tmp_path / "plain.toml", runs, "plain", CRASH_STEPS)
    plain.write_text(plain.read_text() + CRASH_RESILIENCE)
    jobs = {}
    for name, secret, extra in (
        ("up", hook, 'format = "json"\n'),
        ("down", dead, "retries = 1\nbackoff_s = 0.2\n"),
    ):
        cfg = write_config(tmp_path / f"{name}.toml", runs, name, CRASH_STEPS)
        cfg.write_text(cfg.read_text() + CRASH_RESILIENCE + f'\n[notify]\nurl_file = "{secret}"\n{extra}')
        slow = FIRST_RUN_ONLY.format(faults.setup_line(step_delay_s=0.4))
        jobs[name] = launch(str(cfg), "--nodes", "1", "--tasks-per-node", "2", setup_override(slow))
    reference = start_reference(runs / "reference", plain)
    try:
        for name, job in jobs.items():
            kill_rank_at(runs / name, job, 0, 15)
        fields = {name: wait_job_finished(int(job), timeout=300) for name, job in jobs.items()}
        out, _ = reference.communicate(timeout=300)
    finally:
        for job in jobs.values():
            subprocess.run(["scancel", job], capture_output=True, timeout=30)
        if reference.poll() is None:
            reference.kill()
        receiver.close()
    assert reference.returncode == 0, out[-3000:]
    for name, job in jobs.items():
        assert fields[name]["JobState"] == "COMPLETED", job_log(runs / name, job)

    up = runs / "up"
    events = [(b["event"], b.get("resumed")) for b in receiver.bodies]
    assert events == [("started", False), ("crash_restart", None), ("started", True), ("finished", None)], (
        receiver.bodies,
        job_log(up, jobs["up"]),
    )
    assert (
        receiver.bodies[1]["signal"] == "SIGKILL" and receiver.bodies[1]["step"] >= 15
    )  # where it was killed
    assert receiver.bodies[3]["step"] == CRASH_STEPS
    assert {b["job_id"] for b in receiver.bodies} == {jobs["up"]}
    assert (notify_record(up)["sent"], notify_record(up)["failed"]) == (4, 0)

    down = runs / "down"
    assert (notify_record(down)["sent"], notify_record(down)["failed"]) == (0, 4), job_log(down, jobs["down"])
    reference_losses = {r["step"]: r["loss"] for r in records(runs / "reference", "train")}
    assert_losses_match(down, reference_losses)
    assert_losses_match(up, reference_losses)
    for name, job in jobs.items():  # the secret is in no line of the job's output
        assert "/hook" not in job_output(runs / name, job), job_log(runs / name, job)
