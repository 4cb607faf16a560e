"""The per-rank time plot of `relaytrain report`, and its table of stragglers.

Every ``resilience.straggler_every`` steps the run records each rank's median seconds in the phases it
works alone (a ``rank_times`` record: ``rank<R>_<phase>_s``). The plot draws one line per rank (the sum
of those phases, in milliseconds) and marks each named straggler from the step its slowdown began.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from relaytrain.monitor.history import History
from relaytrain.monitor.plots import _figure, _headroom, _save

KEY = re.compile(r"^rank(\d+)_([a-z]+)_s$")  # the medians: not rank<R>_<phase>_fastest_s
STRAGGLER_COLOR = "tab:red"


def work_by_rank(history: History) -> dict[int, tuple[list[int], list[float]]]:
    """rank -> (steps, milliseconds of work per step: its timed phases summed, the step time left out)."""
    out: dict[int, tuple[list[int], list[float]]] = {}
    for record in history.rank_times:
        totals: dict[int, float] = {}
        for key, value in record.items():
            match = KEY.match(key)
            if match and match.group(2) != "step" and isinstance(value, int | float):
                rank = int(match.group(1))
                totals[rank] = totals.get(rank, 0.0) + 1000.0 * float(value)
        for rank, total in totals.items():
            steps, values = out.setdefault(rank, ([], []))
            steps.append(int(record["step"]))
            values.append(total)
    return out


def stragglers(history: History) -> list[dict[str, Any]]:
    return [r for r in history.events if r.get("event") == "straggler"]


def plot_rank_times(history: History, name: str, path: Path) -> Path | None:
    """None when the run recorded no per-rank times (one rank, or straggler detection off)."""
    series = work_by_rank(history)
    if not series:
        return None
    fig, ax = _figure(
        f"{name}: each rank's own work per step (median over each straggler window)", "step", "milliseconds"
    )
    for rank in sorted(series):
        steps, values = series[rank]
        ax.plot(steps, values, marker=".", label=f"rank {rank}")
    _headroom(ax)
    for event in stragglers(history):
        since = event.get("since_step", event["step"])
        label = f"straggler: rank {event.get('rank')} {100 * float(event.get('slower') or 0):.0f}% slower"
        ax.axvspan(since, event["step"], color=STRAGGLER_COLOR, alpha=0.15)
        ax.axvline(event["step"], color=STRAGGLER_COLOR, linestyle="--", linewidth=1, label=label)
    return _save(fig, ax, path)


def straggler_lines(history: History) -> list[str]:
    """The report's "Stragglers" table (no lines when none was named)."""
    named = stragglers(history)
    if not named:
        return []
    head = "| named at step | rank | node | phase | slower | since step | action |"
    lines = ["", "## Stragglers", "", head, "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in named:
        slower = f"{100 * float(r.get('slower') or 0):.0f} %"
        cells = [r["step"], r.get("rank"), r.get("node"), r.get("phase"), slower]
        cells += [r.get("since_step"), r.get("action")]
        lines.append("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    return lines
