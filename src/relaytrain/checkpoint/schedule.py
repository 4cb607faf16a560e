"""When to save, and which checkpoints to delete afterwards."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from relaytrain.checkpoint.files import StepEntry
from relaytrain.config.schema import CheckpointConfig


class SaveSchedule:
    """Step-based and wall-clock-based save decisions.

    The wall-clock rule is evaluated on rank 0 only and handed to `agree` (a broadcast from rank 0 in
    a distributed run), so every rank reaches the same answer at the same step even when clocks or
    step timings differ between ranks.
    """

    def __init__(self, cfg: CheckpointConfig, agree: Callable[[bool], bool], clock=time.monotonic):
        self.cfg = cfg
        self._agree = agree
        self._clock = clock
        self.last_save_time = clock()

    def mark_saved(self) -> None:
        self.last_save_time = self._clock()

    def due(self, step: int, is_last: bool) -> bool:
        cfg = self.cfg
        by_steps = is_last or (step == 0 and cfg.save_initial)
        by_steps = by_steps or (step > 0 and cfg.interval > 0 and step % cfg.interval == 0)
        if cfg.interval_minutes <= 0:
            return by_steps
        # Every rank joins the agreement at every step, whatever its own answer, to keep collectives paired.
        by_time = self._agree(self._clock() - self.last_save_time >= cfg.interval_minutes * 60.0)
        return by_steps or by_time


def retention_victims(
    entries: list[StepEntry], latest: Path | None, keep_last: int, keep_every: int, protected: set[Path]
) -> list[StepEntry]:
    """Step directories to delete: complete ones outside the keep rules, incomplete leftovers older than
    the newest complete one. Never what `latest` points to, the newest complete one, or `protected`
    (which the keep rules do not count: a damaged checkpoint kept beside a run takes no place of its own)."""
    kept_aside = {p.resolve() for p in protected}
    complete = [e for e in entries if e.complete and e.path.resolve() not in kept_aside]
    if not complete:
        return []
    keep = {e.step for e in complete[-keep_last:]} if keep_last > 0 else {e.step for e in complete}
    if keep_every > 0:
        keep |= {e.step for e in complete if e.step % keep_every == 0}
    keep.add(complete[-1].step)
    safe = kept_aside | ({latest.resolve()} if latest is not None else set())
    victims = []
    for entry in entries:
        if entry.path.resolve() in safe:
            continue
        if entry.complete and entry.step not in keep or not entry.complete and entry.step < complete[-1].step:
            victims.append(entry)
    return victims
