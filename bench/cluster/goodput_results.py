"""The goodput benchmark's measurements: one run's figures from its time ledger, metrics, job log and
sacct's job runs (`analyse`), and the results files each invocation saves (`python -m bench.goodput
--page-from` reads them back). What each figure means: bench/cluster/goodput.py."""

from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from bench.cluster.harness import RunFiles, scontrol_job
from bench.cluster.ledger_figures import ledger_figures


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
    ledger: dict = field(default_factory=dict)  # the run's time ledger (ledger_figures); none in old files

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


def ended_runs(job: str, timeout: float = 120.0) -> list[tuple[float, float]]:
    """`sacct_runs` once Slurm's job-completion data holds an end for each of the ended job's runs (its
    restart count + 1): slurmctld writes it after the job has left the queue, later on a loaded machine."""
    restarts = int(scontrol_job(job).get("Restarts") or 0)
    deadline = time.monotonic() + timeout
    while len(runs := sacct_runs(job)) < restarts + 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    return runs


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


def log_lines(text: str, what: str) -> list[tuple[float, str]]:
    """(unix time, message) of rank 0's checkpoint log lines that start with `what`, in order."""
    found = _LOG_TIME.findall(text)
    return [(datetime.fromisoformat(t).timestamp(), msg) for t, msg in found if msg.startswith(what)]


def log_times(text: str, what: str) -> list[float]:
    return [t for t, _ in log_lines(text, what)]


def analyse(result: RunResult, run: RunFiles, runs: list[tuple[float, float]], log_text: str) -> None:
    """Fill `result` from the run's time ledger (productive and allocated seconds, as `relaytrain status`
    gives them), its metrics.jsonl, its job log and sacct's per-run Start/End (the other figures)."""
    try:
        measured = run.time_ledger()
    except RuntimeError as err:  # the run recorded nothing: no figure to take
        result.error = result.error or str(err)[:300]
        return
    result.productive_s = measured.ledger.buckets["productive"]
    result.allocated_s = measured.ledger.allocated_s
    result.ledger = ledger_figures(measured)
    train = run.records("train")  # every record, a replayed step's too
    history = run.history()  # one train record per step, the last one logged
    events = history.events
    result.steps = len(history.train)
    result.replayed = len(train) - len(history.train)
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
