"""Split training steps into data wait, forward+backward, optimizer and checkpoint time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

SECTIONS = ("data", "forward_backward", "optimizer", "checkpoint")


class StepTimer:
    """Accumulates section times over a logging window.

    Usage::

        timer = StepTimer(device)
        with timer.section("data"): batch = next(it)          # each step starts with its data
        with timer.section("forward_backward"): loss.backward()
        with timer.section("optimizer"): opt.step()
        with timer.section("checkpoint"): manager.save(...)
        ...
        record |= {f"time_{k}_s": v for k, v in timer.window().items()}

    A step is counted each time the ``data`` section starts. ``window()`` returns per-step means
    since the previous call and starts a new window. On CPU a section is wall-clock time. On CUDA no
    section waits for the device (the CPU keeps running ahead of the GPU): each section records a pair
    of CUDA events on the current stream, and ``window()`` (called at log steps only) synchronizes
    once and reads their elapsed times, so kernel time is charged to the section that launched it.
    """

    def __init__(self, device: torch.device | None = None):
        self._events = device is not None and torch.device(device).type == "cuda"
        self._pending: list[tuple[str, object, object]] = []  # (section, start event, end event)
        self._reset(None)  # the first window starts at the first section, not at construction

    def _reset(self, now: float | None) -> None:
        self._totals = dict.fromkeys(SECTIONS, 0.0)
        self._excluded = 0.0
        self._steps = 0
        self._window_start = now

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        if name not in self._totals:
            raise ValueError(f"unknown step section {name!r}; expected one of {SECTIONS}")
        start = time.perf_counter()
        if self._window_start is None:
            self._window_start = start
        if name == "data":
            self._steps += 1
        begin = self._record() if self._events else None
        try:
            yield
        finally:
            if begin is not None:
                self._pending.append((name, begin, self._record()))
            else:
                self._totals[name] += time.perf_counter() - start

    @staticmethod
    def _record():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def synchronize(self) -> None:
        """Wait for the device (CUDA only): at a log step, before wall-clock figures are read."""
        if self._events:
            torch.cuda.synchronize()

    @contextmanager
    def excluded(self) -> Iterator[None]:
        """Wall time spent inside (evaluation, say) is left out of the step time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._window_start is not None:
                self._excluded += time.perf_counter() - start

    def window(self) -> dict[str, float]:
        """Per-step mean seconds since the last call: one key per section, ``other`` (time in no
        section) and ``step`` (wall time per step, the basis of tokens/s)."""
        self.synchronize()  # the one wait of a window, on CUDA: every event below has completed
        for name, begin, end in self._pending:
            self._totals[name] += begin.elapsed_time(end) / 1000.0  # milliseconds
        self._pending = []
        now = time.perf_counter()
        steps = max(self._steps, 1)
        sectioned = sum(self._totals.values())
        wall = sectioned if self._window_start is None else now - self._window_start - self._excluded
        out = {name: total / steps for name, total in self._totals.items()}
        out["step"] = max(wall, sectioned) / steps
        out["other"] = out["step"] - sectioned / steps
        self._reset(now)
        return out
