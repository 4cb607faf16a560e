"""The trainer's side of hang detection (issue 37): every rank publishes its progress board (step, phase,
the collectives relaytrain issues), answers the watcher's STACK_SIGNAL with its stacks, and the process
groups' timeout is derived from the hang settings. Fast: one and two processes on gloo, no Slurm."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from relaytrain.checkpoint import Persistence, RunRecord, TrainingState
from relaytrain.config import Config, config_hash, config_to_toml
from relaytrain.config.loader import load_config
from relaytrain.config.schema import ModelConfig
from relaytrain.errors import ConfigError
from relaytrain.job import RunDir
from relaytrain.job.clock import StepClock
from relaytrain.job.progress import _HEAD, PROGRESS_DIR_ENV, Phase, ProgressBoard
from relaytrain.job.progress_read import read_board, read_record
from relaytrain.model import Transformer
from relaytrain.resilience import StackSignal

import faults
from conftest import child_env, losses_by_step, run_torchrun

TRAINING = {Phase.DATA, Phase.FORWARD_BACKWARD, Phase.OPTIMIZER}


# -- the board itself -----------------------------------------------------------------------------------


def test_phases_are_timed_into_medians_and_collectives_entered_then_left(tmp_path):
    board = ProgressBoard(tmp_path, rank=3, local_rank=1)
    for step in (1, 2, 3):
        board.phase(Phase.DATA)
        time.sleep(0.01)
        board.phase(Phase.FORWARD_BACKWARD)
        with board.collective("stop_agreement"):
            (inside,) = read_board(tmp_path)
            assert inside.in_collective and inside.collective == "stop_agreement"
        board.step_done(step)
    (record,) = read_board(tmp_path)
    assert (record.rank, record.local_rank, record.pid, record.step) == (3, 1, os.getpid(), 3)
    assert record.phase == Phase.AFTER_STEP and not record.in_collective  # step_done moves it on
    assert record.collectives_entered == record.collectives_left == 3
    assert record.last_step_collectives == record.usual_step_collectives == 1
    assert record.medians[Phase.DATA] >= 0.01 and Phase.OPTIMIZER not in record.medians
    board.close()
    assert read_board(tmp_path)[0].phase == Phase.DONE


def test_a_record_under_write_is_not_read(tmp_path):
    board = ProgressBoard(tmp_path, rank=0, local_rank=0)
    board.step_done(7)
    path = tmp_path / "rank0"
    good = path.read_bytes()
    magic, version, seq = _HEAD.unpack_from(good, 0)
    torn = bytearray(good)
    _HEAD.pack_into(torn, 0, magic, version, seq + 1)  # odd: a writer is between its two stores
    path.write_bytes(bytes(torn))
    assert read_record(path, attempts=3) is None
    path.write_bytes(good)
    assert read_record(path).step == 7


def test_the_board_writes_nothing_outside_a_watched_job(tmp_path, monkeypatch):
    monkeypatch.delenv(PROGRESS_DIR_ENV, raising=False)
    board = ProgressBoard.open_from_env(0, 0)
    board.phase(Phase.DATA)
    with board.collective("stop_agreement"):
        board.step_done(1)
    board.close()
    assert not board.enabled
    monkeypatch.setenv(PROGRESS_DIR_ENV, str(tmp_path / "board"))
    assert ProgressBoard.open_from_env(2, 0).enabled and (tmp_path / "board" / "rank2").exists()


# -- the parts that publish on it -----------------------------------------------------------------------


class Recording(ProgressBoard):
    """A board that also keeps every phase it was asked for, with its budget."""

    def __init__(self, directory: Path):
        super().__init__(directory, 0, 0)
        self.phases: list[tuple[Phase, float]] = []

    def phase(self, phase: Phase, budget_s: float = 0.0) -> None:
        self.phases.append((phase, budget_s))
        super().phase(phase, budget_s)


def test_the_persistence_front_publishes_its_loads_and_saves_with_the_estimate(tmp_path):
    cfg = Config()
    cfg.model = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32)
    cfg.checkpoint.interval = 2
    model = Transformer(cfg.model)
    model.init_weights(seed=0)
    training = TrainingState([model], [torch.optim.AdamW(model.parameters(), lr=1e-2)])
    record = RunRecord("run", config_to_toml(cfg), config_hash(cfg), cfg.model, "byte")
    board = Recording(tmp_path / "board")
    front = Persistence(cfg.checkpoint, RunDir(tmp_path / "run"), record, training, rank=0, world_size=1,
                        parallel_dims={}, clock=StepClock(board))  # fmt: skip
    estimate = front.save_seconds_estimate()
    front.restore()
    assert board.phases == [(Phase.CHECKPOINT_LOAD, estimate), (Phase.STARTUP, 0.0)]  # still starting
    board.phases.clear()
    board.phase(Phase.OPTIMIZER)
    front.after_step(1, is_last=False)  # no save due: nothing published
    front.after_step(2, is_last=False)
    assert board.phases == [(Phase.OPTIMIZER, 0.0), (Phase.CHECKPOINT_SAVE, estimate)]  # the loop goes on
    board.phase(Phase.STOP)
    front.save_now(3, "preemption")
    (save, budget), after = board.phases[-2], board.phases[-1]
    assert (save, after) == (Phase.CHECKPOINT_SAVE, (Phase.STOP, 0.0)) and budget > 0
    front.close(finished=True)


def test_the_stack_signal_appends_every_threads_stack_and_the_process_goes_on(tmp_path):
    path = tmp_path / "logs" / "stacks_rank0.txt"
    assert not StackSignal.register(path, enabled=False).registered
    stacks = StackSignal.register(path)
    try:
        os.kill(os.getpid(), signal.SIGURG)
        time.sleep(0.1)
    finally:
        stacks.close()
    assert 'File "' in path.read_text() and "test_progress_board.py" in path.read_text()
    os.kill(os.getpid(), signal.SIGURG)  # unregistered: ignored again, as by default


# -- the config ------------------------------------------------------------------------------------------


def test_the_collective_timeout_is_derived_from_the_hang_settings_unless_set():
    resilience = load_config(None, []).resilience
    assert (resilience.hang_floor_s, resilience.hang_multiple, resilience.collective_timeout_s) == (40, 10, 0)
    assert resilience.effective_collective_timeout_s() == 1800 + 120
    off = load_config(None, ["--resilience.hang_timeout_s=0"])  # the watchdog off: the floor
    assert off.resilience.effective_collective_timeout_s() == 160
    floor = load_config(None, ["--resilience.hang_timeout_s=15", "--resilience.hang_floor_s=90"])
    assert floor.resilience.effective_collective_timeout_s() == 210
    explicit = load_config(None, ["--resilience.collective_timeout_s=97"])
    assert explicit.resilience.effective_collective_timeout_s() == 97


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("--resilience.hang_floor_s=0", "resilience.hang_floor_s=0.0 is not allowed: must be in (0, 1e+07]"),
        ("--resilience.hang_multiple=1", "resilience.hang_multiple=1.0 is not allowed: must be in (1, 1000]"),
        (
            "--resilience.hang_multiple=nan",
            "resilience.hang_multiple=nan is not allowed: floats must be finite",
        ),
        ("--resilience.collective_timeout_s=-1", "collective_timeout_s=-1.0 is not allowed: must be in [0,"),
    ],
)
def test_bad_hang_settings_are_refused_with_one_line(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert fragment in str(info.value)


# -- the trainer -----------------------------------------------------------------------------------------


def test_two_ranks_publish_steps_phases_and_their_collectives(tmp_path):
    board = tmp_path / "board"
    # the usual count is the mode over the steps before the last: start-up's and the log step's differ
    steps = 7  # not 6: the straggler gather of step 5 (every 5 steps) counts in the step after it
    result = run_torchrun(
        2,
        ["train", f"--train.max_steps={steps}", f"--run.dir={tmp_path}"],
        tmp_path,
        **{PROGRESS_DIR_ENV: str(board)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_board(board)
    assert [r.rank for r in records] == [0, 1]
    for r in records:
        assert (r.step, r.phase) == (steps, Phase.DONE), r
        assert r.collectives_entered == r.collectives_left > steps, r  # a stop agreement a step, and more
        # FSDP's all-gathers and reduce-scatters (issue 53) and the stop agreement, the same every step
        assert r.usual_step_collectives == r.last_step_collectives > 1, r
        assert TRAINING | {Phase.STARTUP, Phase.EVALUATION, Phase.CHECKPOINT_SAVE} <= set(r.medians), r
        # issue 53: the start-up's own phases, and marks inside the forward/backward (its layers)
        assert {Phase.RENDEZVOUS, Phase.FIRST_STEP} <= set(r.medians) and r.marks > 0, r
        assert r.pauses[Phase.FORWARD_BACKWARD] < r.medians[Phase.FORWARD_BACKWARD], r
    assert records[0].collective == records[1].collective != ""


def test_tensor_parallelisms_redistributions_are_collectives_on_the_board_and_change_no_loss(tmp_path):
    """Issue 53: with tensor parallelism (2 ranks, no FSDP sharding) DTensor's redistributions are on the
    board, each waited for where it is issued; the losses are those of the same run without a board."""
    runs = {}
    for name, env in (("board", {PROGRESS_DIR_ENV: str(tmp_path / "board")}), ("plain", {})):
        args = ["train", "--train.max_steps=3", "--train.eval_every=0", "--metrics.log_every=1",
                "--parallel.tp=2", f"--run.dir={tmp_path / name}"]  # fmt: skip
        result = run_torchrun(2, args, tmp_path, **env)
        assert result.returncode == 0, result.stderr[-3000:]
        (runs[name],) = (tmp_path / name).glob("*/metrics.jsonl")
    assert losses_by_step(runs["board"].parent) == losses_by_step(runs["plain"].parent)
    assert len(losses_by_step(runs["board"].parent)) == 3
    for r in read_board(tmp_path / "board"):
        # the stop agreement and the loss mean are a few a step; the debug model's redistributions, 100s
        assert r.last_step_collectives > 100 and r.collectives_entered == r.collectives_left, r


def test_a_running_trainer_writes_its_stacks_on_the_signal_and_finishes(tmp_path):
    board, run = tmp_path / "board", tmp_path / "debug"
    env = child_env(**faults.env(step_delay_s=1.0), **{PROGRESS_DIR_ENV: str(board)})
    args = ["train", "--train.max_steps=5", "--train.eval_every=0", f"--run.dir={tmp_path}"]
    proc = subprocess.Popen([sys.executable, "-m", "relaytrain.cli", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    seen: set[tuple[int, Phase]] = set()
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            records = read_board(board)
            seen |= {(r.step, r.phase) for r in records}
            if records and records[0].step >= 2:
                break
            time.sleep(0.05)
        (record,) = records
        assert record.step >= 2 and record.pid == proc.pid, (record, proc.poll())
        os.kill(proc.pid, signal.SIGURG)
        output, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, output[-3000:]
    stacks = (run / "logs" / "stacks_rank0.txt").read_text()
    assert 'File "' in stacks and "most recent call first" in stacks, stacks
    assert read_board(board)[0].phase == Phase.DONE
    # The first step (compilation, first allocations) is start-up; training phases come after it.
    assert not {p for s, p in seen if s == 0} & TRAINING, seen
    assert (1, Phase.OPTIMIZER) in seen, seen  # step 2 sleeps in the fault's delay after its optimizer


def test_each_collective_names_the_one_entered_at_its_place_in_the_step_before(tmp_path):
    board = ProgressBoard(tmp_path, rank=0, local_rank=0)
    for name in ("stop_agreement", "loss_mean"):
        with board.collective(name):
            pass
    board.step_done(1)
    with board.collective("memory_max"):
        (record,) = read_board(tmp_path)
        assert (record.collective, record.expected_collective) == ("memory_max", "stop_agreement")
    with board.collective("loss_mean"):
        assert read_board(tmp_path)[0].expected_collective == "loss_mean"
    with board.collective("checkpoint_flag"):
        assert read_board(tmp_path)[0].expected_collective == ""  # the step before entered only two
