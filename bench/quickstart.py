"""The README's first command, timed: `relaytrain train` on the embedded debug config, as a reader runs it.

    python -m bench.quickstart                    # one run; keeps bench/results/quickstart-<date>-<time>.json
    python -m bench.quickstart --page-from bench/results/quickstart-<date>-<time>.json ...   # the section

The run is `relaytrain train` with no config and no override but `--run.dir` (a temporary directory, so
the run starts fresh and tokenizes the bundled corpus as a first run does), in its own process with
`OMP_NUM_THREADS` = cores. The clock runs from spawning the process to its exit; the losses are read
from the run's metrics.jsonl: the train loss of the first and the last step and the last validation
loss. The README's sentence on the first command (`readme_figures`) states the latest kept run's steps
and losses (its time, which depends on the load, is on the page); tests/test_bench_pages.py requires it
word for word.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from bench import kept
from bench.procs import read_metrics, relaytrain_argv, run, train_records
from bench.report import load_average, machine_info, table, write_page

SECTION = "quickstart"
PREFIX = "quickstart-"
COMMAND = "relaytrain train"


def measure(threads: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        done = run(relaytrain_argv(["train", f"--run.dir={tmp}"]), threads, cwd=Path(tmp), timeout=3600)
        (metrics,) = Path(tmp).rglob("metrics.jsonl")  # the one run the command made, named by its config
        records = read_metrics(metrics.parent)
    train = train_records(records)
    evals = [r for r in records if r.get("kind") == "eval" and r.get("val_loss") is not None]
    return {
        "wall_s": round(done.wall_s, 1),
        "steps": train[-1]["step"],
        "first_loss": round(float(train[0]["loss"]), 3),
        "first_step": train[0]["step"],
        "last_loss": round(float(train[-1]["loss"]), 3),
        "last_val_loss": round(float(evals[-1]["val_loss"]), 3) if evals else None,
    }


def kept_runs() -> list[Path]:
    return sorted(kept.RESULTS_DIR.glob(f"{PREFIX}*.json"))


def readme_figures(data: dict, name: str) -> str:
    """The README's sentences on the first command's steps and losses, from one kept run (its time, which
    depends on the machine's load, is on docs/benchmarks.md beside the load)."""
    f, cores = data["figures"], data["machine"]["cores"]
    return (
        f"It runs {f['steps']} steps on the CPU, offline; the training loss falls from {f['first_loss']:.1f} "
        f"at step {f['first_step']} to {f['last_loss']:.1f} and the validation loss to "
        f"{f['last_val_loss']:.2f} (measured {data['date']} by `python -m bench.quickstart`, results: "
        f"{name}; its time on {cores} cores, with their load, is on docs/benchmarks.md)."
    )


def render(runs: list[dict], names: list[str]) -> str:
    header = ["results", "date", "machine (load average 1/5/15 min at the start -> end)", "wall (s)", "steps",
              "first train loss", "last train loss", "last validation loss"]  # fmt: skip
    rows = []
    for data, name in zip(runs, names, strict=True):
        m, f = data["machine"], data["figures"]
        ends = (m.get("load_start"), data.get("load_end"))
        loads = [" / ".join(str(x) for x in values or []) for values in ends]
        where = f"{m['cpu']}, {m['cores']} cores ({loads[0]} -> {loads[1]})"
        first = f"{f['first_loss']} (step {f['first_step']})"
        rows.append((f"`{name}`", data["date"], where, f["wall_s"], f["steps"], first, f["last_loss"],
                     f["last_val_loss"]))  # fmt: skip
    intro = (
        f"Rewritten from the kept results by `python -m bench.quickstart --page-from {' '.join(names)}`; "
        f"each run measured by `python -m bench.quickstart`: the README's first command, `{COMMAND}` on the "
        "embedded debug config in a fresh run directory (it tokenizes the bundled corpus first), timed from "
        "spawning the process to its exit, every kept run in order. The README states the last run's "
        "steps and losses (tests/test_bench_pages.py checks it). On a shared machine the wall time grows "
        "with the load; the losses do not depend on it."
    )
    body = ["## The README's first command", "", intro, "", table(header, rows).rstrip("\n")]
    return "\n".join(body) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page-from", nargs="+", help="only write the section, from these kept files")
    parser.add_argument("--threads", type=int, default=0, help="threads (default: cores)")
    args = parser.parse_args(argv)
    if args.page_from:
        runs = [kept.load(path) for path in args.page_from]
        write_page({SECTION: render(runs, [kept.relative(path) for path in args.page_from])})
        return 0
    machine = machine_info()
    figures = measure(args.threads or os.cpu_count() or 1)
    results = {
        "command": "python -m bench.quickstart",
        "runs": COMMAND,
        "date": machine["date"].split()[0],
        "machine": machine,
        "load_end": load_average(),
        "figures": figures,
    }
    path = kept.save(f"{PREFIX}{time.strftime('%Y-%m-%d-%H%M', time.gmtime())}.json", results)
    print(readme_figures(results, kept.relative(path)))
    print(f"kept: {kept.relative(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
