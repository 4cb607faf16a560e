"""The automatic snapshot interval (`checkpoint.snapshot_every = "auto"`): the shortest interval whose
cost stays within `checkpoint.snapshot_max_overhead`, from measured figures. Pure: no clock, no I/O.

A snapshot costs the training run its blocking copy plus what its background work (replication to the
peers, the writes) slows the steps it overlaps. Every `k` steps that is a share

    overhead(k) = (blocking + slowdown) / (k * step)

of the step time. The background work must also be done before the next snapshot is due, with a margin
(a snapshot that waited for the previous one would block for the rest of it):

    background * (1 + FIT_MARGIN) <= k * step

The interval is the smallest `k >= 1` that satisfies both with the cost held to HEADROOM of the budget:

    overhead(k) <= HEADROOM * budget

A snapshot's cost is known only after it was taken, so an interval chosen at the budget's edge goes over
it whenever the figures grow (a loaded host slows the background work, and with it the steps it
overlaps) until the next snapshot measures them. The headroom lets the figures grow by 1 / HEADROOM - 1
(25 %) before a snapshot costs more than the budget. The interval is chosen again at once when, on the
newest figures, it no longer keeps to the budget (or its background work no longer fits) or a snapshot
had to wait for the previous one; otherwise when a figure moves by more than HYSTERESIS from the ones it
was chosen on. The figures are the medians over the last RECENT snapshots: one noisy snapshot (a slow
write, a step that an evaluation lengthened) does not make the interval flap.

The job's first snapshot waits for its own background work to measure it, so no step overlapped it and
its slowdown is unknown. Its figures are *provisional*: the slowdown is taken as the whole background
time (the most it can cost when it competes with training for the same processors), so the first
interval errs long, never over the budget; the next snapshot's measured figures replace them.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, fields

FIT_MARGIN = 0.25  # background work gets this much more than its measured time before the next snapshot
HYSTERESIS = 0.2  # a relative change of a figure that makes the interval be chosen again
HEADROOM = 0.8  # the interval is chosen for this share of the budget (see above)
RECENT = 5  # snapshots whose median figures the interval is chosen from
_MIN_STEP_S = 1e-6  # a step time of 0 (a clock's resolution) would divide by zero


@dataclass(frozen=True)
class Costs:
    """One snapshot's measured figures (the maximum over ranks: the ranks step together)."""

    blocking_s: float  # the copy the step waited for
    background_s: float  # replication and writes, from the copy's end until they finished
    slowdown_s: float  # what the steps overlapping the background work took beyond a clean step
    step_s: float  # a clean step (no background work running)
    waited_s: float = 0.0  # how long the snapshot waited for the previous one's background work

    @property
    def cost_s(self) -> float:
        return self.blocking_s + self.slowdown_s


def overhead(costs: Costs, every: int) -> float:
    """The share of step time that a snapshot every `every` steps costs."""
    return costs.cost_s / (every * max(costs.step_s, _MIN_STEP_S))


def fits(costs: Costs, every: int) -> bool:
    """Whether the background work is done, with its margin, before a snapshot `every` steps later."""
    return costs.background_s * (1 + FIT_MARGIN) <= every * max(costs.step_s, _MIN_STEP_S)


def shortest_interval(costs: Costs, budget: float) -> int:
    """The smallest interval within `budget` (a share of step time) whose background work fits. The
    chooser passes HEADROOM of its budget."""
    step = max(costs.step_s, _MIN_STEP_S)
    # The tolerance keeps an exact quotient (0.2 / (0.02 * 10) = 1.0000000000000002) from rounding up.
    by_budget = math.ceil(costs.cost_s / (budget * step) - 1e-9)
    by_fit = math.ceil(costs.background_s * (1 + FIT_MARGIN) / step - 1e-9)
    return max(1, by_budget, by_fit)


def _moved(new: float, old: float) -> bool:
    return abs(new - old) > HYSTERESIS * max(abs(old), 1e-9)


class IntervalChooser:
    """Holds the interval and the figures it was chosen on; `update` with each snapshot's figures."""

    def __init__(self, budget: float):
        self.budget = budget
        self.every: int | None = None
        self.chosen_on: Costs | None = None
        self._recent: deque[Costs] = deque(maxlen=RECENT)
        self._provisional = False  # the newest figures are an upper bound, replaced by the next ones

    def update(self, measured: Costs, provisional: bool = False) -> bool:
        """Choose again when the median figures moved (or a snapshot waited); whether it chose.
        `provisional` figures (the first snapshot's: see above) are dropped at the next update."""
        if self._provisional:
            self._recent.pop()
        self._provisional = provisional
        self._recent.append(measured)
        costs = Costs(
            **{f.name: statistics.median(getattr(c, f.name) for c in self._recent) for f in fields(Costs)}
        )
        costs = Costs(**{**vars(costs), "waited_s": measured.waited_s})
        old = self.chosen_on
        again = (
            old is None
            or costs.waited_s > 0
            or overhead(costs, self.every) > self.budget  # over the budget now: longer at once
            or not fits(costs, self.every)
            or _moved(costs.step_s, old.step_s)
            or _moved(costs.background_s, old.background_s)
            or _moved(costs.cost_s, old.cost_s)
        )
        if again:
            self.every = shortest_interval(costs, HEADROOM * self.budget)
            self.chosen_on = costs
        return again

    def describe(self) -> str:
        """The log line's figures: the interval, what it was chosen from, its overhead and the budget."""
        c, every = self.chosen_on, self.every
        return (
            f"every {every} steps (blocking {c.blocking_s:.3f} s, background {c.background_s:.3f} s, "
            f"step {c.step_s:.3f} s, overhead {overhead(c, every):.2%} <= budget {self.budget:.2%})"
        )
