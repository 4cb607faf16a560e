"""The rank's side of straggler detection: read its own work every step, compare every few steps.

A reader of the rank's step clock (``job/clock.py``): the clock hands it the work the rank does alone,
by the section it was done in (``PHASE_NAMES``: the data section, the forward of the modules with no
collective inside, the optimizer's update), as host seconds on CPU or as pairs of CUDA events on GPU (no
wait for the device: a window reads only the steps whose events have all completed, the rest count in the
next window). A phase timed in parts (a forward per layer and micro batch) is one time per step, their
sum. Every ``resilience.straggler_every`` steps every rank all-gathers its window's
medians (recorded, and judged as the typical step) and fastest times per phase (recorded, and judged;
``straggler.py`` says why) in one small tensor (the named collective ``straggler_times`` on the progress
board) and feeds the same matrix to its ``StragglerJudge``: every rank reaches the same verdict at the
same step. Rank 0 logs the ``straggler:`` line and the ``straggler`` event; a verdict to replace or drop
the node is kept (``verdict``), and the supervision front (``supervision.py``) stops every rank after the
next snapshot or checkpoint.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from relaytrain.config.schema import ResilienceConfig
from relaytrain.job import JobFacts
from relaytrain.job.clock import Span
from relaytrain.job.progress import Phase, ProgressBoard
from relaytrain.resilience.rank.straggler import (
    PHASES,
    Straggler,
    StragglerJudge,
    choose_action,
    phase_floor,
)

log = logging.getLogger("relaytrain")
# The step clock's sections whose alone work is each of the judge's phases (``straggler.PHASES``)
PHASE_NAMES = {Phase.DATA: "data", Phase.FORWARD_BACKWARD: "forward", Phase.OPTIMIZER: "optimizer"}


class Metrics(Protocol):
    """Where rank 0's straggler events and per-rank times go (monitor.MetricsLogger)."""

    def log_event(self, event: str, step: int, **fields: Any) -> None: ...

    def log_rank_times(self, step: int, values: dict[str, Any]) -> None: ...


class Ranks(Protocol):
    """This process's place in the job (parallel.DistEnv)."""

    rank: int
    world_size: int
    device: torch.device
    node: str
    num_nodes: int


class StragglerWatch:
    """One rank's windows of alone work and its judge. Off (``enabled`` False: the clock is not to feed it)
    with ``straggler_threshold`` 0 or when no rank has a peer doing the same work.

    ``min_nodes``: slurm.min_nodes (0: the node count is fixed); ``metrics``: where rank 0's events and
    per-rank times go; ``stages``: each rank's pipeline stage (``ParallelDims.pipeline_stages``; None: one
    stage), as a rank is compared with the ranks of its own stage only."""

    def __init__(
        self,
        resilience: ResilienceConfig,
        env: Ranks,
        board: ProgressBoard,
        metrics: Metrics,
        min_nodes: int,
        stages: Sequence[int] | None = None,
    ):
        stages = list(stages) if stages is not None else [0] * env.world_size
        self.enabled = resilience.straggler_threshold > 0 and len(set(stages)) < env.world_size
        # recorded with the times under a pipeline: part of the judge's input there
        self._stages = stages if len(set(stages)) > 1 else None
        self.every, self.action = resilience.straggler_every, resilience.straggler_action
        self.rank, self.world_size, self.device = env.rank, env.world_size, torch.device(env.device)
        self.node, self.nodes, self.min_nodes, self.board = env.node, env.num_nodes, min_nodes, board
        self.report, self.record = metrics.log_event, metrics.log_rank_times
        self.judge = StragglerJudge(
            resilience.straggler_threshold,
            resilience.straggler_windows,
            resilience.straggler_windows_over,
            min_phase_s=phase_floor(self.device.type),
            peers=stages,
        )
        self._times: dict[str, list[float]] = {p: [] for p in PHASES}  # the window's steps: seconds per step
        self._step_spans: list[Span] = []  # the step's alone work so far (a phase may come in parts: one
        # forward per layer and micro batch)
        self._pending: list[list[Span]] = []  # steps whose spans may still be queued on the device
        self._steps: list[float] = []
        self._window_start = 1
        self._node_names: list[str] | None = None
        self.verdict: dict[str, Any] | None = None  # the straggler fields of a stop to act on, once due

    def alone(self, span: Span) -> None:
        """The step clock: a piece of this step's alone work."""
        if span.phase in PHASE_NAMES:
            self._step_spans.append(span)

    def step_done(self, step: int, seconds: float | None = None) -> None:
        """The step clock, after every step, on every rank (``seconds``: the step's wall time, None for the
        process's first): at a window's end, gather, judge and report."""
        if not self.enabled:
            return
        self._pending.append(self._step_spans)
        self._step_spans = []
        if seconds is not None:
            self._steps.append(seconds)
        if step % self.every:
            return
        self._resolve_events()
        recorded = [_median(self._times[p]) for p in PHASES] + [_median(self._steps)]
        matrix = self._gather(recorded + [min(self._times[p], default=0.0) for p in PHASES])  # RECORD_COLUMNS
        first = self._window_start
        self._window_start = step + 1
        self._times = {p: [] for p in PHASES}
        self._steps = []
        if self.rank == 0:
            self.record(step, _times_record(matrix, self._stages))
        judged = judged_times(matrix)
        if judged is None:
            return
        named, cleared = self.judge.feed(first, *judged)
        if named is not None:
            self._named(named, step)
        if cleared is not None and self.rank == 0:
            node = self._node(cleared.rank)
            log.info("straggler cleared: rank %d on %s at step %d", cleared.rank, node, step)
            self.report("straggler_cleared", step, rank=cleared.rank, node=node)

    def _named(self, straggler: Straggler, step: int) -> None:
        names = self._all_node_names()  # a collective: every rank reaches this with the same verdict
        node = names[straggler.rank]
        facts = JobFacts.from_env()
        action, why = choose_action(self.action, straggler, facts.spare_nodes, self.nodes, self.min_nodes)
        fields = {
            "rank": straggler.rank,
            "node": node,
            "phase": straggler.phase,
            "slower": round(straggler.slower, 4),
            "since_step": straggler.since_step,
            "action": action,
        }
        if action != "report":
            self.verdict = fields
        if self.rank == 0:
            log.warning(
                "straggler: rank %d on %s %.0f%% slower in %s since step %d (at step %d; action %s: %s)",
                straggler.rank,
                node,
                100 * straggler.slower,
                straggler.phase,
                straggler.since_step,
                step,
                action,
                why,
            )
            self.report("straggler", step, **fields, why=why)

    def _node(self, rank: int) -> str:
        return self._node_names[rank] if self._node_names else "?"

    def _all_node_names(self) -> list[str]:
        if self._node_names is None:
            names: list[Any] = [None] * self.world_size
            with self.board.collective("straggler_nodes"):
                dist.all_gather_object(names, self.node)
            self._node_names = [str(n) for n in names]
        return self._node_names

    def _resolve_events(self) -> None:
        """The steps whose spans have all completed (on CUDA: their events) into the window's times, seconds
        per phase and step; a step with events still queued on the device waits for the next window."""
        waiting = []
        for spans in self._pending:
            if not all(span.completed() for span in spans):
                waiting.append(spans)
                continue
            step: dict[str, float] = {}
            for span in spans:
                name = PHASE_NAMES[span.phase]
                step[name] = step.get(name, 0.0) + span.seconds()
            for phase, seconds in step.items():
                self._times[phase].append(seconds)
        self._pending = waiting

    def _gather(self, mine: list[float]) -> list[list[float]]:
        local = torch.tensor(mine, dtype=torch.float64, device=self.device)
        out = torch.empty(self.world_size * len(mine), dtype=torch.float64, device=self.device)
        with self.board.collective("straggler_times"):
            dist.all_gather_into_tensor(out, local)
            return out.view(self.world_size, len(mine)).tolist()  # the window's one host read


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


# the gathered row's columns, by their `rank_times` names: the medians, the step's median, the fastest
RECORD_COLUMNS = (*PHASES, "step", *(f"{phase}_fastest" for phase in PHASES))


def judged_times(matrix: list[list[float]]) -> tuple[list[list[float]], list[list[float]]] | None:
    """What the judge is fed of a window's gathered rows (``RECORD_COLUMNS``): (the fastest, the median)
    seconds per rank and phase; None for a window with no whole step on some rank (the first after a
    start): nothing to compare."""
    steps_column = len(PHASES)  # after the phases' medians; the fastest times follow it
    if any(row[steps_column] <= 0 for row in matrix):
        return None
    return [row[steps_column + 1 :] for row in matrix], [row[:steps_column] for row in matrix]


def _times_record(matrix: list[list[float]], stages: list[int] | None = None) -> dict[str, Any]:
    """The `rank_times` record: each rank's median seconds per phase and per step over the window
    (``rank<R>_<phase>_s``) and its fastest seconds per phase (``rank<R>_<phase>_fastest_s``: what the
    judge compares); under pipeline parallelism each rank's stage (``stages``: a rank is compared with
    those of its stage)."""
    out: dict[str, Any] = {} if stages is None else {"stages": list(stages)}
    for rank, row in enumerate(matrix):
        for column, value in zip(RECORD_COLUMNS, row, strict=True):
            out[f"rank{rank}_{column}_s"] = value
    return out
