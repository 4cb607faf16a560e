"""One rank's step clock: the one timer of a step's phases, in the progress board's vocabulary (`Phase`).

The loop enters each section of a step once (``section(Phase.DATA)``, ...), and so does the persistence
front for its loads, saves and snapshots. A section is timed once: by the host's clock always, and on
CUDA also by a pair of events on the current stream (no wait for the device: kernel time is charged to
the section that launched it). The clock hands each timed section to its readers, which do not time
anything themselves:

- the progress board (``job/progress.py``): the phase a section enters, published as it begins (the
  step's sections from the second step on: the first step is published as one phase, ``FIRST_STEP``),
  with the section's budget (a save's estimate); and the progress inside a phase (``mark``): each layer's
  forward and backward (``mark_layers``), FSDP's all-gathers and reduce-scatters and tensor
  parallelism's redistributions as collectives (``publish_collectives``), each graph Dynamo compiles
  (published as ``COMPILE``, then back to the phase it interrupted: ``watch_compilation``), and whatever
  else marks (an evaluation batch, a shard read or written by the checkpoint's files);
- the metrics' phase times (``monitor/timer.py`` ``StepTimer``);
- the straggler windows (``resilience/rank/straggler_watch.py``), which read the work a rank does alone:
  a section entered ``alone`` (its data), the part of a section under ``alone()`` (its optimizer
  update) and the forward of the modules ``time_alone`` hooks (no collective inside);
- the time ledger (``monitor/time_ledger.py``), which reads ``seconds()``: host seconds per phase so far
  in this process (saves, snapshots, restores, evaluations).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed.fsdp import FSDPModule

from relaytrain import torch_private
from relaytrain.job.progress import Phase, ProgressBoard
from relaytrain.torch_private import compiler as compiler_hooks

# The sections of a training step: published from the process's second step on (see above)
STEP_PHASES = frozenset({Phase.DATA, Phase.FORWARD_BACKWARD, Phase.OPTIMIZER})
# A section entered from one of these goes back to it when it ends: they span what runs inside them
# (a restore during start-up, the save of a stop). After a section of the loop the board stays on the
# section until the loop enters the next one (going back would add a short second piece to the median).
_SPANNING = (Phase.STARTUP, Phase.STOP, Phase.FIRST_STEP)
# The clock whose board a graph's compilation is published on (Dynamo's callbacks are the process's)
_compiling: list[StepClock] = []


@dataclass(frozen=True)
class Span:
    """One timed section or piece of alone work: where it began on the host's clock (perf_counter), its
    host seconds, and on CUDA its start and end events (None elsewhere: the host's seconds are its time)."""

    phase: Phase
    started: float
    host_s: float
    begin: Any = None
    end: Any = None

    def seconds(self) -> float:
        """The span's time: the events' elapsed time on CUDA (they must have completed), else the host's."""
        if self.begin is None:
            return self.host_s
        return self.begin.elapsed_time(self.end) / 1000.0  # milliseconds

    def completed(self) -> bool:
        return self.end is None or bool(self.end.query())


class Reader(Protocol):
    """What the clock tells a reader; a reader implements the ones it needs (see ``add_reader``)."""

    def section(self, span: Span) -> None: ...


class StepClock:
    """One rank's clock. ``board``: the rank's progress board (None: none published); ``device``: the
    rank's device (CUDA: sections also timed by events)."""

    def __init__(self, board: ProgressBoard | None = None, device: torch.device | str | None = None):
        self.board = board if board is not None else ProgressBoard(None, 0, 0)
        self._events = device is not None and torch.device(device).type == "cuda"
        self._sections: list[Any] = []  # readers of whole sections
        self._alone: list[Any] = []  # readers of the work a rank does alone
        self._steps: list[Any] = []  # readers told when a step finished
        self._stepped = False  # a step finished in this process: the step's sections are published
        self._seconds: dict[Phase, float] = {}
        self._current: Phase | None = None  # the section under way (for `alone`)
        self._forward_begun: list[tuple[float, Any]] = []
        self._last_step_end: float | None = None

    def add_reader(self, reader: Any) -> None:
        """``reader.section(span)`` for each section, ``reader.alone(span)`` for each piece of alone work,
        ``reader.step_done(step, seconds)`` after each step: whichever of them it has."""
        for method, readers in (
            ("section", self._sections),
            ("alone", self._alone),
            ("step_done", self._steps),
        ):
            if callable(getattr(reader, method, None)):
                readers.append(getattr(reader, method))

    @property
    def phase_now(self) -> Phase:
        return self.board.phase_now

    def enter(self, phase: Phase) -> None:
        """Publish ``phase`` with no section timed (the stop, which lasts until the process leaves)."""
        self.board.phase(phase)

    @contextlib.contextmanager
    def section(self, phase: Phase, budget_s: float = 0.0, alone: bool = False) -> Iterator[None]:
        """Time the block as ``phase``, published on the board while it runs; ``alone``: the whole section
        is work the rank does by itself (its data), read as such by the straggler windows."""
        before = self.board.phase_now
        published = self._stepped or phase not in STEP_PHASES
        if published:
            self.board.phase(phase, budget_s=budget_s)
        elif before is not Phase.FIRST_STEP and before is not Phase.COMPILE:
            self.board.phase(Phase.FIRST_STEP)
        outer, self._current = self._current, phase
        started, begin = self._begin()
        try:
            yield
        finally:
            span = self._span(phase, started, begin)
            self._current = outer
            self._seconds[phase] = self._seconds.get(phase, 0.0) + span.host_s
            for read in self._sections:
                read(span)
            if alone:
                for read in self._alone:
                    read(span)
        if published and before in _SPANNING:
            self.board.phase(before)

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """Time the block as work this rank does alone in the section under way (its optimizer update)."""
        if not self._alone or self._current is None:
            yield
            return
        phase = self._current
        started, begin = self._begin()
        yield
        span = self._span(phase, started, begin)
        for read in self._alone:
            read(span)

    def time_alone(self, modules: Sequence[torch.nn.Module], compiled: bool = False) -> None:
        """Time the forward of each of ``modules`` (``ParallelModel.work_modules``: a rank's own computation,
        no collective inside) as alone work of the forward/backward section, recomputations under
        activation checkpointing included; forwards without gradients (the evaluation's) are left out.
        The clock starts after the module's own pre-hooks and stops before its own forward hooks: tensor
        parallelism redistributes a module's input and output there (an all-gather before, a
        reduce-scatter after), and a rank that waits in them for a slower peer would look as slow.
        ``compiled``: the modules are compiled blocks, whose hooks Dynamo must run eagerly, not trace."""
        begin, end = self._forward_begin, self._forward_end
        if compiled:
            begin, end = torch.compiler.disable(begin), torch.compiler.disable(end)
        for module in modules:
            module.register_forward_pre_hook(begin)
            module.register_forward_hook(end, prepend=True)

    def _forward_begin(self, _module: torch.nn.Module, _args: Any) -> None:
        if torch.is_grad_enabled():
            self._forward_begun.append(self._begin())

    def _forward_end(self, _module: torch.nn.Module, _args: Any, _output: Any) -> None:
        if torch.is_grad_enabled() and self._forward_begun:
            span = self._span(Phase.FORWARD_BACKWARD, *self._forward_begun.pop())
            for read in self._alone:
                read(span)

    def mark(self, budget_s: float | None = None) -> None:
        """Progress inside the phase under way (an evaluation batch, a shard read or written)."""
        self.board.mark(budget_s)

    def mark_layers(self, modules: Sequence[torch.nn.Module], compiled: bool = False) -> None:
        """Mark progress after each of ``modules``' forward (every micro batch's, a recomputation's) and
        when its output's gradient is computed (its backward); the gradient is left as it is. Only on a
        board that publishes. ``compiled``: the modules are compiled blocks (hooks run eagerly)."""
        if not self.board.enabled:
            return
        hook = torch.compiler.disable(self._layer_done) if compiled else self._layer_done
        for module in modules:
            module.register_forward_hook(hook)

    def _layer_done(self, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        self.board.mark()
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._gradient_done)

    def _gradient_done(self, _grad: torch.Tensor) -> None:
        self.board.mark()  # returns None: the gradient flows on unchanged

    def publish_collectives(self, parts: Sequence[torch.nn.Module], redistributions: bool = False) -> None:
        """Publish FSDP's all-gathers and reduce-scatters of ``parts``' sharded modules on the board as
        collectives (``fsdp_all_gather``, ``fsdp_reduce_scatter``: entered, then left), so a hang inside one
        names the rank that is not in it; with ``redistributions`` (tensor parallelism, not compiled: a
        compiled block traces its redistributions) DTensor's redistributions too (``dtensor_redistribute``:
        tensor parallelism's collectives, forward and backward). On CPU (gloo) a call returns when the
        collective is done; on CUDA (NCCL) when it is queued, so there the board shows the call, not the
        wait. Only on a board that publishes."""
        if not self.board.enabled:
            return
        if redistributions:
            torch_private.publish_dtensor_redistributions(self.board.collective)
        gather, scatter = torch_private.published_fsdp_comms(self.board.collective)
        for part in parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.set_custom_all_gather(gather)
                    module.set_custom_reduce_scatter(scatter)

    def watch_compilation(self) -> None:
        """Publish each graph Dynamo compiles as ``COMPILE`` (a graph begun, a graph done: two moves), with a
        progress mark at each start and end of its stages (tracing, each Inductor pass, each kernel file
        compiled: about a second apart at most), then go back to the phase it interrupted. The latest
        clock of the process is the one told."""
        if not self.board.enabled:
            return
        compiler_hooks.on_dynamo_compile(_compile_start, _compile_end)
        compiler_hooks.on_compile_stage(_compile_moved)
        _compiling[:] = [self]
        self._interrupted: Phase | None = None

    def step_done(self, step: int) -> None:
        """A step finished: the board counts it (and shows the time after it), the readers close it, each
        told the step's wall seconds since the previous step's readers were done (None for this process's
        first step): what a reader does here (a straggler window's all-gather) is no step's time."""
        seconds = None if self._last_step_end is None else time.perf_counter() - self._last_step_end
        self.board.step_done(step)
        self._stepped = True
        for done in self._steps:
            done(step, seconds)
        self._last_step_end = time.perf_counter()

    def seconds(self) -> dict[Phase, float]:
        """Host seconds spent in each phase's sections so far in this process."""
        return dict(self._seconds)

    def _begin(self) -> tuple[float, Any]:
        begin = None
        if self._events:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
        return time.perf_counter(), begin

    def _span(self, phase: Phase, started: float, begin: Any) -> Span:
        end = None
        if begin is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        return Span(phase, started, time.perf_counter() - started, begin, end)


def _compile_start(_args: Any = None) -> None:
    clock = _compiling[0]
    if clock.board.phase_now is Phase.COMPILE:
        clock.board.mark()
        return
    clock._interrupted = clock.board.phase_now
    clock.board.phase(Phase.COMPILE)


def _compile_moved() -> None:
    """A stage of a compilation began or ended: progress, while the board shows the compilation."""
    board = _compiling[0].board
    if board.phase_now is Phase.COMPILE:
        board.mark()


def _compile_end(_args: Any = None) -> None:
    clock = _compiling[0]
    if clock._interrupted is not None and clock.board.phase_now is Phase.COMPILE:
        clock.board.phase(clock._interrupted)
        clock._interrupted = None
