"""The hang faults of faults/ (a FIFO read, a stalled loader, a skipped collective, a slow rank) land on the
rank and at the step asked for, and hold it the way they should.

The fast tests wrap a stand-in trainer; the `slow` ones run 2 ranks under torchrun (gloo, CPU, the tests'
tiny config): a blocking fault must stop the run (the in-process watchdog ends it after
`resilience.hang_timeout_s`), a slow rank must not. The hang benchmark (bench/cluster/chaos_hangs.py)
relies on each of them landing, and on its landed line's time.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from relaytrain.job.facts import STEP_RESTARTS_ENV
from relaytrain.resilience.codes import StopReason

import faults
from bench.cluster.chaos_hangs import remove_fifo
from conftest import TINY, child_env
from faults.pythonpath import relaytrain_faults

# -- fast: a stand-in trainer ------------------------------------------------------------------------


class Recorder:
    """What the wrapped seams were called with."""

    def __init__(self):
        self.calls: list[tuple] = []

    def next_batch(self, step):
        self.calls.append(("next_batch", step))
        return "batch"

    def agree_with(self, step, save_estimate_s=0.0, flag=None):
        self.calls.append(("agree_with", step))
        return StopReason.PREEMPTION, True

    def beat(self, step=None):
        self.calls.append(("beat", step))

    def reduce_mean(self, value, board=None, name="mean"):
        self.calls.append(("reduce_mean", name))
        return -1.0  # the mean over the ranks


def trainer(rank: int = 1, world_size: int = 2) -> SimpleNamespace:
    seams = Recorder()
    return SimpleNamespace(
        env=SimpleNamespace(rank=rank, world_size=world_size),
        state=SimpleNamespace(step=0),
        loader=SimpleNamespace(next_batch=seams.next_batch),
        controller=SimpleNamespace(agree_with=seams.agree_with),
        supervision=SimpleNamespace(watchdog=SimpleNamespace(beat=seams.beat)),
        model=SimpleNamespace(reduce_mean=seams.reduce_mean),
        seams=seams,
    )


def attach(t: SimpleNamespace, **fault) -> list[str]:
    said: list[str] = []
    env = {k: v for k, v in faults.variables(**fault).items()}
    relaytrain_faults.HangFaults(env).attach(t, said.append)
    return said


def test_the_step_restarts_variable_is_relaytrains():
    assert relaytrain_faults.STEP_RESTARTS_ENV == STEP_RESTARTS_ENV


def test_a_skipped_collective_is_the_loss_mean_of_its_step_once_on_its_rank_only():
    t = trainer()
    said = attach(t, skip_collective_at_step=3)
    t.state.step = 2
    assert t.model.reduce_mean(0.5, None, "loss_mean") == -1.0  # not yet: the real call
    t.state.step = 3
    assert t.model.reduce_mean(0.5, None, "val_loss_mean") == -1.0  # another collective of step 3
    assert t.model.reduce_mean(0.5, None, "loss_mean") == 0.5  # skipped: its own loss, no all-reduce
    assert said == ["skipped the loss_mean collective at step 3 on rank 1"]
    assert t.model.reduce_mean(0.5, None, "loss_mean") == -1.0  # once per process
    assert t.seams.calls == [("reduce_mean", n) for n in ("loss_mean", "val_loss_mean", "loss_mean")]
    other = trainer(rank=0)
    other.state.step = 3
    assert (
        attach(other, skip_collective_at_step=3) == []
        and other.model.reduce_mean(0.5, None, "loss_mean") == -1.0
    )


def test_the_fault_rank_picks_the_rank_and_a_restarted_step_runs_clean():
    first, last = trainer(rank=0), trainer(rank=1)
    attach(first, rank=0, skip_collective_at_step=1)
    attach(last, rank=0, skip_collective_at_step=1)
    for t in (first, last):
        t.state.step = 1
    assert first.model.reduce_mean(0.5, None, "loss_mean") == 0.5  # skipped on rank 0
    assert last.model.reduce_mean(0.5, None, "loss_mean") == -1.0
    restarted = trainer()
    restarted.state.step = 1
    env = faults.variables(skip_collective_at_step=1) | {STEP_RESTARTS_ENV: "1"}
    relaytrain_faults.HangFaults(env).attach(restarted, print)
    assert restarted.model.reduce_mean(0.5, None, "loss_mean") == -1.0


@pytest.mark.parametrize(("job_step", "restarts", "stops"), [(None, "0", True), (None, "1", False),
                                                             (1, "0", False), (1, "1", True)])  # fmt: skip
def test_a_stop_in_a_phase_lands_in_the_job_step_asked_for(tmp_path, monkeypatch, job_step, restarts, stops):
    from relaytrain.job import progress

    stopped: list[int] = []
    monkeypatch.setattr(relaytrain_faults.os, "kill", lambda pid, sig: stopped.append(sig))
    monkeypatch.setattr(progress.ProgressBoard, "_write_locked", progress.ProgressBoard._write_locked)
    env = faults.variables(rank=0, stop_in_phase="rendezvous", stop_in_job_step=job_step)
    relaytrain_faults.HangFaults(env | {STEP_RESTARTS_ENV: restarts}).stop_in_phase_of(progress, print)
    board = progress.ProgressBoard(tmp_path, rank=0, local_rank=0)
    board.phase(progress.Phase.RENDEZVOUS)
    board.close()
    assert stopped == ([signal.SIGSTOP] if stops else [])


def test_a_stalled_fetch_blocks_after_its_landed_line(monkeypatch):
    t = trainer()
    said = attach(t, stall_at_step=2)
    assert t.loader.next_batch(1) == "batch"  # step 1
    t.state.step = 1
    waited = threading.Event()
    monkeypatch.setattr(threading.Event, "wait", lambda self, timeout=None: waited.set())
    assert t.loader.next_batch(2) == "batch" and waited.is_set()  # the stand-in wait returns at once
    assert said == ["data loader stall at step 2 on rank 1"]


def test_a_slow_rank_sleeps_its_own_step_time_times_the_factor_less_one(monkeypatch):
    t = trainer()
    said = attach(t, slow_factor=5, slow_from_step=2)
    slept: list[float] = []
    monkeypatch.setattr(relaytrain_faults.time, "sleep", slept.append)
    for step in (1, 2, 3):
        t.loader.next_batch(step)
        threading.Event().wait(0.05)  # the step's work (time.sleep is the fault's, recorded)
        t.supervision.watchdog.beat(step)
        t.supervision.watchdog.beat(step)  # a save's beat of the same step: no second sleep
        t.supervision.watchdog.beat()  # an evaluation's
    assert len(slept) == 2 and all(0.05 * 4 <= s < 0.05 * 4 * 3 for s in slept), slept
    assert len(said) == 1 and said[0].startswith("5x slower steps from step 2 on rank 1")


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"RELAYTRAIN_FAULT_SLOW_FACTOR": "5"}, "go together"),
        ({"RELAYTRAIN_FAULT_SLOW_FACTOR": "1", "RELAYTRAIN_FAULT_SLOW_FROM_STEP": "2"}, "must be > 1"),
        ({"RELAYTRAIN_FAULT_FIFO_AT_STEP": "soon"}, "'soon' is not a valid int"),
        ({"RELAYTRAIN_FAULT_STALL": "3"}, "unknown RELAYTRAIN_FAULT_STALL;"),
    ],
)
def test_a_hang_fault_asked_for_wrongly_stops_the_process_with_its_reason(variables, message):
    env = child_env(PYTHONPATH=f"{faults.PYTHONPATH_DIR}:{child_env().get('PYTHONPATH', '')}", **variables)
    done = subprocess.run([sys.executable, "-c", "pass"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and message in done.stderr, done.stderr


# -- slow: 2 ranks under torchrun --------------------------------------------------------------------


def torchrun(run_dir: Path, steps: int, *extra: str, **fault) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "relaytrain.cli", "train", *TINY, f"--train.max_steps={steps}", "--checkpoint.interval=0",
           f"--run.dir={run_dir.parent}", f"--run.name={run_dir.name}", *extra]  # fmt: skip
    env = child_env(**faults.env(**fault), TORCH_ELASTIC_SHUTDOWN_TIMEOUT="3")
    done = subprocess.run(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300
    )
    return done.returncode, done.stdout


def train_rows(run_dir: Path) -> dict[int, dict]:
    path = run_dir / "metrics.jsonl"
    rows = (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )
    return {r["step"]: r for r in rows if r.get("kind") == "train"}


BLOCKING = {
    "fifo_at_step": "FIFO read with no writer at step 4 on rank {rank}: ",
    "stall_at_step": "data loader stall at step 4 on rank {rank}",
    "skip_collective_at_step": "skipped the loss_mean collective at step 4 on rank {rank}",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "rank"), [("fifo_at_step", 1), ("stall_at_step", 0), ("skip_collective_at_step", 1)]
)
def test_a_blocking_hang_fault_holds_its_rank_at_its_step_until_the_watchdog_ends_the_run(
    tmp_path, fault, rank
):
    run_dir = tmp_path / "run"
    before = time.time()
    chosen = {"rank": rank} if rank == 0 else {}  # rank 1: the default, the last rank
    rc, out = torchrun(run_dir, 30, "--resilience.hang_timeout_s=10", **{fault: 4}, **chosen)
    landed = faults.landed_at(out)
    assert len(landed) == 1 and landed[0][0].startswith(BLOCKING[fault].format(rank=rank)), out[-3000:]
    if fault == "fifo_at_step":
        fifo = Path(landed[0][0].rsplit(": ", 1)[1])
        assert fifo.is_fifo()  # the rank blocked opening it, and nobody ever wrote
        remove_fifo(landed[0][0])
        assert not fifo.parent.exists()
    assert before < landed[0][1] < time.time()
    assert rc != 0, out[-3000:]  # the run did not finish: the hang held it until the watchdog
    state = json.loads((run_dir / "run_state.json").read_text())
    assert state["status"] != "finished" and max(train_rows(run_dir), default=0) < 30, state
    if fault != "skip_collective_at_step":  # the fetch of step 4 never returned: step 3 was the last
        assert max(train_rows(run_dir)) == 3


@pytest.mark.slow
def test_a_slow_rank_makes_the_steps_slower_and_the_run_still_finishes(tmp_path):
    run_dir = tmp_path / "run"
    rc, out = torchrun(run_dir, 12, step_delay_s=0.1, slow_factor=5, slow_from_step=7)
    slow = [text for text in faults.landed(out) if "slower" in text]  # the step delay lands too, per rank
    assert len(slow) == 1 and slow[0].startswith("5x slower steps from step 7 on rank 1"), out[-3000:]
    assert rc == 0, out[-3000:]
    # Each step's wall time: between the train records rank 0 logs (log_every=1) at each step's end
    times = {s: r["time"] for s, r in train_rows(run_dir).items()}
    assert sorted(times) == list(range(1, 13))
    seconds = {s: times[s] - times[s - 1] for s in range(2, 13)}
    before = statistics.median(seconds[s] for s in range(2, 7))
    after = statistics.median(seconds[s] for s in range(7, 13))
    assert after > 3 * before, seconds  # 5x: the other rank waits for the slow one
