"""`python -m bench.goodput`: how much of the allocated time a preempted or time-limited run spends training.

    python -m bench.goodput --intervals 60,180     # writes its section of docs/benchmarks.md
    python -m bench.goodput --quick --no-write      # the run preempted once, 40 s in, alone: a short run
    python -m bench.goodput --only time-limit       # chosen runs only; no page
    python -m bench.goodput --page-from A.json B.json --note "..."  # the page from saved results
    python -m bench.goodput --crashes --crash-interval 30 --steps 300  # restart in place vs requeue
    python -m bench.goodput --extrapolation         # only the goodput-extrapolation section (kept inputs)
    python -m bench.goodput --crash-page-from bench/results/goodput-crash-2026-11-24.json  # from kept results

Each invocation saves results.json (its command, date, load averages and runs) in its own directory
under bench/out/goodput, and but for --quick keeps it in bench/results/goodput-<date>.json (the crash
runs: goodput-crash-<date>.json); --page-from renders the union of several such files, each with its
command.

On the local Slurm cluster (`relaytrain cluster up`) a tiny 2-rank run (steps slowed to STEP_DELAY_S so a
run lasts minutes) runs uninterrupted, preempted every T seconds (a job on the `high` partition takes its
node; PreemptMode=REQUEUE), and cut by `--time=1` limits (USR2 30 s ahead; see TIME_LIMIT). Per run:

* goodput = productive time / allocated time, both the run's time ledger's (`relaytrain status RUN
  --json`): productive its `productive` bucket (each step's time counted once, a replayed step's in
  `replayed`), allocated the sum of each job run's Start..End from sacct. The ledger's seconds per bucket
  are kept per run (`ledger`) and shown under the table.
* steps lost per interruption: the replayed steps (train records beyond one per step) / interruptions.
* signal -> exit: the first step boundary after the signal (the stop step's train record) to the run's End
  (sacct: whole seconds), split into the save (up to the `stop` event, which the trainer logs after its
  save) and the exit (the event to End).
* requeue -> first resumed step: the run's End to the next run's first train record, split into queue
  (End -> next Start), start-up (Start -> `resume` event, less the load) and load (`resuming from` log line
  -> `resume` event; the log has 1 s resolution).

The figures come from goodput_results.py, the section from goodput_page.py; the 7B extrapolation
(goodput_extrapolation.py) uses the formula printed on the page, with a sensitivity grid.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

import faults
from bench import kept
from bench.cluster.goodput_crash import CRASH_RUNS, losses_match, render_crashes, run_crashes, summary
from bench.cluster.goodput_crash_extrapolation import render_extrapolation
from bench.cluster.goodput_extrapolation import EXTRAPOLATION_SECTION, Extrapolation
from bench.cluster.goodput_page import CKPT_INTERVAL, STEP_DELAY_S, render
from bench.cluster.goodput_results import (
    ResultsFile,
    RunResult,
    analyse,
    ended_runs,
    load_results,
    merge_results,
    save_results,
)
from bench.cluster.harness import (
    LOCK,
    OUT_ROOT,
    RunFiles,
    cluster_lock,
    launch,
    load_averages,
    preempt,
    scontrol_job,
    start_cluster,
    wait_job_end,
    write_config,
)
from bench.report import machine_info, write_page

OUT = OUT_ROOT / "goodput"
ORDER = ("goodput", EXTRAPOLATION_SECTION)  # the measured runs, then the extrapolation of its own
RUN_NAMES_HELP = "uninterrupted, preempt-<T>s for each of --intervals, time-limit"


class Runner:
    """``preemptions``: at most this many preemptions a run (0: every interval until the run ends); each of
    so few waits, past its interval, for the run to be training in its current allocation, so that it
    interrupts training rather than a start-up, which records no stop."""

    def __init__(self, base: Path, cluster, steps: int, preemptions: int = 0):
        self.base, self.cluster, self.steps, self.preemptions = base, cluster, steps, preemptions
        self.runs = base / "runs"
        self.config = write_config(base / "goodput.toml", "goodput", self.runs, steps, 0, CKPT_INTERVAL)

    def preempt_every(self, job: str, interval: float, stop: threading.Event, run: RunFiles) -> None:
        done = 0
        while not stop.wait(interval) and (not self.preemptions or done < self.preemptions):
            while self.preemptions and not stop.is_set() and not training(job, run):
                stop.wait(2.0)
            if not stop.is_set() and scontrol_job(job).get("JobState") == "RUNNING":
                preempt(job, self.cluster.cpus_per_node, hold_s=1)
                done += 1

    def run(self, result: RunResult, interval: float = 0.0, *overrides: str) -> None:
        run = RunFiles(self.runs / result.name)
        try:
            setup = faults.setup_line(step_delay_s=STEP_DELAY_S)
            result.job = launch(self.config, result.name, setup, *overrides)
            stop = threading.Event()
            thread = threading.Thread(
                target=self.preempt_every, args=(result.job, interval, stop, run), daemon=True
            )
            if interval:
                thread.start()
            wait_job_end(result.job, 3600, interval=2.0)
            stop.set()
            analyse(result, run, ended_runs(result.job), run.job_log())
            state = run.state()
            result.final = f"{state.get('status')} ({state.get('reason')}) at step {state.get('step')}"
            if state.get("status") != "finished" or state.get("step") != self.steps:
                result.error = f"the run did not finish: {result.final}"
        except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as err:
            result.error = str(err)[:300]


def training(job: str, run: RunFiles) -> bool:
    """Whether the job runs and its run has logged a step in this allocation (Slurm's restart count)."""
    fields = scontrol_job(job)
    restart = int(fields.get("Restarts") or 0)
    return fields.get("JobState") == "RUNNING" and any(
        r.get("restart") == restart for r in run.records("train")
    )


# The time-limit run: a 1-minute limit, Slurm's --signal 30 s ahead. resilience.time_budget_margin_s
# (300 s by default) would stop every 1-minute job after its first step, before the signal comes: 0 lets
# the signal stop it, which is the path this run measures.
TIME_LIMIT = (
    "--slurm.time=00:01:00",
    "--resilience.signal_lead_s=30",
    "--resilience.hard_deadline_s=20",
    "--resilience.time_budget_margin_s=0",
)
DEFAULT_MAX_REQUEUES = 20
# Slurm sends --signal up to 60 s early (its time-limit check is periodic): measured here, a 1-minute job
# with a 30 s lead got USR2 with 33-47 s left, so it trained 8-30 steps (~0.6 s each) after its start-up.
MIN_STEPS_PER_JOB = 5


def time_limit_overrides(steps: int) -> tuple[str, ...]:
    """TIME_LIMIT, plus a higher resilience.max_requeues where the default (20) could end the run early."""
    jobs = -(-steps // MIN_STEPS_PER_JOB)
    return TIME_LIMIT + ((f"--resilience.max_requeues={2 * jobs}",) if jobs > DEFAULT_MAX_REQUEUES else ())


def planned_runs(intervals: list[float], time_limit: bool, steps: int) -> list[RunResult]:
    runs = [RunResult("uninterrupted", "none")]
    runs += [RunResult(f"preempt-{t:g}s", f"preempted every {t:g} s") for t in intervals]
    if time_limit:
        extra = [o for o in time_limit_overrides(steps) if o not in TIME_LIMIT]
        cap = f", {extra[0].removeprefix('--resilience.')}" if extra else ""
        runs.append(RunResult("time-limit", f"time limit 1 min, USR2 30 s ahead{cap}"))
    return runs


# --quick's run: its one preemption, 40 s after the job is submitted (or later, once the run trains: a
# start-up slower than that on a loaded machine), lands before 80 steps of 0.5 s can finish (at most about
# 64 after a start-up of 8 s); the requeued run then trains to the end. Every further preemption would only
# add another requeue's minute to the tests' time.
QUICK_STEPS = 80
QUICK_PREEMPTIONS = 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.goodput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--intervals", default="60,180", help="preempt every T seconds, comma-separated")
    parser.add_argument("--steps", type=int, default=600, help="steps per run (0.5 s each)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"the run preempted once, 40 s in, {QUICK_STEPS} steps (a check of the harness, no figure)",
    )
    parser.add_argument("--no-time-limit", action="store_true")
    parser.add_argument(
        "--only", default="", metavar="RUNS", help=f"comma-separated runs to do ({RUN_NAMES_HELP}); "
        "writes no page (merge the results with --page-from)"
    )  # fmt: skip
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--no-lock", action="store_true", help=f"the caller holds {LOCK} already")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument(
        "--page-from", nargs="+", metavar="RESULTS_JSON",
        help="write the page from saved results files: the union of their runs (a run measured again in "
        "a later file replaces the earlier), each file's command and load",
    )  # fmt: skip
    parser.add_argument("--note", action="append", default=[], help="a paragraph to add (--page-from)")
    parser.add_argument(
        "--crashes", action="store_true",
        help="instead: an uninterrupted run, then rank 1 SIGKILLed every --crash-interval s with every crash "
        "requeued, restarted in place, and in place with snapshots (bench/cluster/goodput_crash.py); its own "
        "section of the page",
    )  # fmt: skip
    parser.add_argument("--crash-interval", type=float, default=30.0, help="seconds between kills")
    parser.add_argument(
        "--crash-page-from", metavar="KEPT_JSON",
        help="write the crash section from a kept results file (bench/results/goodput-crash-*.json)",
    )  # fmt: skip
    parser.add_argument(
        "--extrapolation", action="store_true",
        help="rewrite only the 7B extrapolation of the goodput section on the page (its inputs changed); "
        "the measured runs above it stay as they are",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.crash_page_from:
        try:
            section = render_crashes(kept.load(args.crash_page_from), kept.relative(args.crash_page_from))
        except (ValueError, KeyError, TypeError) as err:
            parser.error(f"--crash-page-from: {args.crash_page_from}: {err}")
        write_page({"goodput-crash": section})
        return 0
    if args.extrapolation:
        try:
            extrapolation = render_extrapolation(Extrapolation())
        except (ValueError, KeyError) as err:  # a kept results file it reads is missing or incomplete
            parser.error(f"--extrapolation: {err}")
        write_page({EXTRAPOLATION_SECTION: extrapolation}, ORDER)
        return 0
    if args.page_from:
        try:
            files = [load_results(Path(path)) for path in args.page_from]
        except (OSError, ValueError, TypeError) as err:
            parser.error(f"--page-from: {err}")
        section = render(merge_results(files), machine_info(), args.note)
        write_page({"goodput": section, EXTRAPOLATION_SECTION: render_extrapolation(Extrapolation())}, ORDER)
        print(section)
        return 0
    command = "python -m bench.goodput " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.crashes:
        return crash_comparison(args, command.strip())
    intervals = [40.0] if args.quick else [float(t) for t in args.intervals.split(",") if t]
    steps = QUICK_STEPS if args.quick else args.steps
    results = planned_runs(intervals, not (args.quick or args.no_time_limit), steps)
    if args.quick:  # a check of the harness: the preempted run exercises all of it, the reference none
        results = [r for r in results if r.name != "uninterrupted"]
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in {r.name for r in results}]
        if unknown:
            names = ", ".join(r.name for r in results)
            parser.error(f"--only: no run named {', '.join(unknown)}; runs: {names}")
        results = [r for r in results if r.name in wanted]
    base = Path(args.out) / f"run-{int(time.time())}"
    base.mkdir(parents=True, exist_ok=True)
    saved = ResultsFile(command=command.strip(), date=str(datetime.now(UTC).date()), runs=results)
    load = [os.getloadavg()]
    info = start_cluster(lock=not args.no_lock)
    runner = Runner(base, info, steps, QUICK_PREEMPTIONS if args.quick else 0)
    for r in results:  # one hold of the shared cluster's lock a run
        with cluster_lock(not args.no_lock):
            print(f"bench.goodput: {r.name} ...", flush=True)
            if r.name.startswith("preempt"):
                runner.run(r, float(r.name.removeprefix("preempt-").removesuffix("s")))
            elif r.name == "time-limit":
                runner.run(r, 0.0, *time_limit_overrides(steps))
            else:
                runner.run(r)
        print(f"bench.goodput: {json.dumps(asdict(r))}", flush=True)
        load_now = [*load, os.getloadavg()]
        saved.load = load_averages(load_now)
        save_results(base / "results.json", saved)
    print(f"bench.goodput: results in {base / 'results.json'}")
    if not args.quick:  # kept with the page (bench/kept.py); --page-from reads it back
        name = kept.save(f"goodput-{datetime.now(UTC):%Y-%m-%d-%H%M}.json", asdict(saved))
        print(f"bench.goodput: results kept in {kept.relative(name)}")
    section = render(merge_results([saved]), machine_info())
    extrapolation = render_extrapolation(Extrapolation())
    print(section + "\n" + extrapolation)
    if not (args.quick or args.no_write or args.only):
        write_page({"goodput": section, EXTRAPOLATION_SECTION: extrapolation}, ORDER)
    return 0 if not any(r.error for r in results) else 1


def crash_comparison(args: argparse.Namespace, command: str) -> int:
    """The uninterrupted reference, then the two crash runs, in one hold of the cluster each."""
    base = Path(args.out) / f"crashes-{int(time.time())}"
    base.mkdir(parents=True, exist_ok=True)
    steps = 100 if args.quick else args.steps
    runner = Runner(base, start_cluster(lock=not args.no_lock), steps)
    reference = RunResult("uninterrupted", "none")
    with cluster_lock(not args.no_lock):
        runner.run(reference)
    setup = faults.setup_line(step_delay_s=STEP_DELAY_S)
    runs = []
    for kind in CRASH_RUNS:
        name = f"{kind}-{args.crash_interval:g}s"
        print(f"bench.goodput: {name} ...", flush=True)
        with cluster_lock(not args.no_lock):
            crash = run_crashes(runner.config, name, setup, args.crash_interval, runner.runs, steps)
        reference_files = RunFiles(runner.runs / "uninterrupted")
        crash.losses_identical = losses_match(RunFiles(runner.runs / name), reference_files)
        runs.append(crash)
        print(f"bench.goodput: {json.dumps(crash.as_dict())}", flush=True)
    saved = [asdict(reference), *(c.as_dict() for c in runs)]
    (base / "results.json").write_text(json.dumps(saved, indent=1))
    now = datetime.now(UTC)
    results = {"command": command, "date": str(now.date()), "cpu": machine_info().get("cpu", "?"),
               "runs": [summary(c) for c in runs], "raw": saved}  # fmt: skip
    if not args.quick:  # a quick run is a check of the harness, not a figure
        name = kept.relative(kept.save(f"goodput-crash-{now:%Y-%m-%d-%H%M}.json", results))
        section = render_crashes(results, name)
        print(section)
        if not args.no_write:
            write_page({"goodput-crash": section})
    return 0 if reference.error == "" and all(c.result.error == "" for c in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
