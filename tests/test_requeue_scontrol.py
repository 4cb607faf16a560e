"""The scontrol calls of a requeue outlive the SIGTERM the requeue itself brings.

`scontrol requeue` ends the running job, and Slurm's SIGTERM reaches the scontrol that asked for it: killed,
it reported a requeue that went through as failed (seen in a Megatron job of the local cluster: "could not
requeue the job: scontrol requeue 37 exited -15", the record left pending). `scontrol requeuehold` too:
Slurm sends SIGTERM to every process of the batch step, the `scontrol update` and `scontrol release` that
follow it included. A release killed half-way leaves the job held for good (seen on the local cluster:
"requeued held, but scontrol release 11 exited -15"). The race is forced here: the `scontrol` on PATH
records its pid, waits for the test's SIGTERM, then finishes.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from relaytrain.resilience import requeue


@pytest.mark.parametrize(
    "call, answer",
    [
        (lambda: requeue.scontrol_requeue("11"), "requeue 11"),  # the plain requeue of a stop
        (lambda: requeue._scontrol("release", "11"), "release 11"),  # after a requeuehold
    ],
    ids=["requeue", "release"],
)
def test_a_sigterm_during_scontrol_does_not_kill_it(tmp_path, monkeypatch, call, answer):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pid_file, done_file = tmp_path / "pid", tmp_path / "done"
    script = bin_dir / "scontrol"
    script.write_text(
        f'#!/bin/sh\necho $$ > "{pid_file}.tmp" && mv "{pid_file}.tmp" "{pid_file}"\n'
        f'while [ ! -e "{tmp_path}/go" ]; do sleep 0.05; done\necho "$@" > "{done_file}"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    result: list[tuple[bool, str]] = []
    thread = threading.Thread(target=lambda: result.append(call()))
    thread.start()
    deadline = time.monotonic() + 20
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(int(pid_file.read_text()), signal.SIGTERM)  # what the requeue's job teardown sends
    time.sleep(0.3)
    Path(tmp_path / "go").touch()
    thread.join(20)
    assert result == [(True, f"scontrol {answer}")], result
    assert done_file.read_text().split() == answer.split()


STORM = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
stop, end = sys.argv[1], time.time() + 20
open(stop + ".on", "w").close()
while time.time() < end and not os.path.exists(stop):
    for _ in range(50):
        os.killpg(os.getpgrp(), signal.SIGTERM)
"""
DRIVER = """
import json, signal
signal.signal(signal.SIGTERM, lambda *_: None)  # the batch driver forwards it to the job step, and lives on
from relaytrain.resilience import requeue
print(json.dumps(requeue.scontrol_requeue("41", ["n2"])))
"""


def test_the_exclusion_of_a_requeue_outlives_a_sigterm_that_comes_before_the_ignore_is_set(tmp_path):
    """Slurm's SIGTERM may reach `scontrol update` before SIGTERM is ignored in it (seen: the update exited
    -15 and the requeued job kept no ExcNodeList). Forced: from `requeuehold` on, every process of the
    driver's group gets SIGTERM without pause until `release` is called, so each command's start (an
    interpreter's: tens of milliseconds) is hit many times."""
    bin_dir, log, stop = tmp_path / "bin", tmp_path / "calls", tmp_path / "stop"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(
        f'#!/bin/sh\necho "start $*" >> "{log}"\ncase "$1" in\n'
        '  show) echo "JobId=41 ExcNodeList=(null)";;\n'
        f'  requeuehold) "{sys.executable}" -c \'{STORM}\' "{stop}" > /dev/null 2>&1 &\n'
        f'    while [ ! -e "{stop}.on" ]; do sleep 0.05; done;;\n'
        f'  release) touch "{stop}";;\n'
        f'esac\necho "done $*" >> "{log}"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        [sys.executable, "-c", DRIVER], env=env, capture_output=True, text=True, timeout=120,
        start_new_session=True,  # the storm's process group: the driver's, not the test's
    )  # fmt: skip
    stop.touch()
    calls = log.read_text().splitlines()
    assert "done requeuehold 41" in calls, (calls, done.stderr[-2000:])  # the storm did start
    assert "done update JobId=41 ExcNodeList=n2" in calls and "done release 41" in calls, calls
    assert json.loads(done.stdout.splitlines()[-1])[0] is True, done.stdout


def test_a_failed_update_of_the_held_job_is_tried_again_before_its_release(monkeypatch):
    calls: list[tuple[str, ...]] = []
    updates = iter([(False, "scontrol update exited 1: slurmctld busy"), (True, "scontrol update")])

    def scontrol(*args: str) -> tuple[bool, str]:
        calls.append(args)
        return next(updates) if args[0] == "update" else (True, f"scontrol {args[0]}")

    monkeypatch.setattr(requeue, "_scontrol", scontrol)
    monkeypatch.setattr(requeue, "scontrol_job_field", lambda job_id, key: "(null)")
    assert requeue.scontrol_requeue("41", ["n2"])[0] is True
    assert [c[0] for c in calls] == ["requeuehold", "update", "update", "release"], calls
