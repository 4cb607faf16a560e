"""`python -m bench.goodput --crashes`: a crash every T seconds, restart in place against requeue, in one run.

The same tiny 2-rank job as the goodput runs, one rank SIGKILLed every T seconds (the way the OOM killer
ends a process), three times: with `resilience.max_step_restarts=0` (every crash requeues the job, the
behaviour before restarts in place), with restarts in place, and with restarts in place and an in-memory
snapshot every step (`checkpoint.snapshot_every=1`), and the last again on 2 nodes x 1 task with the killed
rank's node memory wiped at each kill (the restore takes its snapshot from the peer node). Every run
raises its caps
(`max_crash_requeues`, `max_step_restarts`) so that every crash takes the path being measured.

Per crash:

* steps replayed: the last step logged before the kill less the step the run resumed from;
* kill -> first step again, split into detection (the kill to the end-of-step decision's line in
  crashes.jsonl), queue (the decision to the next job run's Start, requeue only), start-up (to the
  `resume` event, less the load) and load (the `resuming from` log line to the `resume` event);

and per run: goodput (productive step time / allocated time) and whether every logged loss equals the
uninterrupted reference run's, step by step.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from relaytrain.config import load_config

from bench.cluster.goodput_results import RunResult, analyse, ended_runs, log_lines
from bench.cluster.harness import (
    RunFiles,
    kill_with_node_memory,
    launch,
    rank_pids,
    scontrol_job,
    wait_job_end,
)
from bench.report import fmt, pct, table

# Every crash takes the path measured: the caps are far above the kills of one run.
NO_CAP = 1000
CRASH_RUNS = {
    "crash-requeue": ("requeued (max_step_restarts=0)", (f"--resilience.max_crash_requeues={NO_CAP}",
                                                         "--resilience.max_step_restarts=0")),
    "crash-in-place": ("restarted in place", (f"--resilience.max_crash_requeues={NO_CAP}",
                                              f"--resilience.max_step_restarts={NO_CAP}")),
    "crash-in-place-snapshots": ("restarted in place, snapshot every step",
                                 (f"--resilience.max_crash_requeues={NO_CAP}",
                                  f"--resilience.max_step_restarts={NO_CAP}",
                                  "--checkpoint.snapshot_every=1")),
    "crash-in-place-peer": ("restarted in place, snapshot every step, 2 nodes, the killed rank's node "
                            "memory wiped (its snapshot comes from the peer node)",
                            (f"--resilience.max_crash_requeues={NO_CAP}",
                             f"--resilience.max_step_restarts={NO_CAP}",
                             "--checkpoint.snapshot_every=1")),
}  # fmt: skip
# Runs on 2 nodes x 1 task whose killed rank's node also loses its memory (every snapshot there).
NODE_MEMORY_LOST = {"crash-in-place-peer"}
# The restore's log line: `... in node memory (1 of 2 rank file(s) from a peer node): ...`.
PEER_RESTORE_LINE = re.compile(r"\((\d+) of \d+ rank file\(s\) from a peer node\)")


@dataclass
class CrashRun:
    result: RunResult
    interval: float
    kills: list[float] = field(default_factory=list)  # when each SIGKILL was sent
    crashes: list[dict] = field(default_factory=list)  # the per-crash split
    losses_identical: bool | None = None  # every logged loss equals the reference's
    peer_restores: int = 0  # restores that took a rank's snapshot from the peer node

    def as_dict(self) -> dict:
        return {**asdict(self.result), "interval": self.interval, "kills": self.kills,
                "crashes": self.crashes, "losses_identical": self.losses_identical,
                "peer_restores": self.peer_restores}  # fmt: skip


def kill_every(job: str, interval: float, stop: threading.Event, kills: list[float], wipe_in: str) -> None:
    """SIGKILL rank 1 every `interval` seconds while the job runs a step with that rank; with `wipe_in`
    (the run's snapshot_dir), its node loses its memory too."""
    while not stop.wait(interval):
        if scontrol_job(job).get("JobState") != "RUNNING":
            continue
        pids = rank_pids(job, 1)
        if not pids:
            continue
        sent = time.time()
        if wipe_in:
            _, _, signalled = kill_with_node_memory(job, pids, wipe_in)
        else:
            signalled = []
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    signalled.append(pid)
        if signalled:  # a kill counts only when it reached a process
            kills.append(sent)


def run_crashes(
    config: Path, name: str, setup: str, interval: float, runs_root: Path, steps: int
) -> CrashRun:
    """One crash run (`crash-requeue-<T>s` or `crash-in-place-<T>s`) from launch to analysis; its error
    says so when a step of 1..`steps` was never logged or the run did not finish at `steps`."""
    label, overrides = CRASH_RUNS[name.rsplit("-", 1)[0]]  # `crash-in-place-30s` -> `crash-in-place`
    crash = CrashRun(RunResult(name, f"rank 1 SIGKILLed every {interval:g} s, {label}"), interval)
    run = RunFiles(runs_root / name)
    wipe = name.rsplit("-", 1)[0] in NODE_MEMORY_LOST
    crash.result.job = launch(config, name, setup, *overrides, nodes=2 if wipe else 1)
    wipe_in = load_config(config).checkpoint.snapshot_dir if wipe else ""
    stop = threading.Event()
    killer = threading.Thread(
        target=kill_every, args=(crash.result.job, interval, stop, crash.kills, wipe_in)
    )
    killer.start()
    try:
        wait_job_end(crash.result.job, 3600, interval=2.0)
    finally:
        stop.set()
        killer.join()
    runs = ended_runs(crash.result.job)
    log_text = run.job_log()
    analyse(crash.result, run, runs, log_text)
    crash.crashes = crash_splits(run, runs, log_text, crash.kills)
    crash.result.interruptions = len(crash.crashes)
    crash.result.replayed = sum(c["replayed"] for c in crash.crashes)
    crash.peer_restores = sum(bool(c.get("from_peer")) for c in crash.crashes)
    state = run.state()
    crash.result.final = f"{state.get('status')} ({state.get('reason')}) at step {state.get('step')}"
    crash.result.error = crash.result.error or completeness(run, state, steps)
    return crash


def completeness(run: RunFiles, state: dict, steps: int) -> str:
    """'' when every step 1..`steps` has a train record and the run finished at `steps`, else what not."""
    logged = {r["step"] for r in run.records("train")}
    missing = sorted(set(range(1, steps + 1)) - logged)
    problems = [f"steps never logged: {missing[:5]}{' ...' if len(missing) > 5 else ''}"] if missing else []
    if state.get("status") != "finished" or state.get("step") != steps:
        problems.append(f"the run did not finish at step {steps}")
    return "; ".join(problems)


def from_peer(line: str) -> bool:
    """Whether a restore's log line says it took at least one rank's snapshot from a peer node."""
    match = PEER_RESTORE_LINE.search(line)
    return bool(match) and int(match.group(1)) > 0


def crash_splits(
    run: RunFiles, runs: list[tuple[float, float]], log_text: str, kills: list[float]
) -> list[dict]:
    """kill -> first step again for each kill that the run recorded as a crash."""
    train = run.records("train")
    resumes = [e for e in run.records("event") if e.get("event") == "resume"]
    lines = sorted(run.crashes(), key=lambda c: c.get("time", 0))
    loads = log_lines(log_text, "resuming from")
    out = []
    for kill in kills:
        line = next((c for c in lines if c.get("time", 0) >= kill), None)
        if line is None:
            continue
        decided = float(line["time"])
        resume = next((r for r in resumes if r["time"] > decided), None)
        if resume is None:
            continue
        first = min((r["time"] - r["time_step_s"] for r in train if r["time"] > resume["time"]), default=None)
        start = next((s for s, _ in runs if s >= decided - 1), None)
        queue = max(0.0, start - decided) if line.get("action") != "restart" and start else 0.0
        # the restore this crash led to: its log line (1 s resolution), one per kill
        load_log, load_line = next(((t, m) for t, m in loads if t >= decided - 1), (None, ""))
        load = max(0.0, resume["time"] - load_log) if load_log is not None else float("nan")
        reached = max((r["step"] for r in train if r["time"] <= kill), default=0)
        out.append({
            "action": line.get("action", "requeue"),
            "detection": decided - kill,
            "queue": queue,
            "startup": resume["time"] - decided - queue - (load if load == load else 0.0),
            "load": load,
            "total": (first or resume["time"]) - kill,
            "replayed": max(0, reached - int(resume["step"])),
            "from_peer": from_peer(load_line),
        })  # fmt: skip
    return out


def losses_match(run: RunFiles, reference: RunFiles) -> bool:
    """Every train record of the run (replayed steps included) has the reference's loss for its step,
    and the run logged the reference's steps, no fewer."""
    expected = {r["step"]: r["loss"] for r in reference.records("train")}
    logged = run.records("train")
    same_steps = {r["step"] for r in logged} == set(expected)
    return bool(logged) and same_steps and all(expected.get(r["step"]) == r["loss"] for r in logged)


def _mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) == r.get(key)]
    return sum(values) / len(values) if values else float("nan")


def summary(c: CrashRun) -> dict:
    """A crash run as the page shows it and the extrapolation reads it (kept in bench/results/)."""
    r, s = c.result, c.crashes
    return {"name": r.name, "interruption": r.interruption, "crashes": len(s),
            **{key: _mean(s, key) for key in ("replayed", "total", "detection", "queue", "startup", "load")},
            "goodput": r.goodput, "losses_identical": c.losses_identical, "peer_restores": c.peer_restores,
            "end": r.error or r.final}  # fmt: skip


def mean_detection(rows: list[dict]) -> float:
    """The kill -> end-of-step decision, over every crash of the runs (each run's mean by its crashes)."""
    counted = [
        (r["detection"], r["crashes"]) for r in rows if r["crashes"] and r["detection"] == r["detection"]
    ]
    return sum(d * n for d, n in counted) / sum(n for _, n in counted) if counted else float("nan")


def render_crashes(kept: dict, results: str) -> str:
    """The section of docs/benchmarks.md from a kept results file (`kept`, named `results`): one row per
    crash run, then the file's notes."""
    said = kept.get("transcribed")  # a file copied from an earlier page (bench/kept.py) is history
    history = f"\n*Kept history, transcribed: {said.rstrip('.')}.*\n" if said else ""
    rows = []
    for r in kept["runs"]:
        split = (f"{fmt(r['total'])} ({fmt(r['detection'])} + {fmt(r['queue'])} + {fmt(r['startup'])} + "
                 f"{fmt(r['load'])})")  # fmt: skip
        same = {True: "yes", False: "no", None: "–"}[r["losses_identical"]]
        peer = (
            f" ({r['peer_restores']} of {r['crashes']} restored from the peer)" if r["peer_restores"] else ""
        )
        peer = peer if r["peer_restores"] else ""
        rows.append((r["name"], r["interruption"] + peer, r["crashes"], fmt(r["replayed"]),
                     split if r["crashes"] else "–", pct(r["goodput"]), same, r["end"]))  # fmt: skip
    notes = "".join(f"\n{note}\n" for note in kept.get("notes", []))
    return (
        "## Crashes: restart in place against requeue\n\n"
        f"Measured {kept['date']} on {kept['cpu']}, local Slurm cluster, by `{kept['command']}`: the goodput "
        "runs' job (2 ranks, "
        "steps slowed to 0.5 s, async checkpoint every 10 steps), rank 1 SIGKILLed every T seconds: with "
        "every crash requeued (`resilience.max_step_restarts=0`, the behaviour before restarts in place), "
        "with the job step restarted in place, restarted in place with an in-memory snapshot every "
        "step (`checkpoint.snapshot_every=1`), and the same on 2 nodes x 1 task with the killed rank's node "
        "memory wiped right after each kill, so that its snapshot comes from the peer node's replica, in "
        "the same invocation. Times in seconds, "
        "means over the crashes of a run; a restore counts as from the peer when the log line of the "
        "restore that crash led to says a peer sent a file.\n\n"
        + table(["run", "crash", "crashes", "steps replayed / crash",
                 "kill→first step (detection + queue + start-up + load)", "goodput",
                 "losses bit-identical to uninterrupted", "end of run"], rows)
        + "\nDetection is the kill to the end-of-step decision: the surviving rank's collective fails, "
        "torchrun ends the step, the batch script runs the decision. The requeue's queue part is local "
        "Slurm settings (`cred_expire` 10 s + 1 s, `sched_interval` 2 s here; 121 s and 60 s by "
        "default, and a real queue's wait on top); a restart in place has none. Start-up is `import "
        "torch` and the process group on 2 shared cores; the load is a 2 MB checkpoint. A run counts only "
        "when every step was logged and it finished at its last step (else its end of run says what "
        "is missing).\n"
        + notes
        + history
        + f"\nResults: `{results}`. Rewritten from the kept results by "
        f"`python -m bench.goodput --crash-page-from {results}`.\n"
    )  # fmt: skip
