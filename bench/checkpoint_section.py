"""The runner's checkpoint I/O figures: runs bench/checkpoint_io.py and judges them against the targets.

The page's "Checkpoint I/O" section (block ``checkpoint-io``) is the checkpoint work's analysis and is
kept as written; this module's block (``checkpoint-io-run``) follows it with the figures of the last run.

bench/checkpoint_io.py (owned by the checkpoint work) prints a Markdown table and, last, one JSON line with
``checkpoint_bytes``, ``disk_write_Bps``, ``disk_read_Bps`` and the best times ``sync_save``,
``async_block``, ``async_total``, ``load`` in seconds (and, since the CPU accounting, ``async_idle_total``,
``load_unverified``, ``fresh_read_Bps``, ``cpu_s``, ``cores``). This module runs it RUNS times as separate
processes, each once the machine's 1-minute load average is below MAX_LOAD (the issue's condition; the
disk and the cores are shared), and adds the verdicts per run: save and load throughput >= 80% of the
disk's sequential write/read speed measured in the same run, async save blocking <= 10% of a sync save and
committed within 1.2x its time. Where a target is missed the page also shows the measured floor it is up
against: the uncached read into fresh memory for a load, and for an async save the CPU seconds of the
write and of the training step running beside it on the machine's cores.
"""

from __future__ import annotations

import json
import os
import pstats
import sys
import time

from bench.procs import WORK, run, shown
from bench.report import REPO, fmt, table

SCRIPT = REPO / "bench" / "checkpoint_io.py"
QUICK_ARGS = ["--dim=384", "--layers=4", "--vocab=4096", "--repeats=1"]  # its n_heads is 12
PROFILED_PATHS = (
    "relaytrain/checkpoint/",
    "torch/distributed/checkpoint/",
    "torch/serialization",
    "safetensors",
)
PROFILED_BUILTINS = ("fsync", "write", "read", "pickle", "copy_", "rename", "replace")
THROUGHPUT_TARGET = 0.80
BLOCKING_TARGET = 0.10
ASYNC_TOTAL_TARGET = 1.20
RUNS = 3  # the issue asks for three runs
MAX_LOAD = 1.5  # ... each at a 1-minute load average under 1.5


def available() -> bool:
    return SCRIPT.exists()


def argv_for(quick: bool) -> list[str]:
    return [sys.executable, str(SCRIPT), f"--dir={WORK / 'checkpoint_io'}", *(QUICK_ARGS if quick else [])]


def wait_for_quiet(max_load: float, patience_s: float, poll_s: float = 10.0) -> float:
    """Wait until the 1-minute load average is below `max_load` (at most `patience_s`); return it."""
    deadline = time.monotonic() + patience_s
    while os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        time.sleep(poll_s)
    return os.getloadavg()[0]


def measure(
    quick: bool = False,
    threads: int | None = None,
    profile: bool = True,
    runs: int | None = None,
    max_load: float = MAX_LOAD,
    patience_s: float = 900.0,
) -> dict:
    threads = threads or os.cpu_count() or 1
    argv = argv_for(quick)
    result: dict = {"command": shown(argv), "max_load": max_load, "runs": [], "profile": None}
    for _ in range(runs or (1 if quick else RUNS)):
        load = wait_for_quiet(max_load, 0.0 if quick else patience_s)
        out = run(argv, threads, timeout=1800).stdout
        lines = out.strip().splitlines()
        numbers = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
        markdown = "\n".join(lines[:-1] if numbers is not None else lines).strip()
        result["runs"].append({"markdown": markdown, "numbers": numbers, "load_start": load})
    if profile:
        result["profile"] = profile_saves(threads)
    return result


def profile_saves(threads: int) -> dict:
    """cProfile one small run of the script: where save and load spend their (main-thread) time."""
    stats_path = WORK / "checkpoint_io.pstats"
    argv = [sys.executable, "-m", "cProfile", "-o", str(stats_path), *argv_for(True)[1:]]
    run(argv, threads, timeout=1800)
    stats = pstats.Stats(str(stats_path))
    rows = []
    for (filename, _line, func), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():
        path = filename.replace(os.sep, "/")
        if filename == "~":
            if not any(word in func for word in PROFILED_BUILTINS):
                continue
            name = func.strip("<>").replace("built-in method ", "").replace("method ", "")
        elif any(part in path for part in PROFILED_PATHS) and func not in ("<module>", "__getattr__"):
            module = path.rsplit("/site-packages/", 1)[-1].rsplit("/src/", 1)[-1].removesuffix(".py")
            name = f"{module.replace('/', '.')}.{func}"
        else:
            continue
        rows.append({"function": name, "calls": ncalls, "cum_s": cumtime, "self_s": tottime})
    rows.sort(key=lambda r: r["cum_s"], reverse=True)
    stats_path.unlink(missing_ok=True)
    return {"command": shown(argv).replace(str(stats_path), "checkpoint_io.pstats"), "functions": rows[:15]}


def judge(n: dict) -> list[tuple[str, float, str, bool]]:
    """(what, measured ratio, target, met) for each checkpoint target."""
    size = n["checkpoint_bytes"]
    rows = []
    for label, seconds, disk in (
        ("sync save throughput / disk write", n.get("sync_save"), n.get("disk_write_Bps")),
        (
            "async save throughput (to committed) / disk write",
            n.get("async_total"),
            n.get("disk_write_Bps"),
        ),
        ("load throughput / disk read", n.get("load"), n.get("disk_read_Bps")),
    ):
        if seconds and disk:
            ratio = size / seconds / disk
            rows.append((label, ratio, "≥ 80%", ratio >= THROUGHPUT_TARGET))
    if n.get("async_block") is not None and n.get("sync_save"):
        ratio = n["async_block"] / n["sync_save"]
        rows.append(("async save blocking time / sync save time", ratio, "≤ 10%", ratio <= BLOCKING_TARGET))
    if n.get("async_total") is not None and n.get("sync_save"):
        ratio = n["async_total"] / n["sync_save"]
        rows.append(
            ("async save until committed / sync save time", ratio, "≤ 120%", ratio <= ASYNC_TOTAL_TARGET)
        )
    return rows


def floors(n: dict) -> list[tuple[str, float]]:
    """(what, ratio) of each figure against what this machine allows at best, where measured.

    A load cannot beat reading the same bytes uncached into fresh memory (a resuming process faults in
    every page it loads into). An async save whose write runs beside a training step on saturated cores
    cannot commit sooner than the CPU seconds of both divided by the cores; with the trainer idle (as on
    a GPU, where the step does not use the cores) it is judged against the sync save directly."""
    size, cpu, rows = n["checkpoint_bytes"], n.get("cpu_s") or {}, []
    if n.get("load") and n.get("fresh_read_Bps"):
        rows.append(
            ("load time / floor (uncached read into fresh memory)", n["load"] * n["fresh_read_Bps"] / size)
        )
    if n.get("load_unverified") and n.get("load"):
        rows.append(
            ("load time, checkpoint.verify = false / with checksums", n["load_unverified"] / n["load"])
        )
    if n.get("async_idle_total") and n.get("sync_save"):
        rows.append(
            ("async save until committed, trainer idle / sync save", n["async_idle_total"] / n["sync_save"])
        )
    if n.get("async_total") and "sync_save" in cpu and "train_step" in cpu and n.get("cores"):
        bound = (cpu["sync_save"] + cpu["train_step"]) / n["cores"]
        rows.append(
            (
                "async save until committed / CPU floor ((sync save + step CPU s) / cores)",
                n["async_total"] / bound,
            )
        )
    return rows


def _runs(result: dict) -> list[dict]:
    if "runs" in result:
        return [r for r in result["runs"] if r.get("numbers")]
    return (
        [{"markdown": result.get("markdown", ""), "numbers": result["numbers"]}]
        if result.get("numbers")
        else []
    )


def render(result: dict) -> str:
    out = "### Checkpoint I/O in the last `python -m bench` run\n\n"
    out += (
        "The runner's own run of the checkpoint benchmark, judged against the targets (the analysis above "
        "is the checkpoint work's, from its own runs).\n\n"
    )
    runs = _runs(result)
    gate = (
        f", each started once the 1-minute load average was below {result['max_load']:g}"
        if "max_load" in result
        else ""
    )
    out += f"Command: `{result['command']}` ({len(runs)} run{'s' if len(runs) != 1 else ''}{gate}).\n\n"
    if len(runs) == 1:
        out += runs[0]["markdown"] + "\n"
    elif runs:
        out += f"The last run's output:\n\n{runs[-1]['markdown']}\n"
    if runs:
        header = ["figure", "target", *(f"run {i + 1}" for i in range(len(runs))), "verdict"]
        judged = [judge(r["numbers"]) for r in runs]
        rows = []
        for k, (label, _ratio, target, _met) in enumerate(judged[0]):
            mets = [j[k][3] for j in judged]
            tally = f" ({sum(mets)} of {len(mets)})" if len(mets) > 1 else ""
            word = "met" if all(mets) else "missed"
            rows.append((label, target, *(f"{100 * j[k][1]:.0f}%" for j in judged), f"**{word}**{tally}"))
        loads = ", ".join(f"{r['load_start']:.1f}" for r in runs if "load_start" in r)
        out += (
            "\nTargets"
            + (f" (1-minute load average at each run's start: {loads})" if loads else "")
            + ":\n\n"
        )
        out += table(header, rows)
        missed = [row[0] for row in rows if "missed" in row[-1]]
        if missed:
            size = runs[0]["numbers"]["checkpoint_bytes"]
            out += f"\nMissed: {'; '.join(missed)} (checkpoint of {fmt(size / 1e6)} MB).\n"
        measured = [dict(floors(r["numbers"])) for r in runs]
        labels = list(dict.fromkeys(label for m in measured for label in m))
        if labels:
            out += (
                "\nThe same figures against what this machine allows at best, as time ratios (1.00: at the "
                "floor; above: slower), and what the checksum comparison costs a load:\n\n"
            )
            out += table(
                ["figure", *(f"run {i + 1}" for i in range(len(runs)))],
                [(label, *(f"{m[label]:.2f}" if label in m else "–" for m in measured)) for label in labels],
            )
    prof = result.get("profile")
    if prof and prof["functions"]:
        out += (
            "\nWhere the script's saves and loads spend their time (cProfile of the small configuration, "
            "main thread only: an async save's background writing is not in it; seconds over the whole "
            f"run): `{prof['command']}`\n\n"
        )
        out += table(
            ["function", "calls", "cumulative s", "self s"],
            [
                (f"`{r['function']}`", r["calls"], fmt(r["cum_s"]), fmt(r["self_s"]))
                for r in prof["functions"]
            ],
        )
    return out
