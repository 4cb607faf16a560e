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
    since the previous call and starts a new window. On CUDA each section ends with a device
    synchronize so that kernel time is charged to the section that launched it rather than to
    whichever later call waits for it.
    """

    def __init__(self, device: torch.device | None = None):
        self._sync = device is not None and device.type == "cuda"
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
        try:
            yield
        finally:
            if self._sync:
                torch.cuda.synchronize()
            self._totals[name] += time.perf_counter() - start

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
        now = time.perf_counter()
        steps = max(self._steps, 1)
        sectioned = sum(self._totals.values())
        wall = sectioned if self._window_start is None else now - self._window_start - self._excluded
        out = {name: total / steps for name, total in self._totals.items()}
        out["step"] = max(wall, sectioned) / steps
        out["other"] = out["step"] - sectioned / steps
        self._reset(now)
        return out
