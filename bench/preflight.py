"""How far a clean node falls below the median in `relaytrain preflight`, the figures behind its default
thresholds (relaytrain.preflight.judge.Thresholds; docs/howto/preflight.md).

    python -m bench.preflight --runs 8                     # measure, keep, write the section
    python -m bench.preflight --page-from bench/results/preflight-DATE.json   # the section from kept results

Each run is `relaytrain preflight --nproc-per-node 2` on this machine (two gloo ranks that stand for two
nodes); a third of the runs have a busy neighbour: a process spinning on one core. Every rank's shortfall
below the median of compute (GEMM GFLOP/s) and network (all-reduce GB/s) is recorded, with the wall time
of the command. A threshold is sound when no clean run comes near it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import kept
from bench.report import median, write_page

SECTION = "preflight"
COMMAND = "python -m bench.preflight"


def _shortfalls(ranks: list[dict], key: str) -> list[float]:
    values = [r["figures"][key] for r in ranks]
    mid = median(values)
    return [max(0.0, (mid - v) / mid * 100) for v in values]


def one_run(busy: bool, budget: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            t0 = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "relaytrain.cli", "preflight", "--nproc-per-node", "2", "--budget",
                 str(budget), f"--run.dir={tmp}"], capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            wall = time.perf_counter() - t0
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
        (path,) = Path(tmp, "debug", "preflight").glob("*.json")
        record = json.loads(path.read_text())
    return {
        "busy_neighbour": busy,
        "exit": done.returncode,
        "wall_s": wall,
        "checks_s": record["seconds"],
        "compute_below_median_pct": max(_shortfalls(record["ranks"], "gflops")),
        "network_below_median_pct": max(_shortfalls(record["ranks"], "gbps")),
        "gflops": [r["figures"]["gflops"] for r in record["ranks"]],
        "gbps": [r["figures"]["gbps"] for r in record["ranks"]],
    }


def render(data: dict, path: str) -> str:
    rows = []
    for busy in (False, True):
        runs = [r for r in data["runs"] if r["busy_neighbour"] == busy]
        if not runs:
            continue
        compute = [r["compute_below_median_pct"] for r in runs]
        network = [r["network_below_median_pct"] for r in runs]
        named = sum(1 for r in runs if r["exit"] != 0)
        checks, wall = median([r["checks_s"] for r in runs]), median([r["wall_s"] for r in runs])
        kind = "busy neighbour" if busy else "clean"
        cells = [
            kind,
            len(runs),
            f"{max(compute):.1f}",
            f"{max(network):.1f}",
            f"{checks:.1f}",
            f"{wall:.1f}",
            named,
        ]
        rows.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return (
        "## Preflight: a clean node against the median\n\n"
        f"{kept.rewritten(COMMAND, path)}\n"
        f"Measured {data['date']} with `{data['command']}`: two gloo ranks on this machine, each standing "
        f"for a node, budget {data['budget']} s. {thresholds_prose(data['thresholds'])}\n\n"
        "| runs | count | worst compute shortfall (%) | worst network shortfall (%) | checks median (s) "
        "| command median (s) | runs that named a node |\n| --- | --- | --- | --- | --- | --- | --- |\n"
        + "\n".join(rows)
        + "\n"
    )


def thresholds_prose(measured: dict) -> str:
    """The thresholds relaytrain ships (judge.Thresholds), and those the kept runs were judged with (their
    last column) where they differ."""
    from relaytrain.preflight.judge import Thresholds

    now = Thresholds().as_dict()
    text = (
        f"The thresholds: {now['compute_pct']:g} % below the median in compute and {now['network_pct']:g} % "
        "below it in network."
    )
    if (measured.get("compute_pct"), measured.get("network_pct")) != (now["compute_pct"], now["network_pct"]):
        text += (
            f" These runs were judged with {measured.get('compute_pct', '?'):g} % and "
            f"{measured.get('network_pct', '?'):g} % (the last column)."
        )
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--budget", type=float, default=1.0)
    parser.add_argument("--page-from", help="write the page's section from this kept results file")
    args = parser.parse_args(argv)
    if args.page_from:
        write_page({SECTION: render(kept.load(args.page_from), kept.relative(args.page_from))})
        return 0
    from relaytrain.preflight.judge import Thresholds

    runs = [one_run(busy=i % 3 == 2, budget=args.budget) for i in range(args.runs)]
    data = {
        "command": f"{COMMAND} --runs {args.runs} --budget {args.budget:g}",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "budget": args.budget,
        "thresholds": Thresholds().as_dict(),
        "runs": runs,
    }
    name = f"preflight-{time.strftime('%Y-%m-%d-%H%M', time.gmtime())}.json"
    path = kept.relative(kept.save(name, data))
    write_page({SECTION: render(data, path)})
    print(render(data, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
