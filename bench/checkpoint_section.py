"""The runner's checkpoint I/O figures: runs bench/checkpoint_io.py and judges them against the targets.

The page's "Checkpoint I/O" section (block ``checkpoint-io``) is the checkpoint work's analysis and is
kept as written; this module's block (``checkpoint-io-run``) follows it with the figures of the last run.

bench/checkpoint_io.py (owned by the checkpoint work) prints a Markdown table and, last, one JSON line with
``checkpoint_bytes``, ``disk_write_Bps``, ``disk_read_Bps`` and the best times ``sync_save``,
``async_block``, ``async_total``, ``load`` in seconds. This module runs it as its own process, keeps its
table, and adds the verdicts: save and load throughput >= 80% of the disk's sequential write/read speed
measured in the same run, async save blocking <= 10% of a sync save and committed within 1.2x its time.
"""

from __future__ import annotations

import json
import os
import pstats
import sys

from bench.procs import WORK, run, shown
from bench.report import REPO, fmt, table, verdict

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


def available() -> bool:
    return SCRIPT.exists()


def argv_for(quick: bool) -> list[str]:
    return [sys.executable, str(SCRIPT), f"--dir={WORK / 'checkpoint_io'}", *(QUICK_ARGS if quick else [])]


def measure(quick: bool = False, threads: int | None = None, profile: bool = True) -> dict:
    threads = threads or os.cpu_count() or 1
    argv = argv_for(quick)
    out = run(argv, threads, timeout=1800).stdout
    lines = out.strip().splitlines()
    numbers = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    markdown = "\n".join(lines[:-1] if numbers is not None else lines).strip()
    result = {"command": shown(argv), "markdown": markdown, "numbers": numbers, "profile": None}
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


def render(result: dict) -> str:
    out = "### Checkpoint I/O in the last `python -m bench` run\n\n"
    out += (
        "The runner's own run of the checkpoint benchmark, judged against the targets (the analysis above "
        "is the checkpoint work's, from its own runs).\n\n"
    )
    out += f"Command: `{result['command']}`\n\n"
    out += result["markdown"] + "\n"
    n = result.get("numbers")
    if n:
        rows = judge(n)
        out += "\nTargets:\n\n"
        out += table(
            ["figure", "measured", "target", "verdict"],
            [
                (label, f"{100 * r:.0f}%", target, verdict(met, target).split(": ", 1)[1])
                for label, r, target, met in rows
            ],
        )
        missed = [label for label, _r, _t, met in rows if not met]
        if missed:
            out += f"\nMissed: {'; '.join(missed)} (checkpoint of {fmt(n['checkpoint_bytes'] / 1e6)} MB).\n"
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
