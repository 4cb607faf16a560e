"""The straggler trial of `python -m bench.spares`: a slowed node replaced by the spare at the next snapshot.

A `--nodes 2 --spare-nodes 1` job (3 nodes, 1 rank on each training node) trains a small model with
snapshots every `SNAPSHOT_EVERY` steps and `resilience.straggler_action = "replace"`. Once it logged
`THROTTLE_AT` steps, rank 1's process is put under a CPU quota `FACTOR` times too small from outside the
job (`python -m faults.throttle`, as `python -m bench.stragglers` does). The trainer names it (`straggler`
event), every rank stops after the next snapshot (`stop` event, exit 89), and the batch job's driver
restarts the step in place with the spare in the slowed node's place (`step_restart`, then `resume`).

`analyse` reads all of it from the run's own records (metrics.jsonl's train records and events) and the
throttle's landed line: the step times (medians of `time_step_s`) healthy before the throttle, slowed
from the throttle to the stop, and after the resume (its first snapshot interval of steps, and the rest);
how soon and how right the straggler was named; the spare that took its place; the times from naming to
the stop, the stop to the resume, and from the resume until throughput is back: the first `WINDOW` steps
in a row whose median step time is at most the healthy one / `BACK`. The budget the issue sets is one
snapshot interval (at the slowed step time) plus the restart (stop → resume), counted from naming.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.report import REPO, code, fmt, median, table

STEPS, THROTTLE_AT, FACTOR, SNAPSHOT_EVERY = 160, 20, 4.0, 10
NAMED_WITHIN = 50  # steps from the throttle to the `straggler` line (the target)
WINDOW, BACK = 5, 0.95  # throughput is back: WINDOW steps in a row at >= BACK of the healthy throughput
LANDED_FIELDS = ("rank", "node", "factor", "quota_us", "period_us", "weight")  # not its cgroup's path
LEDGER_BUCKETS = ("productive", "startup", "restore", "stop", "restart")


def _first(events: list[dict], name: str, after: dict | None) -> dict | None:
    """The first `name` event at or after the event `after`; None when there was no `after` (the run never
    got that far)."""
    if after is None:
        return None
    return next((e for e in events if e.get("event") == name and e["time"] >= after["time"]), None)


def _median(records: list[dict]) -> float | None:
    value = median(r["time_step_s"] for r in records)
    return None if value != value else round(value, 4)


def first_back(after: list[dict], healthy: float, window: int = WINDOW) -> int | None:
    """The index in `after` (the train records after the resume, in order) of the first of `window` steps in
    a row whose median step time is at most `healthy` / BACK; None when no such window was logged."""
    for i in range(len(after) - window + 1):
        if median(r["time_step_s"] for r in after[i : i + window]) <= healthy / BACK:
            return i
    return None


def analyse(
    train: list[dict], events: list[dict], throttled: dict, snapshot_every: int, window: int = WINDOW
) -> dict[str, Any]:
    """The trial's figures from the run's train records and events (metrics.jsonl, file order) and
    `throttled`: the throttle's landed fields with `step` (the last step logged when it landed) and `time`.
    A figure the run never got to (no stop, no resume) is None."""
    named = next((e for e in events if e.get("event") == "straggler"), None)
    stop = _first(events, "stop", named)
    restart = _first(events, "step_restart", stop)
    resume = _first(events, "resume", restart)
    at_step, at_time = throttled["step"], throttled["time"]
    stop_time = stop["time"] if stop else float("inf")
    before = [r for r in train if 1 < r["step"] <= at_step and r["time"] <= at_time]
    slowed = [r for r in train if r["step"] > at_step and at_time < r["time"] <= stop_time]
    after = [r for r in train if resume is not None and r["time"] > resume["time"]]
    step_s = {
        "healthy": _median(before),
        "slowed": _median(slowed),
        "after_first_interval": _median(after[:snapshot_every]),
        "after_rest": _median(after[snapshot_every:]),
    }
    healthy, slowed_s = step_s["healthy"], step_s["slowed"]
    back = first_back(after, healthy, window) if healthy is not None else None
    back_at = None if back is None else (after[back - 1]["time"] if back else resume["time"])
    restart_s = resume["time"] - stop["time"] if resume else None
    budget = snapshot_every * slowed_s + restart_s if restart_s is not None and slowed_s else None
    to_back = back_at - named["time"] if back_at is not None else None
    return {
        "throttled": {k: throttled[k] for k in LANDED_FIELDS if k in throttled},
        "throttled_at_step": at_step,
        **_named(named, throttled),
        "stopped_at_step": stop and stop["step"],
        "stop_reason": stop and stop["reason"],
        "named_to_stop_steps": stop and stop["step"] - named["step"],
        "named_to_stop_s": _seconds(stop and stop["time"] - named["time"]),
        "spare": _replacement(restart, named),
        "nodes_after": restart and restart["nodes"],
        "world_sizes": sorted({e["world_size"] for e in events if e.get("event") in ("start", "resume")}),
        "resized": any(e.get("event") == "resize" for e in events),
        "stop_to_decision_s": _seconds(restart and restart["time"] - stop["time"]),
        "stop_to_resume_s": _seconds(restart_s),
        "resumed_at_step": resume and resume["step"],
        "resumed_from": resume and resume.get("restored_from"),
        "step_s": step_s,
        "back_after_steps": back,
        "resume_to_back_s": _seconds(back_at and back_at - resume["time"]),
        "named_to_back_s": _seconds(to_back),
        "budget_s": _seconds(budget),
        "back_within_budget": to_back is not None and budget is not None and to_back <= budget,
    }


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _named(named: dict | None, throttled: dict) -> dict[str, Any]:
    """Who the `straggler` event named, when, and whether it is the rank and node the throttle landed on."""
    if named is None:
        return {"named_at_step": None, "named_after_steps": None, "named_rank": None, "named_node": None,
                "named_slower": None, "named_phase": None, "named_right": False}  # fmt: skip
    right = (named["rank"], named["node"]) == (throttled["rank"], throttled["node"])
    return {"named_at_step": named["step"], "named_after_steps": named["step"] - throttled["step"],
            "named_rank": named["rank"], "named_node": named["node"], "named_slower": named["slower"],
            "named_phase": named["phase"], "named_right": right}  # fmt: skip


def _replacement(restart: dict | None, named: dict | None) -> str | None:
    """The spare the step restart put in the named node's place (`nodes_replaced`: [[old, new], ...])."""
    if restart is None or named is None:
        return None
    return dict(map(tuple, restart.get("nodes_replaced") or [])).get(named["node"])


def passed(t: dict[str, Any]) -> bool:
    """The issue's targets for the trial: named right within NAMED_WITHIN steps, the spare in its place
    with the world size kept, in the same job without a requeue, throughput back within the budget."""
    named_soon = t.get("named_after_steps") is not None and t["named_after_steps"] <= NAMED_WITHIN
    same_job = t.get("requeues") == 0 and t.get("job_ids") == [t.get("job")]
    in_place = bool(t.get("spare")) and t.get("world_sizes") == [2] and not t.get("resized")
    back = t.get("back_within_budget") is True
    return named_soon and t.get("named_right") is True and same_job and in_place and back


def landed_fields(line: str) -> dict[str, Any]:
    """The throttle's landed line (`throttle rank=1 node=n2 pid=... factor=4.0 ...`) as its fields."""
    pairs = dict(word.split("=", 1) for word in line.split() if "=" in word)
    numbers = {"rank": int, "factor": float, "quota_us": int, "period_us": int, "weight": int}
    return {k: numbers.get(k, str)(v) for k, v in pairs.items()}


def throttle_rank_1(job: str, last_step: Callable[[], int]) -> tuple[int, dict[str, Any]]:
    """Once the run logged THROTTLE_AT steps, rank 1 throttled FACTOR times from outside the job: its pid,
    and the throttle's landed fields with the last step logged and the time."""
    import faults
    import faults.throttle as throttle
    from bench.cluster import harness

    pid = harness.wait(lambda: last_step() >= THROTTLE_AT and throttle.rank_pid(job, 1), 240,
                       f"job {job} to reach step {THROTTLE_AT}", interval=0.2)  # fmt: skip
    command = [sys.executable, "-m", "faults.throttle", "--pid", str(pid), "--factor", f"{FACTOR:g}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=30)
    landed = faults.landed(done.stdout)
    if not landed:
        throttle.release(pid)
        raise RuntimeError(f"the throttle did not land: {done.stdout}{done.stderr}")
    return pid, landed_fields(landed[0]) | {"step": last_step(), "time": time.time()}


def trial(base: Path) -> dict[str, Any]:
    import faults.throttle as throttle
    from bench.cluster import harness
    from bench.cluster.stragglers import QUICK_TRIAL_MODEL, TRIAL_TIME, straggler_config

    runs = base / "runs"
    base.mkdir(parents=True, exist_ok=True)
    config = base / "straggler.toml"
    # the straggler check's model: the tiny model's phases are under the detector's 20 ms floor and a
    # throttled rank of it was never named (bench.chaos straggler_replace, seed 71); a 30 min job limit
    config.write_text(straggler_config("straggler", runs, STEPS, QUICK_TRIAL_MODEL, TRIAL_TIME))
    out = harness.relaytrain("launch", str(config), "--nodes", "2", "--spare-nodes", "1",
                             "--tasks-per-node", "1", f"--checkpoint.snapshot_every={SNAPSHOT_EVERY}",
                             "--resilience.straggler_action=replace")  # fmt: skip
    job = out.split("submitted job ")[1].split()[0]
    run = harness.RunFiles(runs / "straggler")
    pid = None
    try:
        pid, throttled = throttle_rank_1(
            job, lambda: max((r["step"] for r in run.records("train")), default=0)
        )
        fields = harness.wait_job_end(job, 600)
    finally:
        if pid is not None:
            throttle.release(pid)
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    records = run.records()
    train, events = ([r for r in records if r["kind"] == kind] for kind in ("train", "event"))
    figures = analyse(train, events, throttled, SNAPSHOT_EVERY)
    buckets = run.time_ledger().ledger.as_json()["buckets"]
    in_place = f"spare {figures['spare']} in place of {figures['named_node']}"
    return {
        "job": job, "state": fields.get("JobState"), "requeues": int(fields.get("Restarts", "0")),
        "job_ids": sorted({str(r["job_id"]) for r in records if r.get("job_id")}),
        "log_says_spare": in_place in run.job_log(), **figures,
        "ledger_s": {k: round(buckets.get(k, 0.0), 2) for k in LEDGER_BUCKETS},
        "setup": {"steps": STEPS, "throttle_at": THROTTLE_AT, "factor": FACTOR,
                  "snapshot_every": SNAPSHOT_EVERY, "window": WINDOW, "back": BACK},
    }  # fmt: skip


HEADER = ["trial", "job end", "requeues", "throttled", "named at step (after)", "named right",
          "spare in its place", "world size", "healthy step s", "slowed step s", "after: 1st interval s",
          "after: rest s", "named → stop", "stop → resume s", "resume → back s", "named → back s",
          "budget s", "back within budget", "ledger: stop s", "ledger: restart s"]  # fmt: skip


def row(i: int, t: dict[str, Any]) -> tuple:
    thr, steps, ledger = t["throttled"], t["step_s"], t["ledger_s"]
    named = f"{t['named_at_step']} (+{t['named_after_steps']})" if t["named_at_step"] else "**never**"
    stopped = (
        f"{t['named_to_stop_steps']} steps, {fmt(t['named_to_stop_s'])} s" if t["stopped_at_step"] else "–"
    )
    world = ",".join(map(str, t["world_sizes"])) + (" (resized)" if t["resized"] else "")
    throttled = f"rank {thr['rank']} on {thr['node']} ×{thr['factor']:g} after step {t['throttled_at_step']}"
    return (
        i, t["state"], t["requeues"], throttled, named,
        "yes" if t["named_right"] else "**no**", t["spare"] or "**none**", world,
        *(fmt(steps[k]) for k in ("healthy", "slowed", "after_first_interval", "after_rest")), stopped,
        *(fmt(t[k]) for k in ("stop_to_resume_s", "resume_to_back_s", "named_to_back_s", "budget_s")),
        "yes" if t["back_within_budget"] else "**no**", fmt(ledger["stop"]), fmt(ledger["restart"]),
    )  # fmt: skip


SETUP = (
    "Measured by {command} ({date}) on the local Slurm cluster: a `--nodes 2 --spare-nodes 1` job of a "
    "small model (1 rank per node, {steps} steps, snapshots every {snapshot_every} steps, "
    '`resilience.straggler_action = "replace"`), rank 1 throttled {factor:g}× from outside the job '
    "(`python -m faults.throttle`, a CPU quota) once the run logged step {throttle_at} (the table: the last "
    "step logged when it landed). Step times are medians of the logged `time_step_s`: healthy before the "
    "throttle, slowed from the throttle to the stop, after the resume over its first snapshot interval and "
    "over the rest. Throughput is back at the first {window} steps in a row whose median step time is at "
    "most the healthy one / {back:g}; the budget, counted from the `straggler` line, is one snapshot "
    "interval at the slowed step time plus the restart (stop → resume). The time ledger's view "
    "(`relaytrain status`): its stop bucket holds the straggler's stop (to the job step's end) and the "
    "job's own end, its restart bucket the restarted step's start-up."
)


def render(trials: list[dict[str, Any]], command: str, date: str) -> str:
    return (
        "### A straggler's node replaced by the spare\n\n"
        + SETUP.format(command=code(command), date=date, **trials[0]["setup"])
        + "\n\n"
        + table(HEADER, [row(i + 1, t) for i, t in enumerate(trials)])
    )
