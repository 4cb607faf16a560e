"""Clean job starts on the local Slurm cluster with `resilience.preflight = "exclude"`, beside a busy
neighbour: does the check before the first step leave out a node that nothing slowed?

    python -m bench.preflight_starts --starts 10 --out bench/out/preflight-starts/a
    python -m bench.preflight_records bench/out/preflight-starts/a ... --section preflight-starts \\
        --describe TEXT

Submits STARTS training jobs of the tests' tiny model at once (2 nodes, 1 task each, 2 steps, checkpoints
on, so that the storage probe runs too) with `--resilience.preflight=exclude`, while one process spins on
a core of the machine, and waits until every job has ended. Each job's run directory is under OUT; a node
the checks name is left out (the job restarts its step or requeues, which its preflight records show),
so every named node of a clean start is a false exclusion. Prints each job's end state. The records are
read, kept and put on the page by `bench.preflight_records` (one or more OUT folders at once), with the
false exclusions' count and each phase's seconds.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from bench.cluster import harness


def submit(config: Path, name: str, nodes: int) -> str:
    out = harness.relaytrain(
        "launch", str(config), "--nodes", str(nodes), "--tasks-per-node", "1", f"--run.name={name}",
        "--resilience.preflight=exclude",
    )  # fmt: skip
    match = re.search(r"submitted job (\d+)", out)
    if not match:
        raise RuntimeError(f"no job id in: {out}")
    return match.group(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=10, help="jobs to start")
    parser.add_argument("--nodes", type=int, default=2, help="nodes per job")
    parser.add_argument("--out", type=Path, required=True, help="a new folder for the jobs' run directories")
    parser.add_argument("--no-lock", action="store_true", help="the caller holds the cluster lock")
    args = parser.parse_args(argv)
    if args.starts < 1 or args.nodes < 2:
        parser.error("--starts must be at least 1 and --nodes at least 2 (one node has no median)")
    if args.out.exists():
        parser.error(f"--out {args.out} exists: name a new folder")
    runs = args.out.resolve()
    runs.mkdir(parents=True)
    config = harness.write_config(runs / "start.toml", "start", runs, steps=2, eval_every=100, interval=100)
    with harness.cluster_lock(not args.no_lock):
        harness.start_cluster(lock=False)
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # the busy neighbour
        try:
            jobs = {f"start{i:02d}": submit(config, f"start{i:02d}", args.nodes) for i in range(args.starts)}
            ends = {
                name: harness.wait_job_end(job, timeout=300 + 60 * args.starts) for name, job in jobs.items()
            }
        finally:
            hog.kill()
    for name, fields in ends.items():
        print(f"{name} job {jobs[name]}: {fields.get('JobState')} restarts {fields.get('Restarts')}")
    bad = [name for name, fields in ends.items() if fields.get("JobState") != "COMPLETED"]
    print(
        f"{len(ends) - len(bad)} of {len(ends)} jobs completed" + (f"; not: {', '.join(bad)}" if bad else "")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
