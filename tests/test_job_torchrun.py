"""relaytrain.job.torchrun: torchrun whose stop on a forwarded signal is one line, not two tracebacks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

WORKER = """
import signal, sys, time
signal.signal(signal.SIGUSR2, lambda *_: sys.exit(0))  # a worker that saved and stops cleanly
print("ready", flush=True)
time.sleep(60)
"""


def test_a_forwarded_stop_signal_ends_in_one_line_and_its_exit_code(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = subprocess.Popen(
        [sys.executable, "-m", "relaytrain.job.torchrun", "--standalone", "--nproc_per_node=2",
         "--max_restarts=0", "--signals-to-handle=SIGTERM,SIGINT,SIGUSR2", "--shutdown-timeout=20",
         str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    ready = 0
    while ready < 2:
        line = proc.stdout.readline()
        assert line, f"torchrun ended before its workers started: {proc.stderr.read()[-2000:]}"
        ready += line.strip() == "ready"
    os.kill(proc.pid, signal.SIGUSR2)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGUSR2, err[-2000:]
    assert "Traceback" not in err and "SignalException" not in err
    assert "relaytrain.job.torchrun: stopped by signal 12 (SIGUSR2) after forwarding it to the workers" in err


def test_a_failing_worker_keeps_torchruns_error_summary(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text("raise SystemExit(3)\n")
    done = subprocess.run(
        [sys.executable, "-m", "relaytrain.job.torchrun", "--standalone", "--nproc_per_node=1", str(script)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 1
    assert "ChildFailedError" in done.stderr and "exitcode  : 3" in done.stderr
