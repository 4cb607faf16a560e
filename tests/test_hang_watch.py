"""The hang path from outside the ranks, without Slurm: real processes publish on a progress board, a real
node watcher process reads it, the driver's hang monitor judges, asks for stacks, reports and ends them.

Two stand-in ranks take a few quick steps (so each phase has a median), then rank 0 enters the stop
agreement and waits there (as a rank does whose peer never comes) and rank 1 is stopped with SIGSTOP in
its data phase. The monitor must name rank 1 (state T) and not rank 0, get rank 0's Python stack through
the watcher's signal, write the report and the hang record, print one ``hang detected:`` line, and the
watcher must kill both ranks.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from relaytrain.job import JobFacts, RunDir
from relaytrain.job.progress import PROGRESS_DIR_ENV
from relaytrain.job.progress_read import read_board
from relaytrain.resilience.hangs.detect import HangPolicy
from relaytrain.resilience.hangs.monitor import HangMonitor
from relaytrain.resilience.hangs.record import HangRecordFile

from conftest import child_env

RANK = """
import faulthandler, sys, time
from pathlib import Path
from relaytrain.job import RunDir
from relaytrain.job.progress import STACK_SIGNAL, Phase, ProgressBoard
rank, run = int(sys.argv[1]), RunDir(Path(sys.argv[2]))
run.logs.mkdir(parents=True, exist_ok=True)
faulthandler.register(STACK_SIGNAL, file=open(run.stack_dump(rank), "a"), all_threads=True)
board = ProgressBoard.open_from_env(rank, 0)
for step in range(1, 6):
    for phase in (Phase.DATA, Phase.FORWARD_BACKWARD, Phase.OPTIMIZER):
        board.phase(phase)
        time.sleep(0.01)
    with board.collective("stop_agreement"):
        time.sleep(0.01)
    board.step_done(step)
board.phase(Phase.DATA)
if rank == 0:
    board.phase(Phase.OPTIMIZER)
    with board.collective("stop_agreement"):
        def waiting_for_the_peer():
            time.sleep(3600)
        waiting_for_the_peer()
print("ready", flush=True)
time.sleep(3600)
"""


def start_rank(rank: int, run: RunDir, board: Path) -> subprocess.Popen:
    env = child_env(**{PROGRESS_DIR_ENV: str(board)})
    return subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(run.root)], env=env,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_monitor_names_the_stopped_rank_gets_the_others_stacks_and_ends_the_step(tmp_path, capsys):
    run, board = RunDir(tmp_path / "run"), tmp_path / "board"
    ranks = [start_rank(r, run, board) for r in (0, 1)]
    watcher = subprocess.Popen([sys.executable, "-m", "relaytrain.resilience.hangs.watch", "--run-dir",
                                str(run.root), "--progress-dir", str(board), "--node", "n1", "--job-id", "7",
                                "--interval", "0.2"], env=child_env())  # fmt: skip
    ended: list[bool] = []
    try:
        wait_for(lambda: len(read_board(board)) == 2 and all(r.step == 5 for r in read_board(board)), 60,
                 "both ranks at step 5")  # fmt: skip
        assert ranks[1].stdout.readline().strip() == "ready"
        ranks[1].send_signal(signal.SIGSTOP)
        job = JobFacts.from_env({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0"})
        policy = HangPolicy(floor_s=2.0, multiple=10.0, cap_s=60.0)
        monitor = HangMonitor(run, policy, job, lambda: ended.append(True), lambda line: None, interval_s=0.3)
        monitor.start()
        wait_for(lambda: all(p.poll() is not None for p in ranks), 60, "the watcher to end both ranks")
        monitor.stop()
        watcher.wait(timeout=15)  # it answered the request and left
    finally:
        for p in [*ranks, watcher]:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in ranks] == [-signal.SIGKILL, -signal.SIGKILL]
    assert watcher.returncode == 0
    assert not ended  # the watcher ended the ranks; srun did not have to be told

    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("hang detected: ")]
    assert len(lines) == 1 and lines[0].startswith("hang detected: rank 1 on n1 in data (stopped"), lines
    record = HangRecordFile(run).read()
    assert record is not None and record.job_id == "7" and record.step == 5
    assert [(c["rank"], c["node"], c["phase"]) for c in record.culprits] == [(1, "n1", "data")]
    assert "state T" in record.culprits[0]["why"] and record.line == lines[0]
    report = (run.root / record.report).read_text()
    assert report == run.hang_report(5).read_text()
    assert "state T" in report and "cannot run Python" in report  # the stopped rank: no stack from it
    assert "waiting_for_the_peer" in report  # rank 0's stack, which it wrote when its watcher asked
    node = json.loads(run.hang_node("n1").read_text())
    assert [r["rank"] for r in node["ranks"]] == [0, 1] and node["job_id"] == "7"
