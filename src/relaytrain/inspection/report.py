"""`relaytrain report`: PNG plots and a markdown summary of a run, across all its jobs."""

from __future__ import annotations

import datetime
import math
import statistics
from pathlib import Path
from typing import Any

from relaytrain.errors import UserError
from relaytrain.job.rundir import RunDir
from relaytrain.monitor.history import History, load_history, read_gpu_csvs
from relaytrain.monitor.ledger import Ledger
from relaytrain.monitor.ledger_plot import ledger_lines, plot_ledger, recorded_ledger
from relaytrain.monitor.plots import plot_all
from relaytrain.monitor.rank_plot import plot_rank_times, straggler_lines
from relaytrain.monitor.run_ledger import run_ledger


def _mean(history: History, key: str) -> float | None:
    values = [float(r[key]) for r in history.train if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s"


def _fmt(value: float | None, fmt: str, suffix: str = "") -> str:
    return "n/a" if value is None or math.isnan(value) else format(value, fmt) + suffix


def summarize(history: History) -> dict[str, Any]:
    last = history.train[-1] if history.train else None
    evals = [r for r in history.eval if r.get("val_loss") is not None]
    best = min(evals, key=lambda r: r["val_loss"]) if evals else None
    job_ids = list(dict.fromkeys(s.job_id for s in history.segments if s.job_id is not None))
    lost_s, lost_steps = history.lost_time()
    mfu = _mean(history, "mfu")
    steps = [int(r["step"]) for r in history.events if int(r["step"]) >= 0]
    return {
        # A program under `launch --command` logs no train records, only its events (relaytrain.program).
        "last_step": last["step"] if last else max(steps, default=None),
        "final_loss": last.get("loss") if last else None,
        "best_val_loss": best["val_loss"] if best else None,
        "best_val_step": best["step"] if best else None,
        "mean_tokens_per_s": _mean(history, "tokens_per_s"),
        "mean_tokens_per_s_per_device": _mean(history, "tokens_per_s_per_device"),
        "mean_mfu": mfu,
        "mfu_estimate": any(r.get("mfu_estimate") for r in history.train),
        "restarts": history.restarts,
        "restarts_in_place": history.restarts_in_place,
        "extensions": len(history.segments) - 1 - history.restarts - history.restarts_in_place,
        "job_ids": job_ids,
        "lost_s": lost_s,
        "lost_steps": lost_steps,
        "wall_s": history.segments[-1].end_time - history.start_time,
    }


def render_markdown(
    name: str, history: History, summary: dict[str, Any], images: list[Path], ledger: Ledger | None = None
) -> str:
    """report.md; `ledger` None: the run recorded no time ledger (its section says so)."""
    s = summary
    started = datetime.datetime.fromtimestamp(history.start_time).isoformat(sep=" ", timespec="seconds")
    best = "n/a" if s["best_val_loss"] is None else f"{s['best_val_loss']:.4f} (step {s['best_val_step']})"
    rows = [
        ("run", name),
        ("started", started),
        ("wall time, first to last record", _duration(s["wall_s"])),
        ("last step", str(s["last_step"])),
        ("final train loss", _fmt(s["final_loss"], ".4f")),
        ("best validation loss", best),
        ("mean tokens/s (all devices)", _fmt(s["mean_tokens_per_s"], ",.0f")),
        ("mean tokens/s per device", _fmt(s["mean_tokens_per_s_per_device"], ",.0f")),
        (
            "mean MFU (estimate: CPU peak measured on this machine)" if s["mfu_estimate"] else "mean MFU",
            _fmt(None if s["mean_mfu"] is None else 100 * s["mean_mfu"], ".1f", " %"),
        ),
        ("restarts", str(s["restarts"])),
        *([("restarts in place", str(s["restarts_in_place"]))] if s["restarts_in_place"] else []),
        *([("extended after finishing", str(s["extensions"]))] if s["extensions"] else []),
        ("SLURM job ids", ", ".join(s["job_ids"]) or "none (not run under SLURM)"),
        ("time lost to restarts", f"{_duration(s['lost_s'])} ({s['lost_steps']} steps recomputed)"),
    ]
    lines = [f"# Run report: {name}", "", "| | |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    lines += [
        "",
        "## Jobs",
        "",
        "| segment | job | nodes | first record | records | train steps | resumed from step |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for seg in history.segments:
        train = seg.train
        span = f"{train[0]['step']}-{train[-1]['step']}" if train else "none"
        first = datetime.datetime.fromtimestamp(seg.start_time).isoformat(sep=" ", timespec="seconds")
        resumed = seg.resume_step() if seg.index else None
        lines.append(
            f"| {seg.index} | {seg.label} | {'' if seg.nodes is None else seg.nodes} | {first} | "
            f"{len(seg.records)} | {span} | {'' if resumed is None else resumed}"
            f"{' (extended: train.max_steps raised)' if seg.extends_finished else ''}"
            f"{' (' + seg.resize_note + ')' if seg.resize_note else ''} |"
        )
    stops = [r for r in history.events if r.get("event") in ("stop", "finished")]
    if stops:
        lines += ["", "## Stops", "", "| job | step | event | reason | saved | requeue asked | exit code |"]
        lines.append("| --- | --- | --- | --- | --- | --- | --- |")
    for r in stops:
        notes = [f"requeue {r['restart']}"] if r.get("restart") else []
        notes += [f"restart in place {r['step_restart']}"] if r.get("step_restart") else []
        job = f"{r.get('job_id') or 'local'}" + (f" ({', '.join(notes)})" if notes else "")
        cells = [r.get(key) for key in ("reason", "saved", "requeue_requested", "exit_code")]
        row = [job, str(r["step"]), r["event"], *("" if c is None else str(c) for c in cells)]
        lines.append("| " + " | ".join(row) + " |")
    lines += straggler_lines(history)
    lines += [
        "",
        "Time lost to restarts: wall time between the last progress of one job and the next",
        "job's first new step, less that step's own compute time (queueing, startup, checkpoint",
        "load, recomputed steps). A run trained further after it finished (train.max_steps raised)",
        "is an extension: neither a restart nor lost time. Later records of a repeated step",
        "replace earlier ones.",
        "",
    ]
    lines += [*ledger_lines(ledger), ""]
    if history.skipped_lines:
        lines += [f"{history.skipped_lines} unreadable line(s) of metrics.jsonl were skipped.", ""]
    lines += ["## Plots", ""]
    if not images:
        lines += ["No training metrics: the program logs its own (docs/programs.md).", ""]
    for p in images:
        lines += [f"![{p.stem}]({p.name})", ""]
    return "\n".join(lines)


def make_report(run: RunDir, out_dir: Path | None = None) -> Path:
    """Write the plots and ``report.md`` to ``out_dir`` (default ``<run_dir>/report``)."""
    return write_report(run, out_dir)[0]


def written_line(report: Path, images: list[Path]) -> str:
    """What `relaytrain report` tells the user it wrote: the plots by name, or that there are none."""
    if not images:
        return (
            f"wrote {report}; no plots: the run logged no training metrics (a relaytrain.program run "
            f"records only its start, stop and finish events)"
        )
    names = ", ".join(p.name for p in images)
    return f"wrote {report} and {len(images)} plots in {report.parent}: {names}"


def write_report(run: RunDir, out_dir: Path | None = None) -> tuple[Path, list[Path]]:
    """Write the plots and ``report.md``; return report.md's path and the plots written."""
    run_dir = run.root
    if not run_dir.exists():
        raise UserError(f"run directory {run_dir} does not exist")
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a run directory (a file); pass a run's directory, e.g. runs/NAME")
    history = load_history(run)
    out_dir = Path(out_dir) if out_dir is not None else run.report
    name = run_dir.resolve().name
    out_dir.mkdir(parents=True, exist_ok=True)
    gpus = read_gpu_csvs(run.gpu)
    images = plot_all(history, gpus, name, out_dir) if history.train or gpus else []
    ranks = plot_rank_times(history, name, out_dir / "rank_times.png")
    images += [ranks] if ranks is not None else []
    # Slurm's Start..End of each job where accounting answers, else the run's own records bound them.
    ledger = run_ledger(run) if recorded_ledger(history) else None
    timeline = plot_ledger(ledger, name, out_dir / "ledger.png") if ledger is not None else None
    images += [timeline] if timeline is not None else []
    report = out_dir / "report.md"
    report.write_text(render_markdown(name, history, summarize(history), images, ledger), encoding="utf-8")
    return report, images
