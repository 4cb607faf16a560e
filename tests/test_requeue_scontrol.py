"""The scontrol calls of a requeue that excludes nodes outlive the SIGTERM the requeue itself brings.

`scontrol requeuehold` ends the running job: Slurm sends SIGTERM to every process of the batch step, the
`scontrol update` and `scontrol release` that follow it included. A release killed half-way leaves the
job held for good (seen on the local cluster: "requeued held, but scontrol release 11 exited -15"). The
race is forced here: the `scontrol` on PATH records its pid, waits for the test's SIGTERM, then finishes.
"""

from __future__ import annotations

import os
import signal
import stat
import threading
import time
from pathlib import Path

from relaytrain.resilience import requeue


def test_a_sigterm_during_scontrol_does_not_kill_it(tmp_path, monkeypatch):
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
    call = threading.Thread(target=lambda: result.append(requeue._scontrol("release", "11")))
    call.start()
    deadline = time.monotonic() + 20
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(int(pid_file.read_text()), signal.SIGTERM)  # what the requeue's job teardown sends
    time.sleep(0.3)
    Path(tmp_path / "go").touch()
    call.join(20)
    assert result == [(True, "scontrol release 11")], result
    assert done_file.read_text().split() == ["release", "11"]
