"""relaytrain.job.torchrun: torchrun whose stop on a forwarded signal is one line, not two tracebacks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from relaytrain.resilience.codes import EXIT_RESUME

WORKER = """
import os, pathlib, signal, sys, time
signal.signal(signal.SIGUSR2, lambda *_: sys.exit(0))  # a worker that saved and stops cleanly
pathlib.Path(sys.argv[1], "ready-" + os.environ["LOCAL_RANK"]).touch()
time.sleep(60)
"""

# A worker whose save, on the stop signal, takes 20 s.
SLOW_SAVE = """
import os, pathlib, signal, sys, time
folder = pathlib.Path(sys.argv[1])
def save(*_):
    (folder / "saving").touch()
    time.sleep(20)
    (folder / "saved").touch()
    sys.exit(0)
signal.signal(signal.SIGUSR2, save)
(folder / "ready-0").touch()
time.sleep(60)
"""


def clean_env() -> dict[str, str]:
    """This process's environment without what other tests or a job may leave that torchrun reads."""
    prefixes = ("PET_", "TORCHELASTIC_", "SLURM_", "MASTER_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    return {**env, "OMP_NUM_THREADS": "1"}


def test_a_forwarded_stop_signal_ends_in_one_line_and_its_exit_code(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = subprocess.Popen(
        [sys.executable, "-m", "relaytrain.job.torchrun", "--standalone", "--nproc_per_node=2",
         "--max_restarts=0", "--signals-to-handle=SIGTERM,SIGINT,SIGUSR2", "--shutdown-timeout=20",
         str(script), str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
    )  # fmt: skip
    deadline = time.monotonic() + 90
    while len(list(tmp_path.glob("ready-*"))) < 2:
        assert proc.poll() is None, f"torchrun ended before its workers started: {proc.communicate()}"
        assert time.monotonic() < deadline, "the workers did not start within 90 s"
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGUSR2)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGUSR2, err[-2000:]
    assert "Traceback" not in err and "SignalException" not in err
    assert "relaytrain.job.torchrun: stopped by signal 12 (SIGUSR2) after forwarding it to the workers" in err


def test_the_shutdown_time_a_job_exports_is_the_time_the_workers_get_after_a_forwarded_signal(tmp_path):
    """A `--command` job exports PET_SHUTDOWN_TIMEOUT (slurm/templates/job.sh.j2) for the command's torchrun:
    here 2 s, against a worker whose save takes 20 s. torchrun's default, 30 s, would wait for it."""
    script = tmp_path / "worker.py"
    script.write_text(SLOW_SAVE)
    proc = subprocess.Popen(
        [sys.executable, "-m", "relaytrain.job.torchrun", "--standalone", "--nproc_per_node=1",
         "--max_restarts=0", "--signals-to-handle=SIGTERM,SIGINT,SIGUSR2", str(script), str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**clean_env(), "PET_SHUTDOWN_TIMEOUT": "2"},
    )  # fmt: skip
    deadline = time.monotonic() + 90
    while not (tmp_path / "ready-0").exists():
        assert proc.poll() is None, f"torchrun ended before its worker started: {proc.communicate()}"
        assert time.monotonic() < deadline, "the worker did not start within 90 s"
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGUSR2)
    _out, err = proc.communicate(timeout=60)
    assert (tmp_path / "saving").exists(), err[-2000:]  # the signal reached the worker
    assert not (tmp_path / "saved").exists(), err[-2000:]  # and it was killed 2 s later, mid-save


def test_a_failing_worker_keeps_torchruns_error_summary(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text("raise SystemExit(3)\n")
    done = subprocess.run(
        [sys.executable, "-m", "relaytrain.job.torchrun", "--standalone", "--nproc_per_node=1", str(script)],
        capture_output=True, text=True, timeout=120, env=clean_env(),
    )  # fmt: skip
    assert done.returncode == 1
    assert "ChildFailedError" in done.stderr and "exitcode  : 3" in done.stderr


def _wrapper(tmp_path, program: str, nproc: int = 2) -> subprocess.CompletedProcess:
    script = tmp_path / "worker.py"
    script.write_text(program)
    return subprocess.run(
        [sys.executable, "-m", "relaytrain.job.torchrun", "--standalone", f"--nproc_per_node={nproc}",
         "--max_restarts=0", str(script)],
        capture_output=True, text=True, timeout=120, env=clean_env(),
    )  # fmt: skip


@pytest.mark.slow
def test_every_worker_exiting_75_is_exit_75_in_one_line(tmp_path):
    """75 is the agreed graceful stop asking to be continued (docs/programs.md): plain torchrun calls it
    a failure (`FAILED ... exitcode: 75`, a ChildFailedError traceback) and exits 1."""
    done = _wrapper(tmp_path, "raise SystemExit(75)\n")
    assert done.returncode == EXIT_RESUME, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr, done.stderr
    assert "FAILED" not in done.stderr and "failed (exitcode: 75)" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if "relaytrain.job.torchrun" in line]
    # On a loaded machine one rank may still be exiting when torchrun sees the other's exit and ends it
    # (the next test forces that): the same stop, said with that rank named apart.
    assert len(lines) == 1 and lines[0] in (
        "relaytrain.job.torchrun: workers (rank 0,1) exited 75: stopped with a checkpoint, to be "
        "continued; exit code 75",
        *(
            f"relaytrain.job.torchrun: workers (rank {a}) exited 75 (rank {b} ended by torchrun while "
            "exiting): stopped with a checkpoint, to be continued; exit code 75"
            for a, b in ((0, 1), (1, 0))
        ),
    ), done.stderr


@pytest.mark.slow
def test_a_worker_still_exiting_when_torchrun_ends_it_keeps_the_stop_a_75(tmp_path):
    """Ranks leave a stop a moment apart: torchrun ends the others as soon as the first exits (SIGTERM)."""
    done = _wrapper(tmp_path, "import os, time\nif os.environ['RANK'] == '0': time.sleep(60)\n"
                              "raise SystemExit(75)\n")  # fmt: skip
    assert done.returncode == EXIT_RESUME, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if "relaytrain.job.torchrun" in line]
    assert lines == [
        "relaytrain.job.torchrun: workers (rank 1) exited 75 (rank 0 ended by torchrun while exiting): "
        "stopped with a checkpoint, to be continued; exit code 75"
    ], done.stderr


@pytest.mark.slow
def test_a_worker_that_fails_beside_a_75_keeps_torchruns_failure(tmp_path):
    done = _wrapper(tmp_path, "import os, time\nif os.environ['RANK'] == '0': time.sleep(1)\n"
                              "raise SystemExit(75 if os.environ['RANK'] == '0' else 3)\n")  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert "ChildFailedError" in done.stderr and "exitcode  : 3" in done.stderr
    # A crash first, the rest ended by torchrun: a failure, even if one of them would have exited 75.
    done = _wrapper(tmp_path, "import os, time\nif os.environ['RANK'] == '1': time.sleep(60)\n"
                              "raise SystemExit(3)\n")  # fmt: skip
    assert done.returncode == 1 and "exitcode  : 3" in done.stderr, done.stderr[-2000:]


SURVIVOR = """
import os, pathlib, signal, sys, time
out = pathlib.Path(__file__).parent
if os.environ["RANK"] == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a rank blocked in a collective with a dead peer
    (out / "ready").touch()
    time.sleep({survivor_s})
    (out / "survived").touch()
    raise SystemExit({survivor_code})
while not (out / "ready").exists():
    time.sleep(0.1)
raise SystemExit({first_code})
"""


@pytest.mark.slow
def test_after_a_crash_a_worker_that_ignores_sigterm_is_killed_within_the_failure_bound(tmp_path):
    """torchrun would wait 30 s: the survivor, which sleeps 25 s, would end by itself first."""
    from relaytrain.job.torchrun import FAILURE_SHUTDOWN_S

    assert FAILURE_SHUTDOWN_S < 25
    program = SURVIVOR.format(survivor_s=25, survivor_code=0, first_code=3)
    done = _wrapper(tmp_path, program)
    assert done.returncode == 1 and "exitcode  : 3" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "survived").exists(), done.stderr[-2000:]
    assert "Signal 9 (SIGKILL) received" in done.stderr, done.stderr[-2000:]  # ended by torchrun


@pytest.mark.slow
def test_after_an_agreed_stop_the_others_keep_torchruns_time_to_exit(tmp_path):
    """Rank 0 exits 75 first; rank 1 is still exiting (here: ignoring SIGTERM for longer than the
    failure bound) and ends by itself, as rank 0 writing the run's records would."""
    from relaytrain.job.torchrun import FAILURE_SHUTDOWN_S

    program = SURVIVOR.format(survivor_s=FAILURE_SHUTDOWN_S + 3, survivor_code=EXIT_RESUME, first_code=75)
    done = _wrapper(tmp_path, program)
    assert done.returncode == EXIT_RESUME, done.stderr[-2000:]
    assert (tmp_path / "survived").exists(), done.stderr[-2000:]
    assert "relaytrain.job.torchrun: workers (rank 0,1) exited 75" in done.stderr, done.stderr[-2000:]


def test_the_wrappers_resume_code_and_agreed_stops_are_relaytrains():
    from relaytrain.job import torchrun
    from relaytrain.resilience import codes

    assert torchrun.EXIT_RESUME == EXIT_RESUME
    assert {
        codes.EXIT_RESUME, codes.EXIT_RESTART_STEP, codes.EXIT_NONFINITE, codes.EXIT_STRAGGLER,
        codes.EXIT_INTERRUPTED,
    } == torchrun.AGREED_STOPS  # fmt: skip
