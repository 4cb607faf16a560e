"""The time ledger in `relaytrain report`: its table in report.md and its timeline plot, ``ledger.png``.

The plot has one lane per allocation (a Slurm job's run, or a process outside Slurm), first on top, on a
wall-clock axis from the start of the run's first allocation: each span of the allocation in its
bucket's colour, so time between allocations (queue time, not allocated) stays empty. Both read one
`Ledger` (monitor/ledger.py), the one `relaytrain status` reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from relaytrain.monitor.history import History
from relaytrain.monitor.ledger import BUCKET_MEANING, BUCKETS, JobTime, Ledger, Span, duration

# One colour per bucket, fixed, so the same bucket looks the same in every report; `unaccounted` is hatched
# white: no record says what that time was.
BUCKET_COLORS = {
    "productive": "#2ca02c",
    "startup": "#1f77b4",
    "restore": "#17becf",
    "replayed": "#bcbd22",
    "checkpoint": "#9467bd",
    "snapshot": "#e377c2",
    "eval": "#8c564b",
    "hang": "#d62728",
    "restart": "#ff7f0e",
    "lost": "#67000d",
    "stop": "#7f7f7f",
    "unaccounted": "#ffffff",
}
QUEUE_COLOR = "#555555"
SOURCE = {"sacct": "Slurm accounting", "records": "the run's records"}


def recorded_ledger(history: History) -> bool:
    """Whether the run's trainer recorded the ledger (its ``ledger`` windows, or the start-up fields of a
    start/resume event); a run trained before the ledger was recorded has neither."""
    return any(
        r.get("kind") == "ledger" or (r.get("kind") == "event" and "process_start" in r)
        for segment in history.segments
        for r in segment.records
    )


def _share(seconds: float, allocated: float) -> str:
    return f"{seconds / allocated:.1%}" if allocated > 0 else "n/a"


def ledger_lines(ledger: Ledger | None) -> list[str]:
    """The report's "Time ledger" section: goodput, one row per bucket, the allocations."""
    lines = ["", "## Time ledger", ""]
    if ledger is None:
        return lines + [
            "The run recorded no time ledger: its metrics.jsonl has no `ledger` windows (a run trained by",
            "a relaytrain without the ledger, or a program that records only its events).",
        ]
    allocated, buckets = ledger.allocated_s, ledger.buckets
    goodput = "n/a" if ledger.goodput is None else f"{ledger.goodput:.1%}"
    count = len(ledger.jobs)
    drawn = " ledger.png draws the timeline." if allocated > 0 else ""  # as `plot_ledger` draws it
    lines += [
        f"Goodput {goodput}: productive steps' share of {duration(allocated)} allocated in {count} "
        f"allocation{'s' * (count != 1)}. Queue time between allocations ({duration(ledger.queue_s)}) is "
        f"wall-clock, not allocated: it is in no share.{drawn}",
        "",
        "| bucket | seconds | share of allocated | what |",
        "| --- | ---: | ---: | --- |",
    ]
    for name in BUCKETS:
        lines.append(
            f"| {name} | {buckets[name]:.1f} | {_share(buckets[name], allocated)} | {BUCKET_MEANING[name]} |"
        )
    inferred = sum(ledger.inferred.values())
    lines += [
        f"| allocated | {allocated:.1f} | {_share(allocated, allocated)} | the allocations' Start..End: "
        "the sum of the above |",
        f"| of which inferred | {inferred:.1f} | {_share(inferred, allocated)} | put in a bucket by rule, "
        "no record measured it (beside `unaccounted`: what no record covers) |",
        f"| queue | {ledger.queue_s:.1f} | | between allocations: wall-clock, not allocated |",
        "",
        "| allocation | start, after the first | bounds from | seconds | goodput | largest loss |",
        "| --- | ---: | --- | ---: | ---: | --- |",
    ]
    origin = ledger.jobs[0].allocation.start if ledger.jobs else 0.0
    for job in ledger.jobs:
        own = job.buckets()
        losses = sorted(((s, n) for n, s in own.items() if n != "productive" and s > 0), reverse=True)
        largest = f"{losses[0][1]} {duration(losses[0][0])}" if losses else ""
        cells = [
            job.label,
            duration(job.allocation.start - origin),
            SOURCE.get(job.allocation.source, job.allocation.source),
        ]
        cells += [f"{job.seconds:.1f}", _share(own["productive"], job.seconds), largest]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _time_unit(span_s: float) -> tuple[float, str]:
    """Seconds for a few minutes, minutes for a few hours, else hours."""
    if span_s <= 300:
        return 1.0, "s"
    return (60.0, "min") if span_s <= 5 * 3600 else (3600.0, "h")


def _bars(spans: Iterable[Span], origin: float, scale: float) -> dict[str, list[tuple[float, float]]]:
    """bucket -> (start, width) in axis units, neighbouring spans of one bucket merged (a run logs a window
    every few steps: thousands of spans, a few bars)."""
    out: dict[str, list[tuple[float, float]]] = {}
    previous: Span | None = None
    for span in spans:
        if span.seconds <= 0:
            continue
        bars = out.setdefault(span.bucket, [])
        start, width = (span.start - origin) / scale, span.seconds / scale
        if (
            previous is not None
            and previous.bucket == span.bucket
            and bars
            and abs(previous.end - span.start) < 1e-9
        ):
            begun, _ = bars[-1]
            bars[-1] = (begun, start + width - begun)
        else:
            bars.append((start, width))
        previous = span
    return out


def _lane_label(job: JobTime) -> str:
    productive = job.buckets()["productive"]
    return f"{job.label}\n{_share(productive, job.seconds)} goodput, {duration(job.seconds)}"


def _draw_queue(ax: Any, ledger: Ledger, origin: float, scale: float, width: float) -> bool:
    """A dotted line across each gap between allocations, in the later one's lane, named when it is wide
    enough to hold its name. Whether there was any."""
    any_gap = False
    for lane, (before, after) in enumerate(zip(ledger.jobs, ledger.jobs[1:], strict=False), start=1):
        gap = after.allocation.start - before.allocation.end
        if gap <= 0:
            continue
        any_gap = True
        x0, x1 = (before.allocation.end - origin) / scale, (after.allocation.start - origin) / scale
        ax.plot([x0, x1], [lane, lane], linestyle=":", color=QUEUE_COLOR, linewidth=1.5)
        if (x1 - x0) > 0.12 * width:
            ax.text(
                (x0 + x1) / 2,
                lane - 0.06,
                f"queued {duration(gap)}",
                ha="center",
                va="bottom",
                fontsize=8,
                color=QUEUE_COLOR,
            )
    return any_gap


def plot_ledger(ledger: Ledger, name: str, path: Path) -> Path | None:
    """The timeline, or None when the ledger has no allocated time."""
    if not ledger.jobs or ledger.allocated_s <= 0:
        return None
    origin = min(job.allocation.start for job in ledger.jobs)
    width_s = max(job.allocation.end for job in ledger.jobs) - origin
    scale, unit = _time_unit(width_s)
    lanes = len(ledger.jobs)
    fig = Figure(figsize=(11, min(20.0, max(4.0, 1.6 + 0.7 * lanes))), layout="constrained")
    ax = fig.add_subplot()
    for lane, job in enumerate(ledger.jobs):
        for bucket, bars in _bars(job.spans, origin, scale).items():
            hatch = "//" if bucket == "unaccounted" else None
            edge = "#999999" if hatch else "none"
            ax.broken_barh(
                bars,
                (lane - 0.35, 0.7),
                facecolors=BUCKET_COLORS[bucket],
                edgecolor=edge,
                hatch=hatch,
                linewidth=0.5,
            )
    queued = _draw_queue(ax, ledger, origin, scale, width_s / scale)
    ax.set_yticks(range(lanes), [_lane_label(job) for job in ledger.jobs], fontsize=9)
    ax.set_ylim(lanes - 0.5, -0.6)  # the first allocation on top
    ax.set_xlim(0, width_s / scale * 1.01 or 1.0)
    ax.set_xlabel(f"wall-clock time since the start of the run's first allocation ({unit})")
    ax.set_ylabel("allocation")
    ax.grid(True, axis="x", alpha=0.3)
    goodput = ledger.goodput or 0.0
    ax.set_title(f"{name}: time ledger, goodput {goodput:.1%} of {duration(ledger.allocated_s)} allocated")
    totals, allocated = ledger.buckets, ledger.allocated_s
    handles: list[Any] = [
        Patch(
            facecolor=BUCKET_COLORS[b],
            edgecolor="#999999",
            hatch="//" if b == "unaccounted" else None,
            label=f"{b} {_share(totals[b], allocated)}",
        )
        for b in BUCKETS
        if totals[b] > 0
    ]
    if queued:
        handles.append(
            Line2D([], [], linestyle=":", color=QUEUE_COLOR, label=f"queue {duration(ledger.queue_s)}")
        )
    ax.legend(
        handles=handles,
        title="bucket, share of allocated",
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0.0,
        fontsize=9,
    )
    fig.savefig(path, dpi=110)
    return path
