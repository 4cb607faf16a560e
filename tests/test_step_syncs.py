"""Host synchronisations of the training loop (issue: the CPU must be able to run ahead of the GPU).

On a GPU every read of a device tensor (``.item()``, ``.tolist()``, ``bool()``, ``float()``) and every
``torch.cuda.synchronize()`` makes the host wait for the device. A step that is not logged does one: the
stop agreement's read, which carries the NaN guard's flag. The timer's CUDA path records events instead
of synchronising; its window (at log steps) synchronises once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from relaytrain.config.loader import load_config
from relaytrain.job.clock import StepClock
from relaytrain.job.progress import Phase
from relaytrain.monitor import timer as timer_mod
from relaytrain.monitor.timer import StepTimer

from conftest import TINY

SRC = str(Path(timer_mod.__file__).resolve().parents[1])  # relaytrain's own source files
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu")


class SyncCounter:
    """Counts device reads made by relaytrain's own code (torch's internals are not ours to change;
    on a GPU, the optimizer's `.item()` reads a CPU step counter) and every cuda.synchronize."""

    def __init__(self, monkeypatch):
        self.count = 0
        self.where: list[str] = []
        for name in READS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(original))
        monkeypatch.setattr(torch.cuda, "synchronize", self._count_sync)

    def _note(self, frame) -> None:
        self.count += 1
        self.where.append(f"{frame.f_code.co_filename}:{frame.f_lineno}")

    def _wrap(self, original):
        def read(tensor, *args, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(SRC):
                self._note(frame)
            return original(tensor, *args, **kwargs)

        return read

    def _count_sync(self, *args, **kwargs) -> None:
        self._note(sys._getframe(1))


def _reads_in_a_run(tmp_path: Path, monkeypatch, steps: int) -> SyncCounter:
    from relaytrain.parallel.distributed import init_distributed
    from relaytrain.trainer import Trainer, prepare_run_dir

    cfg = load_config(
        None,
        [
            *TINY,
            f"--run.dir={tmp_path}",
            f"--run.name=steps{steps}",
            f"--train.max_steps={steps}",
            "--metrics.log_every=1000",  # logged: step 1 and the last step only
            "--train.eval_every=0",
            "--checkpoint.enabled=false",
            "--metrics.peak_flops=1e12",  # no CPU peak measurement at start
        ],
    )
    env = init_distributed(cfg)
    prepare_run_dir(cfg, env.is_main)
    trainer = Trainer(cfg, env)
    with monkeypatch.context() as patch:
        counter = SyncCounter(patch)
        assert trainer.run() == 0
    return counter


def test_a_step_that_is_not_logged_reads_the_device_once(tmp_path, monkeypatch):
    short = _reads_in_a_run(tmp_path, monkeypatch, 3)
    long = _reads_in_a_run(tmp_path, monkeypatch, 9)
    # The same start, end and two logged steps: the difference is six steps that are not logged.
    per_step = (long.count - short.count) / 6
    assert per_step == 1, f"{per_step} host reads per step that is not logged; the reads: {long.where}"


class FakeEvent:
    """torch.cuda.Event on CPU: a recorded clock."""

    clock = [0.0]

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.t: float | None = None

    def record(self, stream=None) -> None:
        self.t = FakeEvent.clock[0]

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.t - self.t) * 1000.0


def test_cuda_timer_records_events_and_waits_once_per_window(monkeypatch):
    syncs: list[int] = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    monkeypatch.setattr(timer_mod.time, "perf_counter", lambda: FakeEvent.clock[0])
    steps = StepClock(device=torch.device("cuda"))
    timer = StepTimer(torch.device("cuda"))
    steps.add_reader(timer)
    for _ in range(3):
        for phase, seconds in ((Phase.DATA, 0.25), (Phase.FORWARD_BACKWARD, 2.0), (Phase.OPTIMIZER, 1.0)):
            with steps.section(phase):
                FakeEvent.clock[0] += seconds
    assert syncs == [], "a section waited for the device"
    window = timer.window()
    assert len(syncs) == 1
    assert window["data"] == pytest.approx(0.25) and window["forward_backward"] == pytest.approx(2.0)
    assert window["optimizer"] == pytest.approx(1.0) and window["step"] == pytest.approx(3.25)
    assert timer.window()["forward_backward"] == 0.0  # the events were read once, into their window
