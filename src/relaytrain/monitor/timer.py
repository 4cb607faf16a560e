"""The metrics' phase times: a step split into data wait, forward+backward, optimizer and checkpoint time."""

from __future__ import annotations

import time

import torch

from relaytrain.job.clock import Span
from relaytrain.job.progress import Phase

SECTIONS = ("data", "forward_backward", "optimizer", "checkpoint")
# The step clock's phases (job/clock.py) under the names of the metrics record (``time_<name>_s``); an
# evaluation is left out of the step time, a phase not named here (a NaN rollback's load) is "other".
SECTION_OF = {
    Phase.DATA: "data",
    Phase.FORWARD_BACKWARD: "forward_backward",
    Phase.OPTIMIZER: "optimizer",
    Phase.CHECKPOINT_SAVE: "checkpoint",
    Phase.SNAPSHOT: "checkpoint",
}
EXCLUDED = frozenset({Phase.EVALUATION})


class StepTimer:
    """A reader of the step clock (``StepClock.add_reader``): accumulates its sections over a logging
    window. ``window()`` returns per-step means since the previous call and starts a new window::

        record |= {f"time_{k}_s": v for k, v in timer.window().items()}

    A step is counted each time a ``data`` section starts; the first window starts at the first one
    (sections before it, a restore or an initial save, are start-up). On CPU a section is its host
    seconds. On CUDA its events are read by ``window()`` (called at log steps only), which synchronizes
    once: kernel time is charged to the section that launched it.
    """

    def __init__(self, device: torch.device | None = None):
        self._events = device is not None and torch.device(device).type == "cuda"
        self._pending: list[tuple[str, Span]] = []
        self.wall_s = 0.0  # the last window's wall seconds, evaluations left out (the basis of tokens/s)
        self._reset(None)

    def _reset(self, now: float | None) -> None:
        self._totals = dict.fromkeys(SECTIONS, 0.0)
        self._excluded = 0.0
        self._steps = 0
        self._window_start = now

    def section(self, span: Span) -> None:
        if span.phase is Phase.DATA:
            if self._window_start is None:
                self._window_start = span.started
            self._steps += 1
        if self._window_start is None:
            return
        if span.phase in EXCLUDED:
            self._excluded += span.host_s
            return
        name = SECTION_OF.get(span.phase)
        if name is None:
            return
        if span.begin is not None:
            self._pending.append((name, span))
        else:
            self._totals[name] += span.host_s

    def synchronize(self) -> None:
        """Wait for the device (CUDA only): at a log step, before wall-clock figures are read."""
        if self._events:
            torch.cuda.synchronize()

    def window(self) -> dict[str, float]:
        """Per-step mean seconds since the last call: one key per section, ``other`` (time in no
        section) and ``step`` (wall time per step, evaluations left out)."""
        self.synchronize()  # the one wait of a window, on CUDA: every event below has completed
        for name, span in self._pending:
            self._totals[name] += span.seconds()
        self._pending = []
        now = time.perf_counter()
        steps = max(self._steps, 1)
        sectioned = sum(self._totals.values())
        wall = sectioned if self._window_start is None else now - self._window_start - self._excluded
        out = {name: total / steps for name, total in self._totals.items()}
        self.wall_s = max(wall, sectioned)
        out["step"] = self.wall_s / steps
        out["other"] = out["step"] - sectioned / steps
        self._reset(now)
        return out
