"""Preflight's time at 128 nodes, estimated from its parts measured on the local Slurm cluster at a few
node counts.

    python -m bench.preflight_scale --nodes 2,4,6 --repeats 2      # measure (takes the cluster's lock)
    python -m bench.preflight_scale --page-from bench/results/preflight-scale-DATE.json

For each node count K, REPEATS batch jobs of K nodes (one task a node, one job at a time). Each times
three empty job steps (`srun true`: a job step's start) and `relaytrain preflight --budget 2` (the budget of
the checks before a job step's first step), which runs as one more job step. From its record: the
slowest rank's compute, network and storage phases, one 4 MiB all-reduce's time (from its bandwidth, the
median of the ranks), and the rest of rank 0's time (waiting for the others, gathering their results,
judging, writing the record). Judging and writing the record of 128 nodes is timed here, on 128 copies
of a measured rank. The estimate (`estimate`) fits each part to the node counts and reads it at 128; its
assumptions are printed with it on docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import kept
from bench.report import fmt, machine_info, python_command, table

MODULE = "bench.preflight_scale"
SECTION = "preflight-scale"
ORDER = ["preflight", "preflight-records", "preflight-starts", SECTION, "quickstart"]
ESTIMATE_NODES = 128
STEP_STARTS = 3  # empty job steps timed per job
JOB_TIMEOUT_S = 600

# The batch script: a Python script (sbatch runs it with its #! line), so it times without `bc` or `date`.
BATCH = """#!{python}
import json, subprocess, sys, time

def timed(command):
    t0 = time.perf_counter()
    done = subprocess.run(command)
    return time.perf_counter() - t0, done.returncode

steps = [timed(["srun", "--ntasks-per-node=1", "true"])[0] for _ in range({starts})]
command_s, code = timed([sys.executable, "-m", "relaytrain.cli", "preflight", "--budget", "{budget:g}",
                         "--run.dir={runs}"])
with open("{timings}", "w") as out:
    json.dump({{"step_s": steps, "command_s": command_s, "exit": code}}, out)
"""


# -- measuring ---------------------------------------------------------------------------------------


def allreduce_s(record: dict) -> float | None:
    """One `ALLREDUCE_BYTES` all-reduce's median time, from the ranks' bus bandwidth (measure.py)."""
    from relaytrain.preflight.measure import ALLREDUCE_BYTES

    world = len(record["ranks"])
    rates = [r["figures"].get("gbps") for r in record["ranks"]]
    times = [2 * (world - 1) / world * ALLREDUCE_BYTES / (g * 1e9) for g in rates if g]
    return statistics.median(times) if times else None


def row_of(nodes: int, job: str, timings: dict, record: dict) -> dict:
    """One job's measured parts."""
    ranks = record["ranks"]
    rank0 = next(r for r in ranks if r["rank"] == 0)
    slowest = {k: max(r["seconds"].get(k, 0.0) for r in ranks) for k in ("compute", "network", "storage")}
    return {
        "nodes": nodes,
        "job": job,
        "exit": timings["exit"],
        "named": sorted(n for n, v in record["nodes"].items() if not v["passed"]),
        "step_s": statistics.median(timings["step_s"]),
        "command_s": timings["command_s"],
        "checks_s": record["seconds"],
        "slowest": slowest,
        "rest_s": max(0.0, record["seconds"] - sum(rank0["seconds"].values())),
        "allreduce_s": allreduce_s(record),
    }


def run_job(nodes: int, budget: float, out: Path, partition: str) -> dict:
    """One batch job of `nodes` nodes; its row."""
    from bench.cluster import harness

    folder = out / f"k{nodes}-{len(list(out.glob(f'k{nodes}-*')))}"
    folder.mkdir(parents=True)
    script = folder / "batch.py"
    timings = folder / "timings.json"
    script.write_text(
        BATCH.format(python=sys.executable, starts=STEP_STARTS, budget=budget, runs=folder / "runs",
                     timings=timings)
    )  # fmt: skip
    where = [f"--partition={partition}"] if partition else []
    done = subprocess.run(
        ["sbatch", "--parsable", f"--nodes={nodes}", "--ntasks-per-node=1", *where,
         f"--output={folder}/job.out", str(script)], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"sbatch: {done.stderr.strip()}")
    job = done.stdout.strip().split(";")[0]
    fields = harness.wait_job_end(job, timeout=JOB_TIMEOUT_S)
    if not timings.exists():
        raise RuntimeError(
            f"job {job} of {nodes} nodes ended {fields.get('JobState')} with no timings: {folder}/job.out"
        )
    (path,) = (folder / "runs").glob("*/preflight/*.json")
    return row_of(nodes, job, json.loads(timings.read_text()), json.loads(path.read_text()))


def judge_and_write_s(record: dict, nodes: int = ESTIMATE_NODES, repeats: int = 5) -> float:
    """Rank 0's work after the gather for `nodes` nodes (the run's needs from the plan, the verdict, the
    record written), timed on `nodes` copies of a measured rank's results: the best of `repeats`."""
    from relaytrain.atomic import write_atomic
    from relaytrain.config import load_config
    from relaytrain.preflight import judge
    from relaytrain.preflight.needs import run_needs

    cfg = load_config(None, [])
    model = record["ranks"][-1]
    ranks = [{**model, "rank": i, "node": f"node{i:03d}"} for i in range(nodes)]
    best = float("inf")
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            t0 = time.perf_counter()
            needs = run_needs(cfg, nodes, 1, 0)
            problems = judge.judge(ranks, needs.as_dict())
            lines = judge.report_lines(problems)
            body = {"lines": lines, "nodes": problems, "needs": needs.as_dict(), "ranks": ranks}
            text = json.dumps(body, indent=1, default=str) + "\n"
            write_atomic(Path(tmp, "record.json"), text, durable=False)
            best = min(best, time.perf_counter() - t0)
    return best


# -- the estimate (pure) ------------------------------------------------------------------------------


def line_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of a least-squares line, the slope at least 0 (a part that does not shrink as
    nodes are added); a single x: the mean, slope 0."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    slope = max(0.0, slope)
    return my - slope * mx, slope


def ring_fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(alpha, beta) of a ring all-reduce over p nodes, t = 2(p-1) alpha + 2(p-1)/p beta (alpha: one
    hop's latency; beta: the bytes' time at the link's bandwidth), least squares with both at least 0."""

    def x(p: int) -> tuple[float, float]:
        return 2 * (p - 1), 2 * (p - 1) / p

    rows = [(*x(p), t) for p, t in points]
    s11 = sum(a * a for a, _, _ in rows)
    s22 = sum(b * b for _, b, _ in rows)
    s12 = sum(a * b for a, b, _ in rows)
    s1y = sum(a * t for a, _, t in rows)
    s2y = sum(b * t for _, b, t in rows)
    det = s11 * s22 - s12 * s12
    if det > 1e-12:
        alpha, beta = (s1y * s22 - s2y * s12) / det, (s2y * s11 - s1y * s12) / det
        if alpha >= 0 and beta >= 0:
            return alpha, beta
    only_alpha, only_beta = (max(0.0, s1y / s11), 0.0), (0.0, max(0.0, s2y / s22))

    def error(fit: tuple[float, float]) -> float:
        return sum((t - fit[0] * a - fit[1] * b) ** 2 for a, b, t in rows)

    return min((only_alpha, only_beta), key=error)


def ring_s(alpha: float, beta: float, nodes: int) -> float:
    return 2 * (nodes - 1) * alpha + 2 * (nodes - 1) / nodes * beta


def network_phase_s(alpha: float, beta: float, nodes: int, budget_s: float) -> float:
    """The network phase as measure.allreduce_bandwidth runs it over `nodes`: a warm-up and a first
    all-reduce, then as many rounds as its budget allows, each a barrier (a ring with no data: its
    latency) and an all-reduce."""
    from relaytrain.preflight.measure import allreduce_rounds

    one = ring_s(alpha, beta, nodes)
    rounds = allreduce_rounds(one, budget_s)
    return 2 * one + rounds * (one + ring_s(alpha, 0.0, nodes))


def core_share(nodes: int, cores: int) -> float:
    """How many of the local cluster's nodes share each core of its machine (at least 1; 1 when `cores`
    is 0): a part that keeps a core busy takes about this many times as long as on nodes of their own."""
    return max(1.0, nodes / cores) if cores else 1.0


def estimate(data: dict, nodes: int = ESTIMATE_NODES, cores: int | None = None) -> dict:
    """Each part at `nodes` nodes, and the checks' and the command's totals, from the kept rows. The
    parts that keep a core busy (the all-reduce, the rest, the storage probe, a job step's start, the
    processes' start) are measured times divided by `core_share` (`cores`: the measuring machine's, 0 to
    take them as measured); compute and network are bounded by their budget in wall time, taken as
    measured."""
    from relaytrain.preflight.run import PHASE_SHARE

    cores = data["machine"]["cores"] if cores is None else cores
    rows = [r for r in data["rows"] if r["allreduce_s"]]

    def own(row: dict, seconds: float) -> float:
        return seconds / core_share(row["nodes"], cores)

    budget = data["budget"] * PHASE_SHARE
    alpha, beta = ring_fit([(r["nodes"], own(r, r["allreduce_s"])) for r in rows])
    # the model's largest shortfall against a measured network phase (waiting for the slowest node's
    # compute is in the measured one) where each node had a core, added to the estimate as it is
    alone = [r for r in rows if core_share(r["nodes"], cores) == 1.0] or rows
    margin = max(
        0.0, *(r["slowest"]["network"] - network_phase_s(alpha, beta, r["nodes"], budget) for r in alone)
    )
    rest = line_fit([(r["nodes"], own(r, r["rest_s"])) for r in rows])
    step = line_fit([(r["nodes"], own(r, r["step_s"])) for r in rows])
    other = line_fit([(r["nodes"], own(r, r["command_s"] - r["step_s"] - r["checks_s"])) for r in rows])
    parts = {
        "compute": max(r["slowest"]["compute"] for r in rows),
        "network": network_phase_s(alpha, beta, nodes, budget) + margin,
        "storage": max(own(r, r["slowest"]["storage"]) for r in rows),
        # all_gather_object: two all-gathers (the sizes, then the results), each (p-1) hops of a ring
        "gather": rest[0] + rest[1] * nodes + 2 * (nodes - 1) * alpha,
        "judge_write": data["judge_write_s"],
    }
    checks = sum(parts.values())
    command = {"step_start": step[0] + step[1] * nodes, "processes": other[0] + other[1] * nodes}
    return {
        "nodes": nodes,
        "cores": cores,
        "alpha_s": alpha,
        "beta_s": beta,
        "allreduce_s": ring_s(alpha, beta, nodes),
        "network_margin_s": margin,
        "rest_fit": rest,
        "step_fit": step,
        "processes_fit": other,
        "parts": parts,
        "checks_s": checks,
        "command_parts": command,
        "command_s": checks + sum(command.values()),
    }


# -- the page -----------------------------------------------------------------------------------------


def render(data: dict) -> str:
    m, est, raw = data["machine"], estimate(data), estimate(data, cores=0)
    counts = sorted({r["nodes"] for r in data["rows"]})
    body = []
    for k in counts:
        rows = [r for r in data["rows"] if r["nodes"] == k]

        def mid(key, rows=rows):
            return fmt(statistics.median(r[key] for r in rows))

        body.append((
            k, len(rows), mid("step_s"), fmt(statistics.median(r["slowest"]["compute"] for r in rows)),
            fmt(statistics.median(r["allreduce_s"] * 1e3 for r in rows)),
            fmt(statistics.median(r["slowest"]["network"] for r in rows)),
            fmt(statistics.median(r["slowest"]["storage"] for r in rows)), mid("rest_s"), mid("checks_s"),
            mid("command_s"), sum(1 for r in data["rows"] if r["nodes"] == k and r["named"]),
        ))  # fmt: skip
    parts, cmd = est["parts"], est["command_parts"]
    n = est["nodes"]
    lines = [
        f"## Preflight at {n} nodes: an estimate from its measured parts",
        "",
        f"Measured {m['date']} on {m['cpu']} ({m['cores']} cores), commit {m['commit']}, by "
        f"`{data['command']}`: batch jobs of each node count on the local Slurm cluster (its nodes share "
        f"the machine's cores and talk over its loopback), one at a time, each timing {STEP_STARTS} empty "
        f"job steps and `relaytrain preflight --budget {data['budget']:g}` (the in-job checks' budget) as "
        "a job step. Medians over the jobs of each count; phases are the slowest rank's; the all-reduce is "
        "one 4 MiB all-reduce (from the ranks' median bandwidth); the rest is rank 0's time after its "
        "phases (waiting for the others, gathering, judging, writing the record).",
        "",
        table(
            [
                "nodes",
                "jobs",
                "job step start (s)",
                "compute (s)",
                "all-reduce (ms)",
                "network (s)",
                "storage (s)",
                "rest (s)",
                "checks (s)",
                "command (s)",
                "jobs that named a node",
            ],
            body,
        ).rstrip(),  # fmt: skip
        "",
        f"The estimate at {n} nodes. These nodes are processes of one machine: at N nodes, N / "
        f"{est['cores']} of them share each core, so a part that keeps a core busy takes that many times "
        "as long here as on nodes of their own. Each such part (the all-reduce, the rest, the storage "
        "probe, a job step's start, the processes' start) is divided by that share, then fitted to the "
        "node counts and read at "
        f"{n}; compute and network run for their budget in wall time and are taken as measured.",
        "",
        f"* Compute: {fmt(parts['compute'])} s, the slowest rank measured (each node runs its GEMM on its "
        "own, for the phase's budget; a node much slower than that is what the check names).",
        f"* Network: {fmt(parts['network'])} s. A ring all-reduce over p nodes takes 2(p-1) alpha + "
        f"2(p-1)/p beta; fitted to the all-reduces above: alpha {fmt(est['alpha_s'] * 1e3)} ms a hop, "
        f"beta {fmt(est['beta_s'] * 1e3)} ms, so one 4 MiB all-reduce takes "
        f"{fmt(est['allreduce_s'] * 1e3)} ms at {n} nodes. The phase runs as many rounds as its "
        "budget allows (3 to 50), each a barrier (the latency part alone) and an all-reduce; plus "
        f"{fmt(est['network_margin_s'])} s, the model's largest shortfall against a phase measured where "
        "each node had a core.",
        f"* Storage: {fmt(parts['storage'])} s, the slowest node: every node writes 4 MiB with fsync at "
        f"once, so on a shared file system add {n} x 4 MiB over its write bandwidth.",
        f"* Gathering the results: {fmt(parts['gather'])} s, the rest above as a line in the node count "
        f"({fmt(est['rest_fit'][0])} s + {fmt(est['rest_fit'][1] * 1e3)} ms a node), plus the two "
        f"all-gathers' {2 * (n - 1)} hops at alpha.",
        f"* Judging and writing the record of {n} nodes: {fmt(parts['judge_write'])} s, timed on {n} copies "
        "of a measured rank.",
        f"* **The checks before a job step's first step: {fmt(est['checks_s'])} s at {n} nodes.**",
        f"* `relaytrain preflight` as a job step of its own adds the step's start, "
        f"{fmt(cmd['step_start'])} s (a line: {fmt(est['step_fit'][0])} s + "
        f"{fmt(est['step_fit'][1] * 1e3)} ms a node), and its processes' start and process group, "
        f"{fmt(cmd['processes'])} s (the command's time less the step's start and the checks, as a line: "
        f"{fmt(est['processes_fit'][0])} s + {fmt(est['processes_fit'][1] * 1e3)} ms a node): "
        f"**{fmt(est['command_s'])} s**.",
        f"* Taken as measured, with every part's growth here counted as growth with the nodes (no "
        f"division by the share): the checks {fmt(raw['checks_s'])} s, the command {fmt(raw['command_s'])} "
        "s: these count the slowdown of sharing the cores as growth with the nodes.",
        "",
        "Assumptions: the lines and the ring fitted from these node counts hold up to "
        f"{n} nodes (a line is an upper bound for Slurm's tree fan-out of a job step); the network is this "
        "machine's loopback through gloo, and a real fabric's alpha and beta (NCCL's on GPUs) replace the "
        "fitted ones; the slowest of 128 nodes computes and writes no slower than the slowest measured "
        "(one that does is named by the check).",
        "",
        kept.rewritten(python_command(MODULE), kept.relative(data["kept"])).rstrip(),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="2,4,6", help="node counts, comma-separated (each at least 2)")
    parser.add_argument("--repeats", type=int, default=2, help="jobs of each node count")
    parser.add_argument("--budget", type=float, default=2.0, help="preflight's --budget (the in-job one)")
    parser.add_argument("--partition", default="", help="the Slurm partition (default: the cluster's)")
    parser.add_argument("--out", type=Path, default=None, help="the jobs' folder (default: under bench/out)")
    parser.add_argument("--no-lock", action="store_true", help="the caller holds the cluster lock")
    parser.add_argument("--no-write", action="store_true", help="print the section, leave the page alone")
    parser.add_argument("--page-from", default="", help="measure nothing: rewrite the section from this file")
    args = parser.parse_args(argv)
    if args.page_from:
        kept.rewrite_from(args.page_from, render, SECTION, ORDER, parser.error)
        return 0
    try:
        counts = sorted({int(k) for k in args.nodes.split(",")})
    except ValueError:
        parser.error(f"--nodes {args.nodes!r}: node counts separated by commas, such as 2,4,6")
    if len(counts) < 2 or counts[0] < 2 or args.repeats < 1 or args.budget <= 0:
        parser.error("--nodes needs two counts or more, each at least 2; --repeats at least 1; --budget > 0")
    from bench.cluster import harness

    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = (args.out or harness.OUT_ROOT / "preflight-scale" / stamp).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with harness.cluster_lock(not args.no_lock):
        harness.start_cluster(lock=False, nodes=max(counts))
        rows = [run_job(k, args.budget, out, args.partition) for _ in range(args.repeats) for k in counts]
    (record,) = list((out / f"k{max(counts)}-0" / "runs").glob("*/preflight/*.json"))
    data = {
        "machine": machine_info(),
        "command": python_command(MODULE, ["--nodes", ",".join(map(str, counts)), "--repeats",
                                           str(args.repeats)]),
        "budget": args.budget,
        "rows": rows,
        "judge_write_s": judge_and_write_s(json.loads(record.read_text())),
    }  # fmt: skip
    kept.keep_and_show(SECTION, data, render, SECTION, ORDER, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
