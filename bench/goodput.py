"""`python -m bench.goodput`: how much of the allocated time a preempted or time-limited run spends training.

    python -m bench.goodput --intervals 60,180     # writes its section of docs/benchmarks.md
    python -m bench.goodput --quick --no-write      # one 60 s interval, a short run
    python -m bench.goodput --only time-limit       # chosen runs only; no page
    python -m bench.goodput --page-from A.json B.json --note "..."  # the page from saved results

Each invocation saves results.json (its command, date, load averages and runs) in its own directory
under bench/out/goodput; --page-from renders the union of several such files, each with its command.

On the local Slurm cluster (`relaytrain cluster up`) a tiny 2-rank run (steps slowed to STEP_DELAY_S so a
run lasts minutes) runs uninterrupted, preempted every T seconds (a job on the `high` partition takes its
node; PreemptMode=REQUEUE), and cut by `--time=1` limits (USR2 30 s ahead; see TIME_LIMIT). Per run:

* goodput = productive step time / allocated time. Productive: the step times (`time_step_s`) of the steps
  that count (a replayed step counts once); allocated: the sum of each job run's Start..End (sacct -c).
* steps lost per interruption: the replayed steps (train records beyond one per step) / interruptions.
* signal -> exit: the first step boundary after the signal (the stop step's train record) to the run's End
  (sacct: whole seconds), split into the save (up to the `stop` event, which the trainer logs after its
  save) and the exit (the event to End).
* requeue -> first resumed step: the run's End to the next run's first train record, split into queue
  (End -> next Start), start-up (Start -> `resume` event, less the load) and load (`resuming from` log line
  -> `resume` event; the log has 1 s resolution).

The 7B extrapolation (`Extrapolation`) uses the formula printed on the page, with a sensitivity grid.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from bench.chaos import CONFIG, LOCK, cluster_lock, records, relaytrain, scontrol_job, wait
from bench.report import REPO, code, fmt, machine_info, pct, table, write_page

OUT = REPO / "bench" / "out" / "goodput"
RUN_NAMES_HELP = "uninterrupted, preempt-<T>s for each of --intervals, time-limit"
STEP_DELAY_S = 0.5
CKPT_INTERVAL = 10
BYTES_PER_PARAM = 12.0  # relaytrain plan's checkpoint estimate: fp32 weights + Adam's two moments


@dataclass
class RunResult:
    name: str
    interruption: str
    job: str = ""
    steps: int = 0
    interruptions: int = 0
    replayed: int = 0
    productive_s: float = 0.0
    allocated_s: float = 0.0
    wall_s: float = 0.0
    signal_to_exit: list[dict] = field(default_factory=list)
    requeue_to_step: list[dict] = field(default_factory=list)
    stop_reasons: list[str] = field(default_factory=list)
    job_runs: list[list[float]] = field(default_factory=list)  # sacct Start, End of each job run
    final: str = ""  # run_state.json at the end: status (reason) at step N
    error: str = ""

    @property
    def goodput(self) -> float:
        return self.productive_s / self.allocated_s if self.allocated_s else float("nan")


def sacct_runs(job: str) -> list[tuple[float, float]]:
    """(start, end) unix times of each run of the job (sacct -c: one line per run)."""
    out = subprocess.run(["sacct", "-c", "-j", job, "-P", "-n", "-o", "start,end"],
                         capture_output=True, text=True, timeout=30).stdout  # fmt: skip
    runs = []
    for line in out.splitlines():
        start, _, end = line.partition("|")
        try:
            runs.append((datetime.fromisoformat(start).timestamp(), datetime.fromisoformat(end).timestamp()))
        except ValueError:
            continue
    return sorted(runs)


_LOG_TIME = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) \[rank 0 .*?\] INFO relaytrain\.checkpoint: (.*)$", re.M
)
# `checkpoint step 57 (preemption) committed: ... (write 0.12s, blocking ...)`
_COMMIT = re.compile(r"checkpoint step (\d+) \(\w+\) committed: .*?\(write ([\d.]+)s")


def save_seconds(log_text: str) -> dict[int, float]:
    """Write seconds of the checkpoint of each step, by step: a stop at a step whose interval save was in
    flight saves nothing more ('already checkpointed'), so counting emergency-save lines in order would
    give a stop the next stop's save."""
    return {int(step): float(write) for step, write in _COMMIT.findall(log_text)}


def log_times(text: str, what: str) -> list[float]:
    return [
        datetime.fromisoformat(t).timestamp() for t, msg in _LOG_TIME.findall(text) if msg.startswith(what)
    ]


def analyse(result: RunResult, run_dir: Path, runs: list[tuple[float, float]], log_text: str) -> None:
    """Fill `result` from the run's metrics.jsonl, its job log and sacct's per-run Start/End."""
    train = records(run_dir, "train")
    events = records(run_dir, "event")
    last = {}
    for r in train:
        last[r["step"]] = r
    result.steps = len(last)
    result.replayed = len(train) - len(last)
    result.productive_s = sum(r["time_step_s"] for r in last.values())
    result.allocated_s = sum(end - start for start, end in runs)
    result.wall_s = runs[-1][1] - runs[0][0] if runs else 0.0
    result.job_runs = [[start, end] for start, end in runs]
    stops = [e for e in events if e.get("event") == "stop"]
    resumes = [e for e in events if e.get("event") == "resume"]
    result.interruptions = len(stops)
    result.stop_reasons = [str(e.get("reason", "?")) for e in stops]
    saves = save_seconds(log_text)
    loads = log_times(log_text, "resuming from")
    for stop in stops:
        end = next((e for s, e in runs if s <= stop["time"] <= e + 1), None)
        if end is None:
            continue
        result.signal_to_exit.append(
            stop_split(stop, train, runs, end, saves.get(stop["step"], float("nan")))
        )
        after = [(s, e) for s, e in runs if s >= end - 0.5]
        resume = next((r for r in resumes if r["time"] > end), None)
        if not after or resume is None:
            continue
        start = after[0][0]
        first = min((r["time"] - r["time_step_s"] for r in train if r["time"] > resume["time"]), default=None)
        load_log = next((t for t in loads if t >= start - 1), None)
        load = max(0.0, resume["time"] - load_log) if load_log is not None else float("nan")
        result.requeue_to_step.append({
            "total": (first or resume["time"]) - end,
            "queue": start - end,
            "startup": resume["time"] - start - (load if load == load else 0.0),
            "load": load,
        })  # fmt: skip


def stop_split(
    stop: dict, train: list[dict], runs: list[tuple[float, float]], end: float, write: float
) -> dict:
    """signal -> exit of one stop. The trainer logs the `stop` event after its save, so the stop begins
    at the train record of the stop step (the step boundary where the ranks agreed); save is that record
    to the event (the wait for an async save in flight plus the emergency save), exit the event to End.
    `write` is the emergency save's own write seconds from the job log, for reference."""
    start = next(s for s, e in runs if s <= stop["time"] <= e + 1)
    boundary = max(
        (r["time"] for r in train if r["step"] == stop["step"] and start <= r["time"] <= stop["time"]),
        default=stop["time"] - (write if write == write else 0.0),
    )
    return {
        "total": end - boundary,
        "save": stop["time"] - boundary,
        "exit": end - stop["time"],
        "write": write,
    }


def mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r and r[key] == r[key]]
    return sum(values) / len(values) if values else float("nan")


@dataclass
class ResultsFile:
    """One invocation's results: the command that measured them, the load around it, its runs."""

    command: str = ""
    load: str = ""
    date: str = ""
    runs: list[RunResult] = field(default_factory=list)


def save_results(path: Path, results: ResultsFile) -> None:
    path.write_text(json.dumps(asdict(results), indent=1))


def load_results(path: Path) -> ResultsFile:
    """A results file; the first format (a bare list of runs) has no command or load recorded."""
    data = json.loads(path.read_text())
    if isinstance(data, list):
        return ResultsFile(runs=[RunResult(**row) for row in data])
    return ResultsFile(
        command=data.get("command", ""),
        load=data.get("load", ""),
        date=data.get("date", ""),
        runs=[RunResult(**row) for row in data.get("runs", [])],
    )


def merge_results(files: list[ResultsFile]) -> list[tuple[ResultsFile, list[RunResult]]]:
    """Each file with the runs it contributes; a run name measured again in a later file replaces the
    earlier one, and a run that never started (no job, no error) contributes nothing."""
    chosen: dict[str, int] = {}
    for index, results in enumerate(files):
        for run in results.runs:
            if run.job or run.error:
                chosen[run.name] = index
    return [
        (results, [r for r in results.runs if chosen.get(r.name) == index])
        for index, results in enumerate(files)
        if index in chosen.values()
    ]


# -- the 7B extrapolation ---------------------------------------------------------------------------


@dataclass
class Extrapolation:
    params: float = 7e9
    write_gbps: float = 2.0  # slurm.fs_write_gbps's default (aggregate GB/s); read assumed the same
    startup_s: float = 60.0  # import torch + NCCL init on a few hundred ranks (assumed; local: tiny)
    exit_s: float = 5.0  # measured locally (signal -> exit, less the save): process teardown
    step_s: float = 10.0  # a 7B step on a few nodes (assumed)
    lost_steps: float = 1.0  # measured: at most the step in flight when the signal came
    async_block_s: float = 1.0  # async periodic saves: blocking part per save (bench checkpoint-io)
    ckpt_every_s: float = 1800.0

    @property
    def save_s(self) -> float:
        return self.params * BYTES_PER_PARAM / (self.write_gbps * 1e9)

    @property
    def load_s(self) -> float:
        return self.save_s  # read bandwidth assumed equal to write

    def cost_s(self) -> float:
        """Allocated seconds lost to one interruption (queue time is not allocated)."""
        return self.save_s + self.exit_s + self.startup_s + self.load_s + self.lost_steps * self.step_s

    def goodput(self, interval_s: float) -> float:
        return max(0.0, 1.0 - self.cost_s() / interval_s - self.async_block_s / self.ckpt_every_s)


TARGET, TARGET_INTERVAL_S = 0.98, 1800.0
SENSITIVITY_WRITE_GBPS = (2.0, 10.0, 50.0)
SENSITIVITY_COLUMNS = ((60.0, 1.0), (20.0, 1.0), (20.0, 0.0))  # (start-up s, lost steps)


def cost_budget_s(x: Extrapolation, interval_s: float = TARGET_INTERVAL_S, target: float = TARGET) -> float:
    """The largest cost per interruption that still gives `target` goodput at `interval_s`."""
    return (1.0 - target - x.async_block_s / x.ckpt_every_s) * interval_s


def sensitivity(x: Extrapolation) -> dict[tuple[float, float, float], Extrapolation]:
    """`x` with each (write GB/s, start-up s, lost steps) of the grid."""
    return {
        (gbps, startup, lost): replace(x, write_gbps=gbps, startup_s=startup, lost_steps=lost)
        for gbps in SENSITIVITY_WRITE_GBPS
        for startup, lost in SENSITIVITY_COLUMNS
    }


def render_sensitivity(x: Extrapolation) -> str:
    grid = sensitivity(x)
    header = ["write GB/s (save = load)"] + [
        f"start-up {startup:g} s, {lost:g} lost step{'s' * (lost != 1)}"
        for startup, lost in SENSITIVITY_COLUMNS
    ]
    rows = [
        [f"{gbps:g} ({grid[gbps, *SENSITIVITY_COLUMNS[0]].save_s:.1f} s)"]
        + [f"{pct(grid[gbps, s, n].goodput(TARGET_INTERVAL_S))} ({grid[gbps, s, n].cost_s():.0f} s)"
           for s, n in SENSITIVITY_COLUMNS]
        for gbps in SENSITIVITY_WRITE_GBPS
    ]  # fmt: skip
    meeting = [
        f"{gbps:g} GB/s, start-up {s:g} s, {n:g} lost steps"
        for (gbps, s, n), v in grid.items()
        if v.goodput(TARGET_INTERVAL_S) >= TARGET
    ]
    budget = cost_budget_s(x)
    verdict = (
        f"**The {pct(TARGET, 0)} target at a 30-minute interval is not met with the default inputs:** "
        f"{pct(TARGET, 0)} needs the cost of one interruption under {budget:.0f} s ({pct(1 - TARGET, 0)} of "
        f"1800 s less the async blocking); the default inputs cost {x.cost_s():.0f} s, of which the two "
        f"checkpoint transfers are {2 * x.save_s:.0f} s and the start-up {x.startup_s:g} s."
        if x.goodput(TARGET_INTERVAL_S) < TARGET
        else f"The {pct(TARGET, 0)} target at a 30-minute interval is met with the default inputs."
    )
    reach = (
        f" In the grid only {'; '.join(meeting)} reach{'es' * (len(meeting) == 1)} it: the transfers must "
        "come down to a few seconds (an emergency save that only flushes an async checkpoint already in "
        "flight, or a node-local/in-memory tier; a load from a peer or local copy), the start-up to about "
        "20 s, and the step in flight must not be lost."
        if meeting
        else " No cell of the grid reaches it."
    )
    return (
        f"\nSensitivity: goodput at a preemption every 30 minutes (cost per interruption in brackets), "
        f"other inputs as above.\n\n{table(header, rows)}\n{verdict}{reach} These are inputs of the "
        "formula, not measurements at scale.\n"
    )


def render_extrapolation(x: Extrapolation) -> str:
    rows = [(label, pct(x.goodput(t))) for label, t in (("every 30 min", 1800), ("every 4 h", 14400))]
    return (
        "\n### 7B-class extrapolation\n\n"
        "goodput(T) = 1 − (save + exit + start-up + load + lost_steps × step) / T "
        "− async_block / ckpt_every, "
        "with save = load = params × 12 B / write bandwidth (relaytrain plan's checkpoint estimate: fp32 "
        "weights and Adam's two moments; read assumed as fast as write). Queue time is not allocated time, "
        "so it is not in the formula (it costs wall-clock time, not allocation). Inputs: "
        f"params {x.params:.0e}, write {x.write_gbps:g} GB/s (`slurm.fs_write_gbps` default) → save "
        f"{x.save_s:.0f} s, load {x.save_s:.0f} s; exit {x.exit_s:g} s (local: the processes are gone "
        f"within the 5 s GraceTime); start-up {x.startup_s:g} s (assumed: imports and NCCL init at scale, "
        f"not measurable here); step {x.step_s:g} s (assumed); lost steps {x.lost_steps:g} (an upper "
        "bound: the step in flight; 0 were lost here); "
        f"async blocking {x.async_block_s:g} s per periodic save every {x.ckpt_every_s:g} s. Cost per "
        f"interruption: {x.cost_s():.0f} s.\n\n" + table(["preemption", "goodput"], rows)
        + render_sensitivity(x)
    )  # fmt: skip


# -- running -----------------------------------------------------------------------------------------


class Runner:
    def __init__(self, base: Path, cluster, steps: int):
        self.base, self.cluster, self.steps = base, cluster, steps
        self.runs = base / "runs"
        self.config = base / "goodput.toml"
        self.config.write_text(CONFIG.format(
            name="goodput", runs=self.runs, steps=steps, eval_every=0, interval=CKPT_INTERVAL,
            profile=REPO / "configs" / "clusters" / "local.toml",
        ))  # fmt: skip

    def launch(self, name: str, *overrides: str) -> str:
        setup = f"export RELAYTRAIN_STEP_DELAY_S={STEP_DELAY_S}"
        out = relaytrain("launch", str(self.config), "--nodes", "1", "--tasks-per-node", "2",
                         f"--run.name={name}", f"--slurm.setup=['{setup}']", *overrides)  # fmt: skip
        return re.search(r"submitted job (\d+)", out).group(1)

    def preempt_every(self, job: str, interval: float, stop: threading.Event) -> None:
        while not stop.wait(interval):
            fields = scontrol_job(job)
            if fields.get("JobState") != "RUNNING":
                continue
            subprocess.run(["sbatch", "--partition=high", f"--nodelist={fields.get('BatchHost', '')}",
                            "--nodes=1", "--ntasks=1", f"--cpus-per-task={self.cluster.cpus_per_node}",
                            "--output=/dev/null", "--wrap=sleep 1"],
                           capture_output=True, timeout=30)  # fmt: skip

    def run(self, result: RunResult, interval: float = 0.0, *overrides: str) -> None:
        run_dir = self.runs / result.name
        try:
            result.job = self.launch(result.name, *overrides)
            stop = threading.Event()
            thread = threading.Thread(
                target=self.preempt_every, args=(result.job, interval, stop), daemon=True
            )
            if interval:
                thread.start()
            wait(lambda: scontrol_job(result.job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED",
                 "TIMEOUT"), 3600, f"job {result.job}", interval=2.0)  # fmt: skip
            stop.set()
            time.sleep(3)  # jobcomp is written when the job ends
            log_text = "\n".join(p.read_text(errors="replace") for p in (run_dir / "slurm").glob("*.out"))
            analyse(result, run_dir, sacct_runs(result.job), log_text)
            state = json.loads((run_dir / "run_state.json").read_text())
            result.final = f"{state.get('status')} ({state.get('reason')}) at step {state.get('step')}"
            if state.get("status") != "finished" or state.get("step") != self.steps:
                result.error = f"the run did not finish: {result.final}"
        except (RuntimeError, TimeoutError, OSError, AttributeError, subprocess.SubprocessError) as err:
            result.error = str(err)[:300]


def interruptions_cell(r: RunResult) -> str:
    if not r.interruptions:
        return "0"
    counts = Counter(r.stop_reasons)
    if len(counts) == 1:
        return f"{r.interruptions} ({next(iter(counts))})"
    reasons = ", ".join(f"{n} {reason}" for reason, n in counts.items())
    return f"{r.interruptions} ({reasons})" if reasons else str(r.interruptions)


def run_rows(runs: list[RunResult]) -> list[tuple]:
    rows = []
    for r in runs:
        s2e, r2s = r.signal_to_exit, r.requeue_to_step
        rows.append((
            r.name, r.interruption, r.steps, interruptions_cell(r), fmt(r.allocated_s), fmt(r.productive_s),
            pct(r.goodput), fmt(r.replayed / r.interruptions) if r.interruptions else "–",
            (f"{fmt(mean(s2e, 'total'))} ({fmt(mean(s2e, 'save'))} + "
             f"{fmt(mean(s2e, 'exit'))})") if s2e else "–",
            (f"{fmt(mean(r2s, 'total'))} ({fmt(mean(r2s, 'queue'))} + {fmt(mean(r2s, 'startup'))} + "
             f"{fmt(mean(r2s, 'load'))})") if r2s else "–",
            r.error or r.final,
        ))  # fmt: skip
    return rows


def source_line(results: ResultsFile, runs: list[RunResult]) -> str:
    names = ", ".join(r.name for r in runs)
    command = code(results.command) if results.command else "command not recorded"
    facts = [results.date or "date not recorded"]
    load = f"load average 1/5/15 min start → end: {results.load}" if results.load else "load not recorded"
    facts.append(load)
    return f"- {names}: {command} ({'; '.join(facts)})\n"


def render(sources: list[tuple[ResultsFile, list[RunResult]]], info: dict, notes: Sequence[str] = ()) -> str:
    """The section: the commands that measured the runs (one line per results file), the runs' table,
    what is local, then the notes, one paragraph each."""
    runs = [r for _, file_runs in sources for r in file_runs]
    return (
        "## Goodput under preemption and time limits\n\n"
        f"Machine: {info.get('cpu', '?')} ({info.get('cores', '?')} cores), local Slurm cluster "
        f"(`relaytrain cluster up`). A tiny 2-rank run, steps slowed to {STEP_DELAY_S} s "
        f"(`RELAYTRAIN_STEP_DELAY_S`), async checkpoint every {CKPT_INTERVAL} steps. Times in seconds; "
        "means over the interruptions of a run. Measured by:\n\n"
        + "".join(source_line(results, file_runs) for results, file_runs in sources)
        + "\n"
        + table(["run", "interruption", "steps", "interruptions (stop reason)", "allocated s", "productive s",
                 "goodput", "steps lost / interruption", "signal→exit (save + exit)",
                 "requeue→first step (queue + start-up + load)", "end of run"], run_rows(runs))
        + "\n**What is an artefact of the local cluster.** The queue part is local Slurm settings: a "
        "requeued job may start only `AuthInfo=cred_expire` + 1 s after its end (10 + 1 s here; 121 s "
        "with Slurm's default), then at the next scheduling pass (`sched_interval`, 2 s here; 60 s by "
        "default); a preemption adds GraceTime (5 s) and the high job's own run. Start-up is dominated by"
        " `import torch` on 2 shared cores; the saves and loads are of a 2 MB checkpoint. Goodput on this"
        " page is therefore a lower bound driven by fixed local costs over minute-long intervals; the "
        "extrapolation below replaces them.\n"
        + "".join(f"\n{note}\n" for note in notes)
    )  # fmt: skip


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.goodput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--intervals", default="60,180", help="preempt every T seconds, comma-separated")
    parser.add_argument("--steps", type=int, default=600, help="steps per run (0.5 s each)")
    parser.add_argument(
        "--quick", action="store_true", help="one 60 s interval, 160 steps, no time limit run"
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
    args = parser.parse_args(argv)
    if args.page_from:
        try:
            files = [load_results(Path(path)) for path in args.page_from]
        except (OSError, ValueError, TypeError) as err:
            parser.error(f"--page-from: {err}")
        section = render(merge_results(files), machine_info(), args.note)
        write_page({"goodput": section + render_extrapolation(Extrapolation())})
        print(section)
        return 0
    command = "python -m bench.goodput " + " ".join(argv if argv is not None else sys.argv[1:])
    intervals = [60.0] if args.quick else [float(t) for t in args.intervals.split(",") if t]
    steps = 160 if args.quick else args.steps
    results = planned_runs(intervals, not (args.quick or args.no_time_limit), steps)
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in {r.name for r in results}]
        if unknown:
            names = ", ".join(r.name for r in results)
            parser.error(f"--only: no run named {', '.join(unknown)}; runs: {names}")
        results = [r for r in results if r.name in wanted]
    from relaytrain.localcluster import cluster as local_cluster

    base = Path(args.out) / f"run-{int(time.time())}"
    base.mkdir(parents=True, exist_ok=True)
    saved = ResultsFile(command=command.strip(), date=str(datetime.now(UTC).date()), runs=results)
    load = [os.getloadavg()]
    with cluster_lock(not args.no_lock):
        info = local_cluster.running_cluster() or local_cluster.cluster_up(nodes=2, cpus_per_node=4)
    os.environ.update(info.env)
    runner = Runner(base, info, steps)
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
        saved.load = " → ".join("/".join(f"{x:.1f}" for x in la) for la in load_now)
        save_results(base / "results.json", saved)
    print(f"bench.goodput: results in {base / 'results.json'}")
    section = render(merge_results([saved]), machine_info()) + render_extrapolation(Extrapolation())
    print(section)
    if not (args.quick or args.no_write or args.only):
        write_page({"goodput": section})
    return 0 if not any(r.error for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
