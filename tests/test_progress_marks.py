"""Progress inside a phase and the start-up's own phases on the progress board (issue 53): marks measure a
phase's longest pause (what the hang monitor's limit is judged on), are published at most every
MARK_GAP_S, carry a share of the phase's budget; the layers mark their forward and backward without
touching a gradient; FSDP's all-gathers and reduce-scatters are collectives on the board (a rank waiting
in one shows it while it waits); each graph compiled is a phase of its own; the task wrapper opens the
board before the command runs. Fast: no real process group (a fake one for FSDP), no training."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from relaytrain import torch_private
from relaytrain.job import marks, startup
from relaytrain.job.clock import StepClock
from relaytrain.job.progress import MARK_GAP_S, PROGRESS_DIR_ENV, Phase, ProgressBoard
from relaytrain.job.progress_read import read_record

import needs
from conftest import child_env


@pytest.fixture(autouse=True)
def _no_start_up_board_left_open():
    """A training run earlier in this worker that failed before the supervision front took its start-up
    board leaves it in ``startup._open`` (a process trains once outside the tests): not this test's."""
    startup._open.clear()
    yield
    startup._open.clear()


def test_marks_measure_the_longest_pause_and_are_published_at_most_every_gap(tmp_path):
    board = ProgressBoard(tmp_path, rank=0, local_rank=0)
    board.phase(Phase.FORWARD_BACKWARD)
    for _ in range(10):
        time.sleep(0.03)
        board.mark()
    time.sleep(0.03)
    board.phase(Phase.OPTIMIZER)
    record = read_record(tmp_path / "rank0")
    fb_length, fb_pause = record.medians[Phase.FORWARD_BACKWARD], record.pauses[Phase.FORWARD_BACKWARD]
    assert fb_length >= 0.3 and 0.03 <= fb_pause < fb_length / 3, record  # judged on the gaps
    assert record.marks == 10
    # marks closer than MARK_GAP_S: counted, not written (the token the watcher reads stays)
    before = read_record(tmp_path / "rank0").token()
    board.mark()  # right after the phase's write
    assert read_record(tmp_path / "rank0").token() == before
    time.sleep(MARK_GAP_S * 2)
    board.mark()
    after = read_record(tmp_path / "rank0")
    assert after.marks == 12 and after.token() != before
    board.close()


def test_a_mark_with_a_share_bounds_the_next_piece_by_that_share_of_the_phase_budget(tmp_path):
    board = ProgressBoard(tmp_path, rank=0, local_rank=0)
    board.phase(Phase.CHECKPOINT_SAVE, budget_s=60.0)
    board.mark(share=0.25)
    assert read_record(tmp_path / "rank0").budget_s == pytest.approx(15.0)
    board.phase(Phase.DATA)
    board.mark(share=0.25)  # no budget to share
    assert read_record(tmp_path / "rank0").budget_s == 0.0
    board.close()


def test_marks_without_a_board_count_only_in_the_checkpoint_phases(tmp_path):
    """An asynchronous save's writer threads go on while the loop trains: their marks must not show a
    training phase moving."""
    board = ProgressBoard(tmp_path, rank=0, local_rank=0)
    marks.publish_to(board)
    try:
        board.phase(Phase.FORWARD_BACKWARD)
        marks.mark()
        assert read_record(tmp_path / "rank0").marks == 0
        board.phase(Phase.CHECKPOINT_SAVE)
        time.sleep(MARK_GAP_S * 2)  # a mark right after the phase's write is counted, not written
        thread = threading.Thread(target=marks.mark, kwargs={"share": 0.5})
        thread.start()
        thread.join()
        assert read_record(tmp_path / "rank0").marks == 1
    finally:
        marks.publish_to(None)
        board.close()


def test_layers_mark_their_forward_and_backward_and_leave_the_gradients_as_they_are(tmp_path):
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def grads(net):
        net(torch.ones(4, 8)).sum().backward()
        return [p.grad.clone() for p in net.parameters()]

    plain, marked = model(), model()
    board = ProgressBoard(tmp_path, rank=0, local_rank=0)
    clock = StepClock(board)
    clock.mark_layers([marked[0], marked[2]])
    board.phase(Phase.FORWARD_BACKWARD)
    counted = []
    board.mark = lambda *a, **k: counted.append(1)  # every mark, the ones not written included
    assert all(torch.equal(a, b) for a, b in zip(grads(plain), grads(marked), strict=True))
    assert len(counted) == 4  # two forwards, two backwards
    StepClock(ProgressBoard(None, 0, 0)).mark_layers([plain[0]])  # no board: no hook at all
    assert not plain[0]._forward_hooks
    board.close()


@pytest.fixture
def two_fake_ranks():
    """A process group of two ranks whose collectives do nothing (PyTorch's fake group): FSDP issues its
    all-gathers and reduce-scatters as in a real world of two."""
    if dist.is_initialized():
        needs.skip_or_fail("a process group is already initialized in this process")
    dist.init_process_group("fake", store=torch_private.fake_store(), rank=0, world_size=2)
    yield init_device_mesh("cpu", (2,))
    dist.destroy_process_group()


def test_fsdp_collectives_are_on_the_board_and_a_rank_waiting_in_one_shows_it(
    tmp_path, two_fake_ranks, monkeypatch
):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    for module in (net[0], net[2], net):
        fully_shard(module, mesh=two_fake_ranks)
    board = ProgressBoard(tmp_path, rank=0, local_rank=0)
    StepClock(board).publish_collectives([net])
    seen = []
    # the all-gather FSDP calls: all_gather_single from torch 2.14, all_gather_into_tensor before
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    gather = getattr(dist, name)

    def waiting(*args, **kwargs):  # what a rank stuck in this all-gather shows its node's watcher
        seen.append(read_record(tmp_path / "rank0"))
        return gather(*args, **kwargs)

    monkeypatch.setattr(dist, name, waiting)
    board.phase(Phase.FORWARD_BACKWARD)
    net(torch.ones(4, 8)).sum().backward()
    board.step_done(1)
    record = read_record(tmp_path / "rank0")
    # two blocks with parameters: an all-gather each in the forward and the backward, a reduce-scatter each
    assert record.last_step_collectives == 6 and record.collectives_left == 6
    assert record.collective == "fsdp_reduce_scatter" and not record.in_collective
    assert len(seen) == 4 and all(r.in_collective and r.collective == "fsdp_all_gather" for r in seen)
    board.close()


def test_each_graph_compiled_is_a_phase_of_its_own_and_the_board_goes_back(tmp_path):
    board = ProgressBoard(tmp_path, rank=0, local_rank=0)
    clock = StepClock(board)
    torch._dynamo.reset()  # clears Dynamo's callbacks too: watch_compilation registers them again
    clock.watch_compilation()
    seen = []
    phase = board.phase

    def recording(p, budget_s=0.0):
        seen.append(p)
        phase(p, budget_s)

    board.phase = recording
    board.phase(Phase.FORWARD_BACKWARD)
    compiled = torch.compile(lambda x: torch.sin(x) + 1, backend="eager")
    compiled(torch.ones(3))
    assert seen == [Phase.FORWARD_BACKWARD, Phase.COMPILE, Phase.FORWARD_BACKWARD], seen
    assert Phase.COMPILE in read_record(tmp_path / "rank0").medians
    board.close()


def test_a_compilation_marks_progress_at_each_of_its_stages(tmp_path):
    """Issue 53: a graph's compilation moves at each stage (Dynamo's tracing, the backend's passes), not
    only at its start and end, so its limit is the floor: a compile that stops moving is named in it."""
    board = ProgressBoard(tmp_path, rank=0, local_rank=0)
    clock = StepClock(board)
    torch._dynamo.reset()
    clock.watch_compilation()
    in_compile = []
    mark = board.mark

    def recording(*args, **kwargs):
        in_compile.append(board.phase_now is Phase.COMPILE)
        mark(*args, **kwargs)

    board.mark = recording
    board.phase(Phase.FORWARD_BACKWARD)
    torch.compile(lambda x: torch.cos(x) * 2, backend="eager")(torch.ones(3))
    assert sum(in_compile) >= 4 and all(in_compile), in_compile
    assert read_record(tmp_path / "rank0").marks >= 4
    board.close()


def test_the_start_up_publishes_the_rendezvous_before_the_process_group_and_hands_its_board_on(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(PROGRESS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    board = startup.enter(Phase.RENDEZVOUS)
    record = read_record(tmp_path / "rank3")
    assert (record.rank, record.local_rank, record.phase) == (3, 1, Phase.RENDEZVOUS)
    startup.enter(Phase.STARTUP)
    assert startup.take(3, 1) is board and read_record(tmp_path / "rank3").phase is Phase.STARTUP
    assert startup.take(3, 1) is not board  # the next start-up in this process opens its own
    board.close()


def test_each_module_imported_in_the_start_up_marks_progress(tmp_path, monkeypatch):
    monkeypatch.setenv(PROGRESS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    startup.watch_imports()
    try:
        assert read_record(tmp_path / "rank0").phase is Phase.LAUNCH
        time.sleep(MARK_GAP_S * 2)
        import relaytrain.job.i53_no_such_module  # noqa: F401
    except ImportError:
        pass
    finally:
        startup.stop_watching_imports()
    assert read_record(tmp_path / "rank0").marks >= 1
    startup.take(0, 0).close()


def test_the_task_wrapper_opens_the_ranks_board_in_launch_before_the_command_runs(tmp_path):
    """The board exists before the process group, with the command's pid (the wrapper execs it)."""
    job = f"i53test{os.getpid()}"
    read = (
        "import os; from pathlib import Path; from relaytrain.job.progress_read import read_board; "
        "(r,) = read_board(Path(os.environ['RELAYTRAIN_PROGRESS_DIR'])); "
        "print(r.rank, r.local_rank, r.phase.label, r.pid == os.getpid())"
    )
    env = child_env(SLURM_JOB_ID=job, SLURM_STEP_ID="0", SLURM_PROCID="5", SLURM_LOCALID="1")
    cmd = [sys.executable, "-m", "relaytrain.job.task", "--map-env", "--hang-watch", str(tmp_path), "--",
           sys.executable]  # fmt: skip
    done = subprocess.run([*cmd, "-c", read], env=env, capture_output=True, text=True, timeout=120)
    try:
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["5", "1", "launch", "True"], done.stdout
    finally:
        for root in ("/dev/shm", "/tmp"):
            folder = f"{root}/relaytrain-progress-{job}.0"
            if os.path.isdir(folder):
                for name in os.listdir(folder):
                    os.unlink(os.path.join(folder, name))
                os.rmdir(folder)
