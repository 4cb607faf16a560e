"""Snapshots within a budget: the automatic interval (`checkpoint.snapshot_every = "auto"`) against a
snapshot every step and against no snapshots, side by side in one invocation.

    python -m bench.snapshot_budget [--steps 10] [--state-gb 1.2] [--budget 0.02] [--parts one,nodes]
                                    [--no-lock] [--no-write]
    python -m bench.snapshot_budget --page-from bench/results/snapshot-budget-<date>.json

`one`: the debug config widened to about `--state-gb` GB of model and AdamW state (bench/snapshot.py's
wide model) in one process; `nodes`: the same model on 2 nodes x 1 task of the local Slurm cluster (each
node its own /dev/shm, each rank's snapshot replicated to the other node), under the cluster's lock. Each
part trains `--steps` steps without snapshots, with `snapshot_every = 1` and with `snapshot_every = "auto"`
(`snapshot_max_overhead = --budget`). In one process the three runs train at the same time, so the
machine's other load weighs on all three alike. On 2 nodes three jobs at once would not fit the machine's
memory, so they run one after the other in mirrored order (off, every step, auto, auto, every step, off):
each setting's figures are the sum over its two jobs, and a load that rises or falls steadily during the
part weighs on the three alike. From each run's metrics.jsonl: the wall time of its steps (`time_step_s`,
one record per step), its `snapshot` events (each snapshot's blocking and background seconds and the
slowdown of the steps its background work overlapped) and its `snapshot_interval` events.
The measured overhead of a run is its steps' time over the run without snapshots', minus 1, over the
steady steps: from step FIRST_AUTO_STEP + 2 on, after the automatic run's start-up snapshot (which waits
for its own background work once, to measure it) and the step that pays for it; the whole run's figure
(from step 2) is given beside it. Writes the `snapshot-budget` section of docs/benchmarks.md and keeps the
figures in bench/results/snapshot-budget-<UTC date and time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from relaytrain.checkpoint.snapshot.pacing import FIRST_AUTO_STEP

from bench import kept
from bench.bounds import rate
from bench.report import REPO, machine_info, write_page

SECTION = "snapshot-budget"
ORDER = [SECTION, "torchtitan"]  # after the page's "In-memory snapshots", before the next block
PARTS = ("one", "nodes")
EVERY = {"off": 0, "every step": 1, "auto": "auto"}
STEADY_FROM = FIRST_AUTO_STEP + 2
NODES_DIM, PARAMS_PER_LAYER = 1024, 11.6e6  # bench/snapshot.py's wide model


def wide_model(state_gb: float) -> list[str]:
    layers = max(1, round(state_gb * 1e9 / 12 / PARAMS_PER_LAYER))
    return [f"--model.dim={NODES_DIM}", f"--model.n_layers={layers}"]


def overrides(name: str, every, budget: float, steps: int, run_dir: Path, shm: Path | None) -> list[str]:
    args = [f"--run.dir={run_dir}", f"--run.name={name}", f"--train.max_steps={steps}"]
    args += ["--train.eval_every=0"]
    args += ["--checkpoint.interval=0", "--checkpoint.save_initial=false", "--metrics.log_every=1"]
    args += ["--metrics.tensorboard=false", f"--checkpoint.snapshot_every={every}"]
    args += [f"--checkpoint.snapshot_max_overhead={budget}"]
    return args + ([f"--checkpoint.snapshot_dir={shm}"] if shm else [])


def summarize(records: list[dict]) -> dict:
    """One run's figures from its metrics.jsonl records."""
    train = [r for r in records if r.get("kind") == "train" and r["step"] >= 2]
    snaps = [r for r in records if r.get("event") == "snapshot"]
    steady = [r for r in train if r["step"] >= STEADY_FROM]
    steady_snaps = [r for r in snaps if r["step"] >= STEADY_FROM - 1]  # its cost lands in the next step
    return {
        "step_times": {str(r["step"]): r["time_step_s"] for r in train},
        "total_s": sum(r["time_step_s"] for r in train),
        "steady_s": sum(r["time_step_s"] for r in steady),
        "steady_steps": len(steady),
        "snapshots": [
            {k: r.get(k) for k in ("step", "blocking_s", "waited_s", "background_s", "slowdown_s")}
            for r in snaps
        ],  # fmt: skip
        "ledger_steady_s": sum(r["blocking_s"] + (r["slowdown_s"] or 0.0) for r in steady_snaps),
        "intervals": [
            {
                k: r.get(k)
                for k in ("step", "every", "blocking_s", "background_s", "slowdown_s", "step_s", "overhead")
            }
            for r in records
            if r.get("event") == "snapshot_interval"
        ],  # fmt: skip
        "snapshot_bytes": max((r.get("snapshot_bytes", 0.0) for r in train), default=0.0),
    }


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def one_process(steps: int, state_gb: float, budget: float) -> dict[str, dict]:
    """The three runs at once, one process each: whatever else loads the machine loads all three alike."""
    runs, procs = {}, {}
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        work = Path(tmp)  # the snapshots in memory, as on a cluster's node
        for name, every in EVERY.items():
            run = name.replace(" ", "-")
            args = [sys.executable, "-m", "relaytrain.cli", "train", str(REPO / "configs/debug.toml")]
            args += [*wide_model(state_gb), *overrides(run, every, budget, steps, work, Path(shm))]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            log = open(work / f"{run}.log", "w")  # noqa: SIM115 (closed with the process below)
            procs[name] = (run, log, subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env))
        for name, (run, log, proc) in procs.items():
            code = proc.wait()
            log.close()
            if code:
                raise RuntimeError(f"{name}: exited {code}\n{(work / f'{run}.log').read_text()[-3000:]}")
            runs[name] = summarize(_metrics(work / run / "metrics.jsonl"))
            print(f"one process, {name}: {runs[name]['steady_s']:.1f} s over the steady steps", flush=True)
    return runs


JOB_TIME = "02:00:00"  # each 2-node job runs in one allocation
MIRRORED = [*EVERY, *reversed(EVERY)]  # 2 nodes: the jobs' order; a steady drift cancels over each pair


def combined(jobs: list[dict]) -> dict:
    """One setting's figures over its jobs: times, steps and events summed (`jobs`: how many)."""
    summed = ("total_s", "steady_s", "steady_steps", "ledger_steady_s")
    total = {key: sum(job[key] for job in jobs) for key in summed}
    total["step_times"] = [job["step_times"] for job in jobs]
    total["snapshots"] = [snap for job in jobs for snap in job["snapshots"]]
    total["intervals"] = [interval for job in jobs for interval in job["intervals"]]
    total["snapshot_bytes"] = max(job["snapshot_bytes"] for job in jobs)
    return total | {"jobs": len(jobs)}


def two_nodes(steps: int, state_gb: float, budget: float, lock: bool) -> dict[str, dict]:
    """The three settings on 2 nodes x 1 task, one job after the other in MIRRORED order."""
    from bench.cluster.harness import OUT_ROOT, PROFILE, cluster_lock, relaytrain, start_cluster, wait_job_end

    base = OUT_ROOT / "snapshot-budget" / f"nodes-{int(time.time())}"
    base.mkdir(parents=True)
    jobs: dict[str, list[dict]] = {name: [] for name in EVERY}
    start_cluster(lock=lock)
    try:
        with cluster_lock(lock):
            for index, name in enumerate(MIRRORED):
                run = f"{name.replace(' ', '-')}-{index}"
                args = [*wide_model(state_gb), *overrides(run, EVERY[name], budget, steps, base, None)]
                # the profile's 10 minutes would stop and requeue a long job: its second allocation's
                # start-up and the queue would count as snapshot overhead
                submitted = relaytrain("launch", str(REPO / "configs/debug.toml"), "--nodes", "2",
                                       "--tasks-per-node", "1", f"--slurm.profile={PROFILE}",
                                       "--time", JOB_TIME, *args)  # fmt: skip
                job = re.search(r"submitted job (\d+)", submitted)
                if not job:
                    raise RuntimeError(f"no job id in: {submitted}")
                fields = wait_job_end(job.group(1), 3600)
                metrics = base / run / "metrics.jsonl"
                if fields.get("JobState") != "COMPLETED" or not metrics.is_file():
                    logs = "\n".join(p.read_text()[-3000:] for p in (base / run).rglob("*.out"))
                    raise RuntimeError(f"job {job.group(1)} ended {fields.get('JobState')}:\n{logs}")
                records = _metrics(metrics)
                if stops := [r for r in records if r.get("event") == "stop"]:
                    raise RuntimeError(f"job {job.group(1)} ({name}) stopped and was requeued: {stops}")
                jobs[name].append(summarize(records))
                steady = jobs[name][-1]["steady_s"]
                print(f"2 nodes, {name}: {steady:.1f} s over the steady steps", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {name: combined(done) for name, done in jobs.items()}


def overhead(runs: dict[str, dict], name: str, key: str = "steady_s") -> float:
    return runs[name][key] / runs["off"][key] - 1


def _chosen(run: dict) -> str:
    chosen = [f"every {i['every']} from step {i['step']}" for i in run["intervals"]]
    return "; ".join(chosen) or "none"


def part_rows(what: str, runs: dict[str, dict], budget: float) -> list[str]:
    off = runs["off"]
    rows = [f"| {what}: without snapshots | {off['steady_s'] / off['steady_steps']:.3f} s | | | |"]
    for name in ("every step", "auto"):
        run = runs[name]
        ledger = run["ledger_steady_s"] / off["steady_s"]
        within = " (within the budget)" if overhead(runs, name) <= budget else " (over the budget)"
        rows.append(
            f"| {what}: `snapshot_every = {EVERY[name]!r}`".replace("'", '"')
            + f" | {run['steady_s'] / run['steady_steps']:.3f} s | {len(run['snapshots'])} "
            f"| {overhead(runs, name):+.1%}{within if name == 'auto' else ''} "
            f"(whole run {overhead(runs, name, 'total_s'):+.1%}) | {ledger:.1%} |"
        )
    return rows


def _order(parts: dict) -> str:
    """How the part's runs shared the machine."""
    together = "In one process the three runs trained at the same time (the machine's other load weighs "
    together += "on all three alike)."
    if "nodes" not in parts:
        return together
    if parts["nodes"]["off"].get("jobs", 1) == 1:  # results kept before the mirrored order
        sequential = "On 2 nodes the three jobs ran one after the other."
        return (together + " " if "one" in parts else "") + sequential
    mirrored = " On 2 nodes (three jobs at once do not fit this machine's memory) the jobs ran one after "
    mirrored += "the other in mirrored order, off, every step, auto, auto, every step, off, each setting's "
    mirrored += "figures summed over its two jobs (a load that rises or falls steadily weighs on the three "
    mirrored += "alike); its `snapshot` events are counted over both."
    return (together if "one" in parts else "") + mirrored


def _spread(runs: dict[str, dict]) -> str:
    """The 2-node jobs of each setting apart: how far two jobs of one setting differ (the noise floor)."""
    parts = []
    for name, run in runs.items():
        steady = [sum(t for s, t in times.items() if int(s) >= STEADY_FROM) for times in run["step_times"]]
        apart = max(steady) / min(steady) - 1
        parts.append(f"{name} {' / '.join(f'{s:.1f}' for s in steady)} s ({apart:.1%} apart)")
    return (
        f"2 nodes, each job's steady steps: {'; '.join(parts)}. Where two jobs of one setting differ by more "
        "than the budget, the measured overhead of the sum cannot show the budget held; the ledger can."
    )


def every_run(datas: list[dict], budget_of_shown: float) -> list[str]:
    """Every kept run of the benchmark, the one shown above included: each part's automatic interval over
    or within its budget, and how many snapshots it took after the start-up one (none: "within the
    budget" shows nothing of the chooser there)."""
    latest = datas[-1]["commit"]
    rows = []
    for data in datas:
        code = "the code of the run above" if data["commit"] == latest else "earlier code, superseded"
        for key, what in (("one", "one process"), ("nodes", "2 nodes x 1 rank")):
            if key not in data["parts"]:
                continue
            runs, budget = data["parts"][key], data["args"]["budget"]
            auto = overhead(runs, "auto")
            taken = len(runs["auto"]["snapshots"]) - runs["auto"].get("jobs", runs["off"].get("jobs", 1))
            verdict = "over the budget" if auto > budget else "within the budget"
            if taken <= 0:
                verdict += ", vacuous: no snapshot after the start-up one"
            rows.append(
                f"| {kept.relative(data['kept'])} | {data['commit']} ({code}) | {what} "
                f"| {data['args']['steps']} | {overhead(runs, 'every step'):+.1%} "
                f"| {auto:+.1%} ({verdict}) | {max(taken, 0)} |"
            )
    over = sum("over the budget" in r for r in rows)
    return [
        "",
        f"Every kept run of this benchmark ({len(datas)} invocations, {len(rows)} parts; the automatic "
        f"interval over its budget in {over} of them; the table above is the last):",
        "",
        '| results | commit | part | steps | `snapshot_every = 1` measured | `"auto"` measured | auto\'s '
        "snapshots after the start-up one |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        chooser_test(datas),
    ]


TEST_INTERVALS = 3  # automatic intervals a part of a test run must choose to test the chooser at all
TESTS_WANTED = 2  # fresh runs that played no part in the chooser's design


def chooser_test(datas: list[dict]) -> str:
    """The chooser judged out of sample: the parts of the runs kept as its test (`--test`: runs that played
    no part in its design), each judged only where its automatic run chose TEST_INTERVALS intervals or more;
    the count within the budget with its 95 % lower bound. Parts that chose fewer are named, not judged."""
    tests = [
        (d, key) for d in datas if d["args"].get("test") for key in ("one", "nodes") if key in d["parts"]
    ]
    judged, short = [], []
    for data, key in tests:
        runs, name = data["parts"][key], f"{kept.relative(data['kept'])} ({key})"
        chosen = len(runs["auto"]["intervals"])
        if chosen < TEST_INTERVALS:
            short.append(f"{name}: {chosen} interval(s) chosen")
            continue
        auto = overhead(runs, "auto")
        ledger = runs["auto"]["ledger_steady_s"] / runs["off"]["steady_s"]
        judged.append(
            (name, auto <= data["args"]["budget"], f"{name}: {auto:+.1%} measured, ledger {ledger:.1%}")
        )
    runs_kept = len({kept.relative(d["kept"]) for d, _ in tests})
    if runs_kept < TESTS_WANTED or not judged:
        said = (
            f"Still open: the chooser judged out of sample, on {TESTS_WANTED} fresh runs that played no part "
            f"in its design, each with at least {TEST_INTERVALS} automatic intervals per setting; kept so "
            f"far: {runs_kept} such run(s)"
        )
        details = [row for _, _, row in judged] + short
        return said + (f" ({'; '.join(details)})." if details else ".")
    within = sum(ok for _, ok, _ in judged)
    text = (
        f"The chooser's test ({runs_kept} runs kept as its test, no part of its design; parts with at least "
        f"{TEST_INTERVALS} automatic intervals): within the budget in {rate(within, len(judged), 'lower')} "
        f"parts: {'; '.join(row for _, _, row in judged)}."
    )
    return text + (f" Not judged (too few intervals): {'; '.join(short)}." if short else "")


def render(data: dict, earlier: list[dict] = ()) -> str:
    a = data["args"]
    budget = a["budget"]
    lines = [
        "## Snapshots within a budget: the automatic interval",
        "",
        f"Measured on {data['date']} ({data['cpu']}; load average {data['load']}), commit "
        f"{data['commit']}, with "
        f"`{data['command']}`, one invocation: the debug config widened to {a['state_gb']} GB of model and "
        f"AdamW state, {a['steps']} steps without snapshots, with `snapshot_every = 1` and with "
        f'`snapshot_every = "auto"` (`snapshot_max_overhead = {budget}`). '
        f"{_order(data['parts'])} Overhead: "
        f"the steps' wall time over the run without snapshots', minus 1, from step {STEADY_FROM} on (after "
        "the automatic run's start-up snapshot, which waits once for its own background work to measure "
        "it); the whole run's (from step 2) in brackets. Ledger: the run's `snapshot` events, blocking "
        "seconds plus the slowdown of the steps their background work overlapped, over the same steps "
        "without snapshots. Where the machine's other load changes during the runs (this page's machine is "
        "shared), the measured overhead carries that noise, of the order of a few percent (a run with "
        "snapshots can measure faster than the run without); the ledger, from each snapshot's own "
        "measurements, does not.",
        "",
        "| run | step (mean) | `snapshot` events | measured overhead | ledger |",
        "| --- | --- | --- | --- | --- |",
    ]
    parts = data["parts"]
    if "one" in parts:
        lines += part_rows("one process", parts["one"], budget)
    if "nodes" in parts:
        lines += part_rows("2 nodes x 1 rank", parts["nodes"], budget)
    lines.append("")
    for key, what in (("one", "One process"), ("nodes", "2 nodes")):
        if key in parts:
            auto = parts[key]["auto"]
            lines.append(f"{what}, intervals chosen: {_chosen(auto)}.")
            blocking = [s["blocking_s"] for s in parts[key]["every step"]["snapshots"]]
            background = [s["background_s"] for s in parts[key]["every step"]["snapshots"]]
            if blocking:
                lines.append(
                    f"{what}, `snapshot_every = 1`: {blocking and max(blocking):.3f} s blocking at most, "
                    f"{max(background):.3f} s of background work at most per snapshot."
                )
    if "nodes" in parts and parts["nodes"]["off"].get("jobs", 1) > 1:
        lines.append(_spread(parts["nodes"]))
    name = kept.relative(data["kept"])
    names = " ".join(kept.relative(d["kept"]) for d in [*earlier, data])
    if earlier:
        lines += every_run([*earlier, data], budget)
    lines += ["", f"Results: `{name}`. Rewritten from the kept results by "
                  f"`python -m bench.snapshot_budget --page-from {names}`."]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--state-gb", type=float, default=1.2)
    parser.add_argument("--budget", type=float, default=0.02)
    parser.add_argument("--parts", default="one", help=f"which of {','.join(PARTS)} to run")
    parser.add_argument("--no-lock", action="store_true", help="the caller holds the cluster's lock already")
    parser.add_argument("--no-write", action="store_true", help="leave docs/benchmarks.md alone")
    parser.add_argument(
        "--test", action="store_true", help="a fresh run kept as the chooser's test (no part in its design)"
    )
    parser.add_argument(
        "--page-from", nargs="+",
        help="rewrite the section from kept results files: the last shown in full, every one in a table",
    )  # fmt: skip
    args = parser.parse_args()
    if args.page_from:
        try:
            datas = [{**kept.load(path), "kept": path} for path in args.page_from]
        except ValueError as err:
            parser.error(f"--page-from: {err}")
        print(f"wrote {write_page({SECTION: render(datas[-1], datas[:-1])}, ORDER)}")
        return
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"--parts: unknown {', '.join(sorted(unknown))}; choose from {','.join(PARTS)}")
    info = machine_info()
    name = f"snapshot-budget-{time.strftime('%Y-%m-%d-%H%M', time.gmtime())}.json"
    data = {"command": " ".join(["python -m bench.snapshot_budget", *sys.argv[1:]]), "date": info["date"],
            "commit": info["commit"], "cpu": info["cpu"], "args": vars(args), "parts": {}}  # fmt: skip
    for part in parts:
        if part == "one":
            data["parts"]["one"] = one_process(args.steps, args.state_gb, args.budget)
        else:
            data["parts"]["nodes"] = two_nodes(args.steps, args.state_gb, args.budget, lock=not args.no_lock)
        data["load"] = f"{info['load_start']} -> {[round(x, 2) for x in os.getloadavg()]}"
        path = kept.save(name, data)  # after each part: a later part's failure keeps the earlier's
    print(render({**data, "kept": path}))
    if not args.no_write:
        print(f"wrote {write_page({SECTION: render({**data, 'kept': name})}, ORDER)}")


if __name__ == "__main__":
    sys.exit(main())
