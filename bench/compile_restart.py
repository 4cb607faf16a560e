"""A restart with `parallel.compile`: what the rank's kept compiled code (`compile/rank_<rank>.bin` in the run
directory) saves a process that starts on a node whose compile caches are empty (another node, a fresh
/tmp), against the same restart without the file.

    python -m bench.compile_restart [--no-write] [--section.key=value ...]
    python -m bench.compile_restart --page-from bench/results/compile-restart-<date>.json

Each variant runs the debug config twice, as a requeued job would: the first job trains steps 1..2 and
stops with a checkpoint (`train.stop_at_step`), the second is the same command and resumes; each job gets
its own empty Inductor cache folder (`TORCHINDUCTOR_CACHE_DIR`). `kept`: the second job finds the file the
first wrote; `none`: the file is removed before the second job (each process compiles everything, as
before the file existed). From metrics.jsonl: the first job's first step, the second job's `compile`
event (`cold`: graphs compiled from scratch; `cached`; `loaded`) and its first resumed step, and the
seconds from the second process's spawn to that step. Writes the `compile-restart` section of
docs/benchmarks.md and keeps the figures in bench/results/compile-restart-<UTC date and time>.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from relaytrain.job.rundir import RunDir

from bench import kept, startup
from bench.procs import WORK, events, read_metrics, run, shown, train_records
from bench.report import fmt, machine_info, python_command, table

MODULE = "bench.compile_restart"
SECTION = "compile-restart"
ORDER = ["startup", SECTION]
STOP_AT = startup.STOP_AT  # the first job stops there, the second resumes (startup.job_argv)
VARIANTS = {"kept": "the file kept", "none": "the file removed"}


def job(argv: list[str], threads: int, inductor: Path):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)  # read by bench_env's copy of the environment
    try:
        return run(argv, threads, timeout=1800)
    finally:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


def variant(key: str, extra: list[str], threads: int) -> dict:
    root = WORK / "compile-restart"
    shutil.rmtree(root / key, ignore_errors=True)
    runs, name = root / key / "runs", "debug"
    argv = startup.job_argv(runs, name, ["--parallel.compile=true", *extra])  # startup's two jobs
    # Each job's Inductor cache: an empty folder outside the repository (it holds generated Python)
    with tempfile.TemporaryDirectory(prefix="compile-restart-") as nodes:
        return _jobs(argv, threads, Path(nodes), runs / name, key == "none")


def _jobs(argv: list[str], threads: int, nodes: Path, run_dir: Path, remove_file: bool) -> dict:
    job(argv, threads, nodes / "node_a")
    cache = RunDir(run_dir).compile_cache(0)
    had_file = cache.is_file()
    if remove_file:
        cache.unlink(missing_ok=True)
    second = job(argv, threads, nodes / "node_b")
    records = read_metrics(run_dir)
    steps = train_records(records)
    first_step = next(r for r in steps if r["step"] == 1)
    resumed = next(r for r in steps if r["step"] == STOP_AT + 1)
    compiles = [e for e in events(records, "compile") if e["step"] > STOP_AT]
    return {
        "file_written": had_file,
        "file_bytes": cache.stat().st_size if cache.is_file() else 0,
        "first_job_first_step_s": first_step.get("time_step_s"),
        "resumed_first_step_s": resumed.get("time_step_s"),
        "spawn_to_resumed_step_s": resumed["time"] - second.start_unix,
        "compile_event": compiles[0] if compiles else None,
        "job_command": shown(argv),
    }


def render(data: dict) -> str:
    rows = []
    for key, label in VARIANTS.items():
        v = data["variants"][key]
        ev = v["compile_event"] or {}
        rows.append(
            (
                label,
                ev.get("cold", "-"),
                ev.get("cached", "-"),
                ev.get("loaded", "-"),
                fmt(v["resumed_first_step_s"]),
                fmt(v["spawn_to_resumed_step_s"]),
                fmt(v["first_job_first_step_s"]),
            )
        )
    m = data["machine"]
    lines = [
        "## Compiled code across a restart",
        "",
        f"{m['date']}, {m['cpu']} ({m['cores']} cores, load {m['load_start']} at the start), torch "
        f"{m['torch']}, commit {m['commit']}. Command: `{data['command']}`. Each variant: a first job "
        f"(steps 1..{STOP_AT}, stops with a checkpoint) and the same command again, which resumes; each job "
        "with its own empty Inductor cache folder, as on another node.",
        "",
        table(
            [
                "second job",
                "cold",
                "cached",
                "loaded",
                "first resumed step (s)",
                "spawn -> first resumed step (s)",
                "first job's first step (s)",
            ],
            rows,
        ).rstrip(),
        "",
        "cold: graphs Inductor compiled from scratch in the second job; cached: taken from its cache; loaded:"
        " artefacts read from `compile/rank_0.bin`. On a CPU a graph taken from the cache still builds its"
        " C++ kernels in an empty cache folder, which the first resumed step's time includes.",
        "",
        f"Job: `{data['variants']['kept']['job_command']}`",
        "",
    ]
    return "\n".join(lines) + "\n" + kept.rewritten(python_command(MODULE), kept.relative(data["kept"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--page-from", default="")
    args, extra = parser.parse_known_args(argv)
    if args.page_from:
        kept.rewrite_from(args.page_from, render, SECTION, ORDER, parser.error)
        return 0
    data = {"machine": machine_info(), "command": python_command(MODULE, extra), "threads": args.threads}
    data["variants"] = {key: variant(key, extra, args.threads) for key in VARIANTS}
    kept.keep_and_show("compile-restart", data, render, SECTION, ORDER, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
