"""`python -m bench.fault_matrix`: every fault kind once on real Slurm, and whether the job was restarted,
requeued or stopped, as it should be.

    python -m bench.fault_matrix                         # every kind; writes the "fault-matrix" section
    python -m bench.fault_matrix --kinds shape_error,rank_killed --no-write
    python -m bench.fault_matrix --page-from A.json B.json   # the section from kept results, in run order

The faults of the machines (a rank killed, a node lost, its slurmd killed, a hang, a full snapshot
directory, a preemption, the time limit) must cost a restart in place or a requeue (or nothing) and at
most one step with snapshots on, never the job; the faults of the user (an import error, a shape error at
step k, a NaN at step k, the only checkpoint damaged, an impossible config) must stop the job with the
cause named after at most one reproduction, never requeued in a loop. Per fault: the decision, the restarts
and requeues it cost, the time from the fault to the decision, the steps lost, the verdict
(bench/cluster/fault_matrix_judge.py; the trials: bench/cluster/fault_matrix_kinds.py).

Each run keeps its results in bench/results/fault-matrix-<date>.json (bench/kept.py) and writes its section
from that file, as `--page-from` does. It holds /tmp/relaytrain-slurm.lock (the cluster is shared) for the
whole run (`--no-lock`: the caller holds it); up to `--parallel` kinds share the cluster at once, the kinds
that take a node down or fill its memory run alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from bench import kept
from bench.cluster.fault_matrix_judge import KINDS, summary
from bench.cluster.fault_matrix_kinds import EXCLUSIVE, FaultMatrix
from bench.cluster.fault_matrix_page import SECTION, render_section
from bench.cluster.harness import OUT_ROOT, cluster_lock, load_averages, start_cluster
from bench.report import machine_info, write_page

OUT = OUT_ROOT / "fault-matrix"


def parse_kinds(text: str) -> list[str]:
    if text == "all":
        return list(KINDS)
    kinds = [k for k in text.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        named = ", ".join(unknown) or repr(text)
        raise ValueError(f"no fault kind {named}; choose all or of {', '.join(KINDS)}")
    return kinds


def main(argv: list[str] | None = None) -> int:
    summary_line = __doc__.split("\n\n")[0]
    parser = argparse.ArgumentParser(prog="python -m bench.fault_matrix", description=summary_line)
    parser.add_argument("--kinds", default="all", help=f"all, or of {','.join(KINDS)}")
    parser.add_argument("--parallel", type=int, default=3, help="kinds run at once (the shareable ones)")
    parser.add_argument("--no-write", action="store_true", help="keep the results, leave the page alone")
    parser.add_argument("--no-lock", action="store_true", help="the caller holds the cluster lock already")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument(
        "--page-from",
        nargs="+",
        metavar="KEPT_JSON",
        help="write the section from kept results files, in run order (a kind's last trial counts)",
    )
    args = parser.parse_args(argv)
    if args.page_from:
        try:
            section = render_section(args.page_from)
        except (ValueError, TypeError, KeyError) as err:
            parser.error(f"--page-from: {err}")
        print(section)
        write_page({SECTION: section})
        return 0
    try:
        kinds = parse_kinds(args.kinds)
    except ValueError as err:
        parser.error(f"--kinds: {err}")
    if args.parallel < 1:
        parser.error("--parallel: at least 1")
    command = "python -m bench.fault_matrix " + " ".join(argv if argv is not None else sys.argv[1:])
    base = Path(args.out) / f"run-{int(time.time())}"
    base.mkdir(parents=True, exist_ok=True)
    now = datetime.now(UTC)
    keep = f"fault-matrix-{now:%Y-%m-%d-%H%M}.json"
    load = [os.getloadavg()]
    info = start_cluster(lock=not args.no_lock)
    matrix = FaultMatrix(base, info)
    shared = [k for k in kinds if k not in EXCLUSIVE]
    alone = [k for k in kinds if k in EXCLUSIVE]
    with cluster_lock(not args.no_lock):
        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            trials = list(pool.map(matrix.run, shared))
        trials += [matrix.run(kind) for kind in alone]
    order = {k: i for i, k in enumerate(KINDS)}
    trials.sort(key=lambda t: order[t.kind])
    for trial in trials:
        print(f"bench.fault_matrix: {json.dumps(asdict(trial))}", flush=True)
    machine = machine_info()
    data = {
        "command": command.strip(),
        "date": str(now.date()),
        "cpu": machine.get("cpu", "?"),
        "cores": machine.get("cores", "?"),
        "load": load_averages([*load, os.getloadavg()]),
        "summary": summary(trials),
        "trials": [asdict(t) for t in trials],
    }
    kept.save(keep, data)
    (base / "results.json").write_text(json.dumps(data, indent=1))
    section = render_section(keep)
    print(section)
    if not args.no_write:
        write_page({SECTION: section})
    return 0 if all(t.right for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
