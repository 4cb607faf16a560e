"""Which rank is a straggler, and what to do about it: the pure part (numbers in, a verdict out).

Every rank times the work it does alone (``PHASES``: its data phase, its layers' forward computation and
its optimizer update, waits in collectives excluded) every step. Every ``straggler_every`` steps the
ranks all-gather each phase's fastest time over that window (``straggler_watch.py``), and every rank
feeds the same matrix to its own ``StragglerJudge``, so all reach the same verdict without a further
collective.

The statistic, per window and phase: a rank's fastest time against the median of the OTHER ranks'
fastest times (so the straggler does not pull its own reference up; with 2 ranks the reference is the
other rank), the other ranks of its own pipeline stage under pipeline parallelism (``peers``): stages hold
different layers, and the first and last also the embedding and the output projection, so their phases
differ by design. The fastest of a window's steps, not their median: a persistent slowdown (a slower GPU, a
CPU quota) slows every step, so even the rank's fastest one, while a CPU shared with other work slows
the steps it happens to preempt, for seconds at a time, and the window's median with them.
A rank is named when one phase of it is slower than ``threshold`` in ``needed`` of the last ``windows``
windows (``resilience.straggler_windows_over`` of ``straggler_windows``): a noisy window or two neither
name a rank nor restart the count, as a streak rule's would, and the median of the phase's slowdowns over
those windows (the magnitude reported) is then over the threshold too. How the defaults (10 %, 5 of 8
windows, 20 ms floor on CPU) were chosen, and what they were judged on: docs/benchmarks.md, "Straggler
rules, replayed".
The typical step must agree: the median over the same windows of the phase's slowdown in the windows'
MEDIAN times is over the threshold as well. A persistent slowdown slows the typical step with the
fastest; on a machine whose cores are shared, a rank that happens to catch an idle core now and then has
a faster fastest step than its peer while their typical steps are alike, and the fastest times alone
would name the peer.
The episode clears by the mirror rule: the rank over the threshold (in any phase) in at most
``windows - needed`` of the last ``windows`` windows.
A phase shorter than a floor is left out: its relative noise (the clock, the interpreter, the
scheduler) is too large to mean anything. Timed by the device (CUDA events) the floor is ``MIN_PHASE_S``;
timed by the host's clock (training on CPU) it is ``MIN_HOST_PHASE_S``, as the operating system takes a
rank's core away for a slice of a few milliseconds whenever another process wants it (``phase_floor``).
The floor is absolute, not a share of the step: the step includes the waits for the slowest peer, which a
straggler or a loaded machine stretches, and a share of it would hide the very phase that shows the
straggler.
The forward/backward as a whole is not compared: its collectives (FSDP's all-gathers and reduce-scatters,
DDP's all-reduce) make every rank leave it together, and the ranks that wait there look slower, not
faster. Its "forward" phase is the forward of the modules with no collective inside
(``ParallelModel.work_modules``: each layer's attention and feed-forward and the output projection, timed
after FSDP has gathered their parameters), summed over the step. It is the longest phase a rank does alone,
and the steadiest (docs/benchmarks.md, "Stragglers", measures how far apart the ranks' times per phase
are where nothing slows either), so a slower rank is over the threshold in more of its windows. With
tensor or context parallelism it is the forward of the layers' linear layers and the output projection
(collectives around and inside the attention and the feed-forward there); under compile, each compiled
layer as a whole. Not timed with either under compile (the phase is then left out: 0 s).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PHASES = ("data", "forward", "optimizer")  # the work a rank does alone, in the gathered vector's order
# A phase whose reference is shorter than this is not compared: a phase of a few hundred microseconds
# varies by more than any threshold from the launch and the clock alone.
MIN_PHASE_S = 0.001
# The floor for phases timed by the host's clock: the operating system takes a rank's core away for slices
# of a few ms whenever another process wants it, so a shorter phase reads slower by noise alone (the runs
# it was chosen on: docs/benchmarks.md, "Straggler rules, replayed"). 20 ms leaves phases of a few slices
# out and the forward phase (every layer's attention and feed-forward) of models worth watching in.
MIN_HOST_PHASE_S = 0.020


def phase_floor(device_type: str) -> float:
    """The shortest phase compared, for phases timed on a device of ``device_type`` ("cuda": by its
    events; any other: by the host's clock)."""
    return MIN_PHASE_S if device_type == "cuda" else MIN_HOST_PHASE_S


ACTIONS = ("report", "replace", "auto")


@dataclass(frozen=True)
class Straggler:
    """A named straggler: ``slower`` is the fraction by which its phase took longer than the other ranks'
    median (0.25: 25 % slower), the median over the windows that named it; ``since_step``: the first
    step of the first of them over the threshold."""

    rank: int
    phase: str
    slower: float
    since_step: int

    @property
    def factor(self) -> float:
        """How many times as long as its peers the rank takes in ``phase`` (1.25 for 25 % slower)."""
        return 1.0 + self.slower


def slower_by(
    times: Sequence[Sequence[float]], min_phase_s: float = MIN_PHASE_S, peers: Sequence[int] | None = None
) -> dict[tuple[int, str], float]:
    """(rank, phase) -> how much slower than the other ranks' median, for every comparable phase.

    ``times[rank][i]``: the rank's fastest seconds in ``PHASES[i]`` over the window. ``peers[rank]``: the
    rank's group of ranks doing the same work (its pipeline stage; None: one group), the others of which
    are its reference; a rank alone in its group is not compared. A phase is comparable when the others'
    median is at least ``min_phase_s`` (``phase_floor``)."""
    out: dict[tuple[int, str], float] = {}
    ranks = len(times)
    group = list(peers) if peers is not None else [0] * ranks
    for rank in range(ranks):
        others = [r for r in range(ranks) if r != rank and group[r] == group[rank]]
        if not others:
            continue
        for i, phase in enumerate(PHASES):
            reference = statistics.median(times[r][i] for r in others)
            if reference < min_phase_s:
                continue
            out[(rank, phase)] = times[rank][i] / reference - 1.0
    return out


class StragglerJudge:
    """The sustained rule, fed one window at a time; the same inputs give the same verdicts on every rank.

    ``threshold``: the fraction slower that counts (0.2: 20 %); ``windows`` (K): how many recent windows
    are weighed. A (rank, phase) over the threshold in at least ``needed`` of the last K windows by its
    fastest times is named when the median of its slowdowns by the windows' median times over those
    windows is over the threshold too; ``slower`` is the median of its slowdowns by the fastest times.
    The named rank clears once it is over the threshold in at most K - ``needed`` of the last K.
    ``min_phase_s``: the shortest phase compared (``phase_floor``); ``peers``: each rank's group of ranks
    doing the same work (``slower_by``); ``typical``: whether the typical step must agree (the trainer's
    judge: it must)."""

    def __init__(
        self,
        threshold: float,
        windows: int,
        needed: int,
        min_phase_s: float = MIN_PHASE_S,
        peers: Sequence[int] | None = None,
        typical: bool = True,
    ):
        self.threshold, self.windows, self.needed, self.min_phase_s = threshold, windows, needed, min_phase_s
        self.typical = typical
        self.peers = list(peers) if peers is not None else None
        if not 1 <= self.needed <= windows:
            raise ValueError(f"needed must be 1..{windows} windows, not {self.needed}")
        # the last K windows: (first step, {(rank, phase): slower}) with every comparable pair
        self._recent: deque[tuple[int, dict[tuple[int, str], float]]] = deque(maxlen=windows)
        self._typical: deque[dict[tuple[int, str], float]] = deque(maxlen=windows)  # by median times
        self.named: Straggler | None = None  # the open episode

    def feed(
        self, first_step: int, fastest: Sequence[Sequence[float]], typical: Sequence[Sequence[float]]
    ) -> tuple[Straggler | None, Straggler | None]:
        """One window (its first step, the gathered fastest and median times per rank and phase):
        (newly named, cleared), either None."""
        self._recent.append((first_step, slower_by(fastest, self.min_phase_s, self.peers)))
        self._typical.append(slower_by(typical, self.min_phase_s, self.peers))
        if self.named is not None:
            rank = self.named.rank
            over = sum(1 for _, slower in self._recent if any(self._over(slower, (rank, p)) for p in PHASES))
            if over <= self.windows - self.needed:
                cleared, self.named = self.named, None
                return None, cleared
            return None, None
        candidates = []
        for key in {key for _, slower in self._recent for key in slower}:
            over_at = [step for step, slower in self._recent if self._over(slower, key)]
            if len(over_at) >= self.needed and (not self.typical or self._typically_over(key)):
                median = statistics.median(slower[key] for _, slower in self._recent if key in slower)
                candidates.append((median, key, over_at[0]))
        if not candidates:
            return None, None
        median, (rank, phase), since = max(candidates)
        self.named = Straggler(rank, phase, median, since)
        return self.named, None

    def _over(self, slower: Mapping[tuple[int, str], float], key: tuple[int, str]) -> bool:
        return slower.get(key, 0.0) > self.threshold

    def _typically_over(self, key: tuple[int, str]) -> bool:
        """Whether the median over the weighed windows of ``key``'s slowdown by median times is over."""
        typical = [slower[key] for slower in self._typical if key in slower]
        return bool(typical) and statistics.median(typical) > self.threshold


def choose_action(
    action: str, straggler: Straggler, spare_nodes: Sequence[str], nodes: int, min_nodes: int
) -> tuple[str, str]:
    """(what to do: "replace", "drop" or "report", why) for ``resilience.straggler_action``.

    "report" names the rank only. "replace" replaces its node when the job has an idle spare node
    (``spare_nodes``), else reports. "auto" replaces with a spare; without one it drops the node when the
    run's node range allows (``min_nodes`` set and below ``nodes``) and the job runs faster without it:
    synchronous ranks go at the straggler's pace, so N nodes give N / factor nodes' worth of work and
    N - 1 healthy nodes give N - 1 (with 2 nodes only a rank more than 2x slower is worth dropping)."""
    if action == "report":
        return "report", "resilience.straggler_action is report"
    if spare_nodes:
        return "replace", f"spare node {spare_nodes[0]} is idle"
    if action == "replace":
        return "report", "no idle spare node to replace it with"
    if not (0 < min_nodes < nodes):
        return "report", f"no spare node, and the run may not shrink below {nodes} node(s) (slurm.min_nodes)"
    with_it, without = nodes / straggler.factor, nodes - 1
    if without <= with_it:
        return "report", (
            f"no spare node, and {without} node(s) without it would do less work than {nodes} at its "
            f"pace ({with_it:.2f} nodes' worth)"
        )
    return "drop", f"no spare node; {without} node(s) without it beat {nodes} at its pace ({with_it:.2f})"


def describe_stragglers(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """`relaytrain status`'s rows for the run's stragglers (metrics.jsonl records): each rank's latest
    naming, in the order they were named, with when it cleared; a rank named later does not hide an
    earlier one."""
    named: dict[Any, tuple[Mapping[str, Any], Mapping[str, Any] | None]] = {}
    for record in records:
        if record.get("kind") != "event":
            continue
        rank = record.get("rank")
        if record.get("event") == "straggler":
            named.pop(rank, None)  # re-inserted: the order is that of the latest namings
            named[rank] = (record, None)
        elif record.get("event") == "straggler_cleared" and rank in named:
            named[rank] = (named[rank][0], record)
    return [_describe(latest, cleared) for latest, cleared in named.values()]


def _describe(latest: Mapping[str, Any], cleared: Mapping[str, Any] | None) -> str:
    slower = 100 * float(latest.get("slower") or 0)
    text = (
        f"rank {latest.get('rank')} on {latest.get('node')} {slower:.0f}% slower in {latest.get('phase')} "
        f"since step {latest.get('since_step')} (named at step {latest.get('step')}, "
        f"action {latest.get('action')})"
    )
    return text + (f"; cleared at step {cleared.get('step')}" if cleared is not None else "")
