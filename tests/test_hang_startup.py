"""A rank stopped during the start-up is named within the start-up's own limit (issue 53), without Slurm.

Two ranks start under torchrun (gloo, CPU, the tests' tiny config) on a progress board; a real node
watcher process reads it and the driver's hang monitor runs here. Rank 1 stops itself with SIGSTOP as it
publishes a start-up phase (faults/: ``stop_in_phase``): the rendezvous, before its process group exists
(rank 0 waits in the rendezvous for it), or the restore (rank 0 waits in the restore's broadcast). The
monitor's cap is set far above the floor: before issue 53 the start-up's limit was the cap (and a rank
without a process group had no board at all), so only start-up phases with limits of their own name
rank 1 within the floor (the restore: twice its estimate)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from relaytrain import entry_points
from relaytrain.job import JobFacts, RunDir
from relaytrain.job.progress import PROGRESS_DIR_ENV, Phase
from relaytrain.job.progress_read import read_board
from relaytrain.resilience.hangs.detect import HangPolicy
from relaytrain.resilience.hangs.monitor import HangMonitor

import faults
from conftest import TINY, child_env

FLOOR_S = 4.0
SLACK_S = 4.0  # the watcher's and the monitor's looks (0.2 s, 0.3 s apart) on 2 shared cores


@pytest.mark.slow
@pytest.mark.parametrize("phase", [Phase.RENDEZVOUS, Phase.CHECKPOINT_LOAD], ids=lambda p: p.name.lower())
def test_a_rank_stopped_in_a_start_up_phase_is_named_within_the_floor(tmp_path, phase):
    run, board, log = RunDir(tmp_path / "run"), tmp_path / "board", tmp_path / "torchrun.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "relaytrain.cli", "train", *TINY, "--train.max_steps=3", "--checkpoint.interval=0",
           f"--run.dir={run.root.parent}", f"--run.name={run.root.name}"]  # fmt: skip
    env = child_env(**faults.env(stop_in_phase=phase.label), TORCH_ELASTIC_SHUTDOWN_TIMEOUT="3",
                    **{PROGRESS_DIR_ENV: str(board)})  # fmt: skip
    with open(log, "w") as out:
        ranks = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    watcher = subprocess.Popen([sys.executable, "-m", entry_points.HANG_WATCH, "--run-dir",
                                str(run.root), "--progress-dir", str(board), "--node", "n1", "--job-id", "7",
                                "--interval", "0.2"], env=child_env())  # fmt: skip
    job = JobFacts.from_env({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0"})
    policy = HangPolicy(floor_s=FLOOR_S, multiple=10.0, cap_s=600.0)
    said: list[str] = []
    monitor = HangMonitor(run, policy, job, lambda: None, said.append, interval_s=0.3).start()
    try:
        deadline = time.monotonic() + 120
        while monitor.verdict is None and time.monotonic() < deadline and ranks.poll() is None:
            time.sleep(0.2)
        verdict, detected = monitor.verdict, time.time()
        records = read_board(board)
        monitor.stop()
        if verdict is not None:
            ranks.wait(timeout=60)  # the watcher ended both ranks; torchrun's agent follows
    finally:
        for p in (ranks, watcher):
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
    output = log.read_text()
    landed = faults.landed_at(output)
    assert [text for text, _ in landed] == [f"SIGSTOP in {phase.label} on rank 1"], output[-3000:]
    assert verdict is not None and verdict.hung, (said, output[-3000:])
    assert [(c.rank, c.node, c.phase) for c in verdict.culprits] == [(1, "n1", phase.label)], verdict
    assert "stopped (state T" in verdict.culprits[0].why
    if phase is Phase.RENDEZVOUS:
        assert verdict.limit_s == FLOOR_S and "rendezvous: the floor" in verdict.limit_why, verdict
    else:  # a restore: twice its estimate (the tiny state's planned one: seconds), where the others wait
        assert FLOOR_S <= verdict.limit_s <= 30 and "checkpoint load: " in verdict.limit_why, verdict
    # named within the limit (plus the looks), long before the cap or the backend's init timeout
    assert detected - landed[0][1] < verdict.limit_s + SLACK_S, (detected - landed[0][1], verdict)
    assert {r.rank: r.phase for r in records} == {0: phase, 1: phase}, records  # rank 0 waits for it
