"""When the persistence front takes a snapshot, and what each one cost: `checkpoint.snapshot_every` steps,
or, with `snapshot_every = "auto"`, the interval `interval.py` chooses from measured figures.

The pacing times each step between the front's `after_step` calls (the loop's own work: the front's saves
and snapshots are left out) and notes whether a snapshot's background work was running when it began.
The step time is the median of the recent steps; a step that overlapped adds what it took beyond the
median clean step (none running) to the snapshot's slowdown, but never more than the time the background
work ran during that step (its overlap): work that runs for o seconds beside a step can delay it by at
most o (it takes the step's processors, its memory bandwidth or the interpreter's lock for at most as
long as it runs), so the rest of a longer step is another cause, such as a load spike on a shared host,
and is not charged to the snapshot (`StepTimes.uncharged_s` keeps it). So a snapshot is charged at most
its background time in all. The job's first step (start-up, first allocations) is not timed.

Automatic: the job's FIRST_AUTO_STEP-th step takes the first snapshot and waits for its background work
(once per job: that snapshot measures what one costs); each later snapshot's agreement (`SnapshotTier.
take`) brings the previous one's figures, the maximum over ranks, so every rank chooses the same next step.

Fixed: a snapshot taken before CLEAN_STEPS steps of the job ran without background work waits for its own
work too, so that the steps after it run clean. Without that, `snapshot_every = 1` would overlap every step
with the work of the snapshot before it, leaving no clean step to measure the slowdown against.

Every snapshot, fixed or automatic, is recorded once settled (by the next snapshot, at the run's last
step, or at a stop) as a `snapshot` event in metrics.jsonl: what it cost the run, for a time ledger to sum.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable

from relaytrain.checkpoint.snapshot.interval import Costs, IntervalChooser, overhead
from relaytrain.config.schema import CheckpointConfig

log = logging.getLogger("relaytrain.checkpoint")

FIRST_AUTO_STEP = 3  # the job's first step warms up; its second and third give a clean step time
WINDOW = 16  # the step times are medians of this many recent steps
CLEAN_STEPS = 2  # a fixed interval's snapshots wait for their work until this many steps were timed clean

EventSink = Callable[..., None]  # (event, step, **fields): the metrics logger's log_event


class StepTimes:
    """Each step's wall time from one `after_step` to the next, split by whether background work ran."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._mark: float | None = None
        self._overlapping = False
        self.clean: deque[float] = deque(maxlen=WINDOW)
        self.recent: deque[float] = deque(maxlen=WINDOW)
        self.slowdown_s = 0.0  # since the newest snapshot, beyond clean steps
        self.slowdown_known = True  # False: a step overlapped before any clean step was timed
        self.slowdown_total_s = 0.0  # over the whole job, for the time ledger
        self.uncharged_s = 0.0  # over the whole job: overlapping steps' excess beyond their overlap

    def step_ended(self, background_ended: float | None = None) -> None:
        """The step that began at `resumed` ended now; `background_ended`: when the background work that
        ran at its start ended (this clock; None: it still runs), which bounds what the step is charged."""
        if self._mark is None:
            return
        now = self._clock()
        took = now - self._mark
        self.recent.append(took)
        if not self._overlapping:
            self.clean.append(took)
        elif self.clean:
            overlap = (now if background_ended is None else min(now, background_ended)) - self._mark
            excess = max(0.0, took - statistics.median(self.clean))
            slower = min(excess, max(0.0, overlap))
            self.slowdown_s += slower
            self.slowdown_total_s += slower
            self.uncharged_s += excess - slower
        else:
            self.slowdown_known = False

    def resumed(self, background_running: bool) -> None:
        """The loop's next step starts now."""
        self._mark = self._clock()
        self._overlapping = background_running

    @property
    def step_s(self) -> float:
        """The recent steps' median (with a snapshot every step, no step is clean)."""
        return statistics.median(self.recent) if self.recent else 0.0

    def figures(self) -> dict[str, float]:
        """This rank's step figures since the newest snapshot (-1: unknown), for the ranks' agreement."""
        return {"step_s": self.step_s, "slowdown_s": self.slowdown_s if self.slowdown_known else -1.0}

    def snapshot_taken(self) -> None:
        self.slowdown_s, self.slowdown_known = 0.0, True


class SnapshotPacing:
    """`due(step)` before each snapshot decision; `taken` with what the tier's take or settle returned."""

    def __init__(self, cfg: CheckpointConfig, rank: int, on_event: EventSink | None = None):
        self.auto = cfg.snapshot_every == "auto"
        self.fixed = 0 if self.auto else int(cfg.snapshot_every)
        self.chooser = IntervalChooser(cfg.snapshot_max_overhead) if self.auto else None
        self.rank = rank
        self._on_event = on_event
        self.times = StepTimes()
        self._steps = 0  # steps of this job
        self.next_step: int | None = None  # automatic: the step of the next snapshot, once measured

    def step_ended(self, background_ended: float | None = None) -> None:
        """`background_ended`: when the snapshot work that ran at the step's start ended (StepTimes)."""
        self.times.step_ended(background_ended)
        self._steps += 1

    def due(self, step: int) -> bool:
        if not self.auto:
            return step % self.fixed == 0
        if self.next_step is None:
            return self._steps == FIRST_AUTO_STEP
        return step >= self.next_step  # >=: a NaN rollback went back before a chosen step

    @property
    def measuring(self) -> bool:
        """Whether the snapshot being taken waits for its own work: the job's first automatic one (it
        measures what one costs), or a fixed interval's while fewer than CLEAN_STEPS steps ran clean."""
        if self.auto:
            return self.next_step is None
        return len(self.times.clean) < CLEAN_STEPS

    def resumed(self, background_running: bool) -> None:
        self.times.resumed(background_running)

    def taken(self, step: int, settled: dict[str, float] | None, measured: bool = False) -> None:
        """Snapshot `step` was taken; `settled`: the figures of the one before (or, `measured`, of this
        one, waited for at once), agreed over ranks. Records it and, automatic, chooses the next step."""
        self.times.snapshot_taken()
        if settled is None:  # nothing to learn from (the one before was settled already): same interval
            if self.auto and self.chooser.every is not None:
                self.next_step = step + self.chooser.every
            return
        self.record(settled, measured)
        if not self.auto:
            return
        costs = Costs(
            blocking_s=settled["blocking_s"] - settled["waited_s"],  # the copy and the agreement
            background_s=settled["background_s"],
            # the measuring snapshot overlapped no step: its slowdown is at most its background work
            slowdown_s=settled["background_s"] if measured else max(0.0, settled["slowdown_s"]),
            step_s=settled["step_s"],
            waited_s=0.0 if measured else settled["overran_s"],
        )
        previous = self.chooser.every
        if self.chooser.update(costs, provisional=measured):
            self._chose(step, previous)
        self.next_step = step + self.chooser.every

    def record(self, settled: dict[str, float] | None, measured: bool = False) -> None:
        """The `snapshot` event of a settled snapshot (nothing for None)."""
        if settled is None:
            return
        slowdown = settled["slowdown_s"]
        record = {key: settled[key] for key in ("blocking_s", "waited_s", "background_s")}
        record |= {key: settled[key] for key in ("replicate_s", "write_s")}
        record["slowdown_s"] = None if slowdown < 0 else slowdown
        if measured:  # its own background work was waited for right after the copy
            record["blocking_s"] += settled["overran_s"]
            record["waited_s"] += settled["overran_s"]
        self._emit("snapshot", int(settled["step"]), **record)

    def _chose(self, step: int, previous: int | None) -> None:
        chooser, costs = self.chooser, self.chooser.chosen_on
        if self.rank == 0:
            log.info("snapshot interval: %s", chooser.describe())
        fields = {"every": chooser.every, "previous": previous, "blocking_s": costs.blocking_s}
        fields |= {"background_s": costs.background_s, "slowdown_s": costs.slowdown_s, "step_s": costs.step_s}
        fields |= {"overhead": overhead(costs, chooser.every), "budget": chooser.budget}
        self._emit("snapshot_interval", step, **fields)

    def _emit(self, event: str, step: int, **fields) -> None:
        if self._on_event is not None:
            self._on_event(event, step, **fields)
