"""PNG plots of a stitched run history (matplotlib, Agg: no display needed).

Step-axis plots mark each restart at the step the new job resumed from; time-axis plots mark it
at the wall time the new job started. Time-axis lines break between jobs instead of drawing a
straight line across the time the run was down.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
from matplotlib.axes import Axes  # noqa: E402 - after choosing the backend
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import EngFormatter  # noqa: E402

from relaytrain.monitor.history import History  # noqa: E402

RESTART_COLOR = "tab:red"


class TimeAxis:
    """Wall time since the run's first record, in minutes or hours depending on the span."""

    def __init__(self, start: float, end: float):
        self.start = start
        self.scale, self.unit = (3600.0, "h") if end - start > 3 * 3600 else (60.0, "min")

    def __call__(self, t: float) -> float:
        return (t - self.start) / self.scale

    @property
    def label(self) -> str:
        return f"wall time since run start ({self.unit})"


def _value(rec: dict[str, Any], key: str) -> float:
    v = rec.get(key)
    return float("nan") if v is None else float(v)


def _mark_restarts(ax: Axes, positions: Iterable[tuple[float, str]]) -> None:
    transform = ax.get_xaxis_transform()  # x in data units, y in axes fraction
    first = True
    for x, label in positions:
        ax.axvline(x, color=RESTART_COLOR, linestyle="--", linewidth=1, label="restart" if first else None)
        ax.text(
            x,
            0.98,
            label,
            transform=transform,
            rotation=90,
            va="top",
            ha="left",
            fontsize=8,
            color=RESTART_COLOR,
            bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1},
        )
        first = False


def _restarts_by_step(history: History) -> list[tuple[float, str]]:
    out = []
    for seg in history.segments[1:]:
        step = seg.resume_step()
        if step is not None:
            resized = f", {seg.resize_note}" if seg.resize_note else ""
            out.append((float(step), f"{seg.label}, from step {step}{resized}"))
    return out


def _restarts_by_time(history: History, axis: TimeAxis) -> list[tuple[float, str]]:
    return [(axis(seg.start_time), seg.label) for seg in history.segments[1:]]


def _time_series(history: History, axis: TimeAxis, key: str, scale: float = 1.0) -> tuple[list, list]:
    """Points of ``key`` over wall time, every segment's own records, NaN between segments."""
    xs, ys = [], []
    for seg in history.segments:
        for rec in seg.train:
            if key in rec:
                xs.append(axis(rec["time"]))
                ys.append(_value(rec, key) * scale)
        if xs and not math.isnan(xs[-1]):
            xs.append(float("nan"))
            ys.append(float("nan"))
    return xs, ys


def _figure(title: str, xlabel: str, ylabel: str) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(10, 5), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _headroom(ax: Axes) -> None:
    """Start the y axis at 0 and leave the top quarter free for the restart labels."""
    top = ax.get_ylim()[1]
    ax.set_ylim(0, top * 1.25 if top > 0 else 1.0)


def _legend(ax: Axes) -> None:
    # Outside the axes, so it never hides data or restart labels.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _save(fig: Figure, ax: Axes, path: Path) -> Path:
    _legend(ax)
    fig.savefig(path, dpi=110)
    return path


def _break_gaps(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    """NaN where samples are far apart (the sampler was not running), so no line bridges it."""
    if len(xs) < 3:
        return xs, ys
    steps = sorted(b - a for a, b in zip(xs, xs[1:], strict=False))
    limit = 3 * steps[len(steps) // 2]
    out_x, out_y = [xs[0]], [ys[0]]
    for i in range(1, len(xs)):
        if xs[i] - xs[i - 1] > limit:
            out_x.append(float("nan"))
            out_y.append(float("nan"))
        out_x.append(xs[i])
        out_y.append(ys[i])
    return out_x, out_y


def plot_loss(history: History, name: str, path: Path) -> Path:
    fig, ax = _figure(f"{name}: loss", "step", "loss")
    ax.plot(
        [r["step"] for r in history.train], [_value(r, "loss") for r in history.train], label="train loss"
    )
    if history.eval:
        ax.plot(
            [r["step"] for r in history.eval],
            [_value(r, "val_loss") for r in history.eval],
            "o-",
            label="validation loss",
        )
    _mark_restarts(ax, _restarts_by_step(history))
    return _save(fig, ax, path)


def plot_over_time(
    history: History,
    name: str,
    path: Path,
    title: str,
    ylabel: str,
    series: list[tuple[str, str, float]],
    engineering: bool = False,
) -> Path | None:
    """One line per ``(key, legend label, scale)`` present in the train records."""
    axis = TimeAxis(history.start_time, history.segments[-1].end_time)
    fig, ax = _figure(f"{name}: {title}", axis.label, ylabel)
    drawn = 0
    for key, label, scale in series:
        xs, ys = _time_series(history, axis, key, scale)
        if any(not math.isnan(y) for y in ys):
            ax.plot(xs, ys, marker=".", label=label)
            drawn += 1
    if not drawn:
        return None
    _headroom(ax)
    if engineering:
        ax.yaxis.set_major_formatter(EngFormatter())
    _mark_restarts(ax, _restarts_by_time(history, axis))
    return _save(fig, ax, path)


def plot_step_time(history: History, name: str, path: Path) -> Path | None:
    parts = [
        ("time_data_s", "data wait"),
        ("time_forward_backward_s", "forward+backward"),
        ("time_optimizer_s", "optimizer"),
        ("time_checkpoint_s", "checkpoint"),
        ("time_other_s", "other"),
    ]
    recs = [r for r in history.train if r.get("time_step_s") is not None]
    if not recs:
        return None
    fig, ax = _figure(
        f"{name}: step time split (mean per step in each logging window)", "step", "seconds per step"
    )
    steps = [r["step"] for r in recs]
    stacks = [[_value(r, key) if r.get(key) is not None else 0.0 for r in recs] for key, _ in parts]
    ax.stackplot(steps, *stacks, labels=[label for _, label in parts], alpha=0.8)
    _headroom(ax)
    _mark_restarts(ax, _restarts_by_step(history))
    return _save(fig, ax, path)


def plot_gpus(
    history: History, gpus: dict[str, list[dict[str, float]]], name: str, path: Path
) -> Path | None:
    if not gpus:
        return None
    start = min([history.start_time] + [s[0]["time"] for s in gpus.values()])
    end = max([history.segments[-1].end_time] + [s[-1]["time"] for s in gpus.values()])
    axis = TimeAxis(start, end)
    fig = Figure(figsize=(10, 8), layout="constrained")
    panels: list[tuple[str, str, Callable[[dict[str, float]], float]]] = [
        ("GPU utilisation (mean over the node's GPUs)", "utilisation (%)", lambda s: s["util_gpu_pct"]),
        ("GPU power (sum over the node's GPUs)", "power (W)", lambda s: s["power_w"]),
    ]
    axes = fig.subplots(len(panels), 1, sharex=True)
    fig.suptitle(f"{name}: GPUs per node")
    for ax, (title, ylabel, get) in zip(axes, panels, strict=True):
        for host, samples in sorted(gpus.items()):
            xs, ys = _break_gaps([axis(s["time"]) for s in samples], [get(s) for s in samples])
            ax.plot(xs, ys, label=host)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        _headroom(ax)
        _mark_restarts(ax, _restarts_by_time(history, axis))
        _legend(ax)
    axes[-1].set_xlabel(axis.label)
    fig.savefig(path, dpi=110)
    return path


def throughput_series(history: History) -> list[tuple[str, str, float]]:
    """The throughput lines: all devices and per device, or one line where they are the same (one
    device), which would otherwise lie exactly under the other."""
    pairs = [(r.get("tokens_per_s"), r.get("tokens_per_s_per_device")) for r in history.train]
    if pairs and all(total is not None and total == each for total, each in pairs):
        return [("tokens_per_s", "tokens/s (one device: all devices = per device)", 1.0)]
    return [
        ("tokens_per_s", "tokens/s (all devices)", 1.0),
        ("tokens_per_s_per_device", "tokens/s per device", 1.0),
    ]


def mfu_labels(history: History) -> tuple[str, str]:
    """(title, y label) of the MFU plot: an estimate where the peak was measured on this CPU."""
    if any(r.get("mfu_estimate") for r in history.train):
        return "model FLOPs utilisation (estimate: CPU peak measured on this machine)", "MFU (%), estimate"
    return "model FLOPs utilisation", "MFU (%)"


def plot_all(
    history: History, gpus: dict[str, list[dict[str, float]]], name: str, out_dir: Path
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    memory_series = [
        ("mem_allocated_gib", "allocated", 1.0),
        ("mem_reserved_gib", "reserved", 1.0),
        ("mem_rss_gib", "resident set (CPU)", 1.0),
        ("mem_peak_gib", "peak", 1.0),
    ]
    made = [
        plot_loss(history, name, out_dir / "loss.png"),
        plot_over_time(
            history,
            name,
            out_dir / "throughput.png",
            "throughput",
            "tokens / s",
            throughput_series(history),
            engineering=True,
        ),
        plot_over_time(history, name, out_dir / "mfu.png", *mfu_labels(history), [("mfu", "MFU", 100.0)]),
        plot_over_time(history, name, out_dir / "memory.png", "memory (rank 0)", "GiB", memory_series),
        plot_step_time(history, name, out_dir / "step_time.png"),
        plot_gpus(history, gpus, name, out_dir / "gpu.png"),
    ]
    return [p for p in made if p is not None]
