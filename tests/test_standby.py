"""The standby process of job/standby.py, with a small command in place of the trainer's: it waits without
CPU, becomes the rank it is handed (that rank's whole environment, its output files, the same pid), is
killed and reaped by `end`, and exits when its agent dies. (tests/test_survivors.py: under torchrun.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from relaytrain.job.standby import Standby

from conftest import child_env

SRC = str(Path(__file__).resolve().parents[1] / "src")
RANK_PROGRAM = (
    "from relaytrain.job.standby import become_rank; become_rank(lambda: __import__('json')); "
    "import os, sys; print('rank', os.environ['RANK'], os.environ.get('ONLY_BEFORE')); "
    "print('to stderr', file=sys.stderr)"
)


def started(program: str = RANK_PROGRAM) -> Standby:
    env = child_env(PYTHONPATH=SRC, ONLY_BEFORE="1")
    standby = Standby([sys.executable, "-c", program], env)
    deadline = time.monotonic() + 60
    while not standby.ready():
        assert standby.proc.poll() is None and time.monotonic() < deadline, "the standby never got ready"
        time.sleep(0.02)
    return standby


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_standby_waits_without_cpu_then_becomes_the_rank_it_is_handed(tmp_path):
    standby = started()
    before = cpu_ticks(standby.proc.pid)
    time.sleep(1.0)
    assert cpu_ticks(standby.proc.pid) - before <= 2, "the standby used CPU while it waited"
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    err.write_text("the dead rank's lines\n")
    rank_env = child_env(PYTHONPATH=SRC, RANK="3")
    rank_env.pop("ONLY_BEFORE", None)
    standby.become(rank_env, str(out), str(err))
    assert standby.proc.wait(timeout=60) == 0
    assert out.read_text() == "rank 3 None\n"  # the rank's environment replaces the standby's
    lines = err.read_text().splitlines()
    assert lines[0] == "the dead rank's lines" and lines[-1] == "to stderr", lines
    assert f"the standby process (pid {standby.proc.pid}) becomes rank 3" in lines[1], lines
    standby.end()  # a standby that became a rank is the agent's worker now: left alone


def test_end_kills_and_reaps_a_waiting_standby():
    standby = started()
    standby.end()
    assert standby.proc.returncode == -signal.SIGKILL and not alive(standby.proc.pid)


def test_a_standby_exits_when_its_agent_dies(tmp_path):
    agent = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; sys.path[:0] = [sys.argv[1], sys.argv[2]]; "
         "import test_standby as t; print(t.started().proc.pid, flush=True); time.sleep(600)",
         SRC, str(Path(__file__).parent)],
        env=child_env(PYTHONPATH=SRC), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    pid = int(agent.stdout.readline())
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait()
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid), "the standby outlived its agent"
