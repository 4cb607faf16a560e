"""A rank that keeps the others waiting while the job still moves: a straggler, not a hang. The hang
monitor's ``straggler hint:`` line names it from the progress boards it reads anyway; the straggler watch
(``straggler_watch.py``: the ``straggler`` events) is what measures stragglers and acts on them, so the
hint names that concept and acts on nothing (one vocabulary, issue 53). Pure: the monitor feeds it the
``detect.RankView`` s of each look."""

from __future__ import annotations

import random
from collections import Counter, deque

from relaytrain.job.progress import Phase
from relaytrain.resilience.hangs.detect import TRAINING_PHASES, RankView, one_line, progress_key, seconds

HINT = "straggler hint:"  # the line's start: the hang monitor's hint of a straggler (was `slow rank:`)


def sample_gap(interval_s: float, rng: random.Random) -> float:
    """The wait before the monitor's next look: ``interval_s`` on average, drawn between half and one and
    a half of it. Looks a fixed interval apart, at a job whose step takes about as long, fall on the same
    moment of every step (the node watchers, a fixed second apart, too): the ranks' order at that one
    moment, such as just after the slow rank set off on the next step, would stand for the whole step."""
    return interval_s * rng.uniform(0.5, 1.5)


def at_one_instant(views: list[RankView]) -> bool:
    """Whether the ranks' records all held at one same instant: each held from its last write
    (``record.updated``) until its watcher read it (``read_at``), and the node watchers read their boards
    up to an interval apart. A fast rank read a second before a slow one that has since moved on looks
    behind it; such a sample compares two moments and says nothing about which rank keeps the others
    waiting."""
    records = [(v.record.updated, v.read_at) for v in views if v.record is not None]
    return max(updated for updated, _ in records) <= min(read for _, read in records)


class SlowRankTracker:
    """Names a rank that keeps the others waiting while the job still moves (slow, not hung).

    Each ``sample`` marks the ranks whose progress key is below the furthest rank's as behind; a sample in
    which no rank moved since the last one (a hang in the making, the monitor's business) is left out, and
    so is one whose records did not all hold at one instant (``at_one_instant``: the node files are read
    at different times). A rank behind in at least ``share`` of the samples of the last ``window_s``, with
    at least ``min_samples`` samples in which the ranks differed, is slow (a rank k times slower than the
    others waits for none of them and is behind (k - 1) / k of the time: 0.6 names one 2.5 times slower
    and up). The share counts every sample, not only those that differ: ranks of equal speed rarely differ
    when sampled, and when they do, either may be behind, or the same one by a hair (rank 0 logging), so
    they never come near it.
    """

    def __init__(
        self, window_s: float = 60.0, min_samples: int = 10, share: float = 0.6, repeat_s: float = 60.0
    ):
        self.window_s, self.min_samples, self.share, self.repeat_s = window_s, min_samples, share, repeat_s
        self._samples: deque[tuple[float, frozenset[int]]] = deque()  # (time, the ranks behind)
        self._tokens: dict[int, tuple] | None = None
        self._latest: dict[int, RankView] = {}
        self._reported: dict[int, float] = {}

    def sample(self, views: list[RankView], now: float) -> None:
        seen = {v.rank: v for v in views if v.record is not None}
        tokens = {rank: v.record.token() for rank, v in seen.items() if v.record is not None}
        moved, self._tokens, self._latest = tokens != self._tokens, tokens, seen
        if moved and len(seen) > 1 and at_one_instant(list(seen.values())):
            keys = {rank: progress_key(v) for rank, v in seen.items()}
            top = max(keys.values())
            self._samples.append((now, frozenset(rank for rank, key in keys.items() if key < top)))
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()

    def report(self, now: float) -> str | None:
        """One ``straggler hint:`` line, for the rank most often behind, at most once per ``repeat_s`` a
        rank."""
        recent = [behind for t, behind in self._samples if t >= now - self.window_s]
        if sum(1 for behind in recent if behind) < self.min_samples:
            return None
        counts = Counter(rank for behind in recent for rank in behind)
        quiet = {rank for rank, t in self._reported.items() if now - t < self.repeat_s}
        slow = [
            (count / len(recent), rank)
            for rank, count in counts.items()
            if count / len(recent) >= self.share and rank not in quiet
        ]
        if not slow:
            return None
        share, rank = max(slow)
        self._reported[rank] = now
        view = self._latest.get(rank)
        node = f" on {view.node}" if view is not None else ""
        return one_line(
            f"{HINT} rank {rank}{node} behind the others in {share:.0%} of {len(recent)} samples "
            f"over the last {seconds(self.window_s)}{self._step_times(rank)}; "
            "the job still moves, so no hang and no restart (the straggler watch decides on stragglers)"
        )

    def _step_times(self, rank: int) -> str:
        own = _step_time(self._latest.get(rank))
        others = sorted(t for r, v in self._latest.items() if r != rank and (t := _step_time(v)) is not None)
        if own is None:
            return ""
        if not others:
            return f" (its step-time median {seconds(own)})"
        return f" (its step-time median {seconds(own)} vs {seconds(others[len(others) // 2])} on the others)"


def _step_time(view: RankView | None) -> float | None:
    """A training step's recent median length (data + forward/backward + optimizer), when all are measured."""
    if view is None or view.record is None:
        return None
    medians = view.record.medians
    if not all(p in medians for p in (Phase.DATA, Phase.FORWARD_BACKWARD, Phase.OPTIMIZER)):
        return None
    return sum(medians[p] for p in TRAINING_PHASES if p in medians)
