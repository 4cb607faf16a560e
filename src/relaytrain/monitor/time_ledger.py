"""The trainer's side of the time ledger (monitor/ledger.py): its ``ledger`` windows in metrics.jsonl.

A window runs from the end of the previous one (the first: the end of restoring) to a log step, a stop
or the end of the loop; the process's first step is a window of its own, marked ``first_step`` (its
time beyond a typical step, compilation and first allocations, is start-up to the ledger). Each records,
on rank 0, the steps it covers and its seconds split into what the persistence front blocked or slowed
(checkpoint saves and snapshots' blocking copies: their sections on the rank's step clock,
``job/clock.py``; steps slowed by a snapshot's background work: `Persistence.snapshot_slowdown_s`) and
evaluation (its sections on the clock); the rest of the window is step time.
Each window also carries ``goodput``, the run's goodput as its records tell so far (earlier allocations
bounded by their own records, this process from its start to now), which TensorBoard shows as
``ledger/goodput``; `relaytrain status` gives the exact figure with Slurm's allocation times.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from relaytrain.errors import UserError
from relaytrain.job import RunDir
from relaytrain.job.clock import StepClock
from relaytrain.job.progress import Phase
from relaytrain.monitor.history import read_records
from relaytrain.monitor.ledger import WINDOW_PARTS
from relaytrain.monitor.ledger_spans import build_ledger
from relaytrain.monitor.metrics import MetricsLogger

# The window's parts the step clock times, by phase (WINDOW_PARTS: these and the snapshots' slowdown)
PART_OF = {Phase.CHECKPOINT_SAVE: "checkpoint", Phase.SNAPSHOT: "snapshot", Phase.EVALUATION: "eval"}


class LedgerWindows:
    """`begin` once the state is restored, `close_window` at every log step, before a stop's save and at
    the end of the loop. ``steps``: the rank's step clock; ``slowdown``: seconds steps ran slower so far
    while a snapshot's background work ran."""

    def __init__(
        self,
        metrics: MetricsLogger,
        run: RunDir,
        steps: StepClock,
        slowdown: Callable[[], float],
        process_start: float,
        clock: Callable[[], float] = time.time,
    ):
        self.metrics, self.run, self.steps, self.slowdown = metrics, run, steps, slowdown
        self.clock = clock
        self.process_start = process_start
        self.since = 0.0
        self.from_step = 1
        self._base: dict[str, float] = {}
        self._prior_productive = self._prior_allocated = 0.0
        self._high_water = 0
        self._productive = 0.0
        self._first_step: int | None = None  # the first step this process runs, until its window closed

    def begin(self, step: int, restore_start: float, restored_from: str) -> dict[str, Any]:
        """Windows start now, after `step` (the state is restored). Returns the start event's fields for
        the ledger's start-up and restore spans."""
        earlier = self._earlier_records()
        if earlier:  # the running goodput starts from what the run's earlier allocations recorded
            ledger = build_ledger(earlier)
            self._prior_productive = ledger.buckets["productive"]
            self._prior_allocated = ledger.allocated_s
            steps = [int(r["step"]) for r in earlier if r.get("kind") == "ledger"]
            self._high_water = max(steps, default=0)
        self._open(step)
        self._first_step = step + 1
        return {
            "process_start": round(self.process_start, 4),
            "restore_start": round(restore_start, 4),
            "restored_from": restored_from,
        }

    def _earlier_records(self) -> Sequence[dict[str, Any]]:
        """The run's metrics.jsonl before this process (rank 0; none elsewhere or when unreadable)."""
        if not self.metrics.is_main or not self.run.metrics.is_file():
            return ()
        try:
            return read_records(self.run.metrics)[0]
        except (UserError, OSError):
            return ()

    def due(self, step: int, log_every: int) -> bool:
        """Whether a window closes after `step`: at log steps, and after the process's first step."""
        return step % log_every == 0 or step == self._first_step

    def spent(self) -> dict[str, float]:
        """Seconds so far in this process, per window part (``WINDOW_PARTS``)."""
        parts = dict.fromkeys(WINDOW_PARTS, 0.0)
        for phase, seconds in self.steps.seconds().items():
            if phase in PART_OF:
                parts[PART_OF[phase]] += seconds
        parts["snapshot_slowdown"] = self.slowdown()
        return parts

    def close_window(self, step: int) -> None:
        """Record the window up to now (steps ``from_step``..``step``) and open the next one."""
        if step < self.from_step:
            return  # no step ran since the last window: its time belongs to what comes next
        now, spent = self.clock(), self.spent()
        seconds = {name: max(0.0, spent.get(name, 0.0) - self._base.get(name, 0.0)) for name in WINDOW_PARTS}
        steps = max(0.0, (now - self.since) - sum(seconds.values()))
        count = step - self.from_step + 1
        replays = min(count, max(0, self._high_water - self.from_step + 1))
        self._productive += steps * (count - replays) / count
        self._high_water = max(self._high_water, step)
        allocated = self._prior_allocated + (now - self.process_start)
        goodput = (self._prior_productive + self._productive) / allocated if allocated > 0 else 0.0
        window = {"from_step": self.from_step, "since": round(self.since, 4), "until": round(now, 4)}
        if self._first_step is not None:
            window["first_step"] = True
            self._first_step = None
        rounded = {name: round(value, 4) for name, value in seconds.items()}
        self.metrics.log_ledger(step, {"window": window, "seconds": rounded, "goodput": round(goodput, 5)})
        self._open(step, now, spent)  # windows meet: writing this record is the next window's time

    def _open(self, step: int, now: float | None = None, spent: dict[str, float] | None = None) -> None:
        self.since, self.from_step = self.clock() if now is None else now, step + 1
        self._base = dict(self.spent() if spent is None else spent)
