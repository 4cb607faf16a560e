"""The fault matrix's judge (bench/fault_matrix.py): what each fault kind should get, and, from a trial's
records (crashes.jsonl, metrics.jsonl's events and train rows, the last run_state.json), what it got.

Pure: records in, a verdict out, so that tests/test_bench_fault_matrix.py proves every rule without a
cluster. A fault of the machines (``INFRA``) is right when the run was restarted in place, requeued or
simply went on, never stopped, finished, and replayed at most ``MAX_STEPS_LOST`` steps (snapshots are on).
A fault of the user (``USER``) is right when the job stopped with its cause named after at most
``MAX_REPRODUCTIONS`` reproductions (each restart or requeue it got runs the fault once more), and was not
requeued after its stop.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

INFRA, USER = "infrastructure", "user"
MAX_STEPS_LOST = 1
MAX_REPRODUCTIONS = 1
RESTART, REQUEUE, CONTINUED, STOP = "restart", "requeue", "continued", "stop"
REFUSED = "refused"  # final_status of a job `relaytrain launch` refused to submit (a config error)
RECOVERED = (RESTART, REQUEUE, CONTINUED)
# The trainer's own stops that requeue the job (codes.REQUEUE_REASONS' labels), that end it on purpose
# (train.stop_at_step: a planned end, no decision about a fault), and the others: the job's end.
REQUEUE_STOPS = frozenset({"preemption", "time_limit_signal", "time_budget", "program_exit"})
PLANNED_STOPS = frozenset({"stop_at_step"})
CRASH_ACTIONS = {"restart": RESTART, "requeue": REQUEUE, "fail": STOP}


@dataclass(frozen=True)
class Kind:
    name: str
    cls: str  # INFRA or USER
    fault: str  # what the trial does, for the page
    cause: str = ""  # USER: words the stop's message must hold (the cause named)


KINDS = {
    k.name: k
    for k in (
        Kind("rank_killed", INFRA, "SIGKILL rank 1 mid-run"),
        Kind("node_lost", INFRA, "rank 1's node killed (its slurmd and every process on it), back later"),
        Kind("slurmd_killed", INFRA, "SIGKILL rank 1's node's slurmd only, started again 20 s later"),
        Kind("hang", INFRA, "rank 1's data loader stalls (RELAYTRAIN_FAULT_STALL_AT_STEP)"),
        Kind("disk_full", INFRA, "rank 1's node's snapshot directory (a tmpfs) filled from outside: ENOSPC"),
        Kind(
            "preemption",
            INFRA,
            "SIGTERM to the steps with time left (`relaytrain cancel --signal TERM`)",
        ),
        Kind("time_limit", INFRA, "`--time=1` with the signal 30 s ahead; steps too slow to finish in it"),
        Kind(
            "import_error",
            USER,
            "a broken module on PYTHONPATH (slurm.setup) imported at start-up",
            "No module named 'relaytrain_user_helpers'",
        ),
        Kind(
            "shape_error",
            USER,
            "a shape error at step 6 (torch's RuntimeError, every rank)",
            "shapes cannot be multiplied",
        ),
        Kind("nan", USER, "a NaN loss at step 6 (resilience.nan_policy=stop)", "nan"),
        Kind(
            "damaged_checkpoint",
            USER,
            "the only checkpoint damaged (a shard deleted), then resubmitted",
            "damaged",
        ),
        Kind("impossible_config", USER, "`--parallel.tp=4` on 2 ranks: no layout fits", "tp=4"),
    )  # fmt: skip
}


@dataclass
class MatrixTrial:
    """One fault kind's trial on the cluster, its records reduced to the matrix's columns."""

    kind: str
    job: str = ""
    landed: str = ""  # what the fault did, from its landed line or the benchmark's own action
    landed_at: float | None = None  # Unix time it landed (None: no evidence, the trial counts as wrong)
    decision: str = ""  # RESTART, REQUEUE, CONTINUED or STOP: the decision that answered the fault
    decisions: list[str] = field(default_factory=list)  # every decision of the run, in order
    restarts: int = 0  # restarts in place it cost
    requeues: int = 0  # requeues it cost
    reproductions: int | None = None  # USER: how often the fault ran again before the stop
    seconds_to_decision: float | None = None
    steps_lost: int | None = None  # train steps logged more than once (replayed)
    final_status: str = ""
    final_reason: str = ""
    message: str = ""  # the stop's recorded message (USER), or the run's last one
    cause_named: bool = False
    right: bool = False
    why: str = ""  # why the verdict is what it is
    seconds: float = 0.0
    error: str = ""  # the trial itself failed (a timeout, a launch refused unexpectedly)


def decisions_of(
    crashes: Iterable[Mapping[str, Any]], events: Iterable[Mapping[str, Any]], state: Mapping[str, Any]
) -> list[tuple[float, str, str]]:
    """(time, decision, what) for every decision the run's records show, in time order: each crash's
    action, each stop of the trainer (requeued or the end), and a failure recorded with no crash line (a
    damaged checkpoint, an impossible layout) as the stop it was."""
    found = []
    for crash in crashes:
        action = CRASH_ACTIONS.get(str(crash.get("action", "requeue")), STOP)
        found.append((float(crash.get("time", 0.0)), action, str(crash.get("why", ""))))
    for event in events:
        reason = str(event.get("reason", ""))
        if event.get("event") != "stop" or reason in PLANNED_STOPS:
            continue
        found.append((float(event.get("time", 0.0)), REQUEUE if reason in REQUEUE_STOPS else STOP, reason))
    found.sort(key=lambda d: d[0])
    failed = state.get("status") == "failed"
    if failed and not (found and found[-1][1] == STOP):
        found.append((float(state.get("unix_time", 0.0)), STOP, str(state.get("reason", ""))))
    return found


def steps_lost(train_steps: Iterable[int]) -> int:
    """Train steps logged more than once: the steps a restart or requeue computed again."""
    steps = list(train_steps)
    return len(steps) - len(set(steps))


def judge(
    trial: MatrixTrial,
    crashes: list[Mapping[str, Any]],
    events: list[Mapping[str, Any]],
    train_steps: list[int],
    state: Mapping[str, Any],
    slurm_requeues: int = 0,
) -> MatrixTrial:
    """Fill the trial's columns and verdict from its run's records (after the fault landed);
    ``slurm_requeues``: the job's requeues as Slurm counted them (a NODE_FAIL requeue leaves no record)."""
    kind = KINDS[trial.kind]
    if trial.final_status == REFUSED:  # refused at submission: no job, no records (the kind said so)
        trial.decision, trial.decisions, trial.reproductions = STOP, [STOP], 0
        trial.cause_named = kind.cause.lower() in trial.message.lower()
        trial.right, trial.why = verdict(kind, trial)
        return trial
    landed = trial.landed_at
    after = [d for d in decisions_of(crashes, events, state) if landed is None or d[0] >= landed]
    trial.decisions = [d[1] for d in after]
    trial.restarts = trial.decisions.count(RESTART)
    trial.requeues = max(trial.decisions.count(REQUEUE), slurm_requeues)
    trial.final_status, trial.final_reason = str(state.get("status", "")), str(state.get("reason", ""))
    recorded = state.get("user_error") or state.get("message")
    trial.message = str(recorded or f"run_state.json: {trial.final_status} ({trial.final_reason})")[:400]
    trial.steps_lost = steps_lost(train_steps)
    stops = [d for d in after if d[1] == STOP]
    if kind.cls == USER:
        answer = stops[0] if stops else (after[-1] if after else None)
        trial.reproductions = trial.restarts + trial.requeues
    else:
        answer = stops[0] if stops else (after[0] if after else None)
    if answer is None and trial.requeues:
        trial.decisions = [REQUEUE] * trial.requeues  # Slurm's own requeue (a node failure): no record
    recovered = REQUEUE if trial.requeues else CONTINUED
    trial.decision = answer[1] if answer else (recovered if trial.final_status == "finished" else "")
    if answer is not None and trial.landed_at is not None:
        trial.seconds_to_decision = round(answer[0] - trial.landed_at, 1)
    told = " ".join([trial.message, *(d[2] for d in stops)]).lower()
    trial.cause_named = bool(kind.cause) and kind.cause.lower() in told
    trial.right, trial.why = verdict(kind, trial)
    return trial


def verdict(kind: Kind, trial: MatrixTrial) -> tuple[bool, str]:
    """(right, why): the matrix's rule for the kind's class, applied to the judged trial."""
    if trial.error:
        return False, f"the trial failed: {trial.error}"
    if trial.landed_at is None:
        return False, "no evidence that the fault landed"
    if kind.cls == INFRA:
        if STOP in trial.decisions:
            return False, "a false stop: a fault of the machines ended the job"
        if trial.decision not in RECOVERED or trial.final_status != "finished":
            return False, f"not recovered (decision {trial.decision or 'none'}, run {trial.final_status})"
        if trial.steps_lost is None or trial.steps_lost > MAX_STEPS_LOST:
            return False, f"{trial.steps_lost} steps lost (at most {MAX_STEPS_LOST} with snapshots)"
        return True, f"{trial.decision}, finished, {trial.steps_lost} step(s) lost"
    if trial.decision != STOP or trial.final_status not in ("failed", REFUSED):
        return False, f"not stopped (decision {trial.decision or 'none'}, run {trial.final_status})"
    if trial.decisions[-1:] != [STOP]:
        return False, "requeued or restarted after its stop"
    if (trial.reproductions or 0) > MAX_REPRODUCTIONS:
        return False, f"{trial.reproductions} reproductions (at most {MAX_REPRODUCTIONS})"
    if not trial.cause_named:
        return False, f"the stop does not name the cause ({kind.cause!r} not in its message)"
    return True, f"stopped after {trial.reproductions} reproduction(s), cause named"


def summary(trials: list[MatrixTrial]) -> dict[str, Any]:
    """The targets: every verdict right, no false stop, user faults stopped after <= 1 reproduction."""
    user = [t for t in trials if KINDS[t.kind].cls == USER]
    infra = [t for t in trials if KINDS[t.kind].cls == INFRA]
    return {
        "right": sum(t.right for t in trials),
        "trials": len(trials),
        "false_stops": sum(STOP in t.decisions for t in infra),
        "user_within_reproductions": sum(
            t.decision == STOP and (t.reproductions or 0) <= MAX_REPRODUCTIONS for t in user
        ),
        "user": len(user),
        "max_reproductions": max((t.reproductions or 0 for t in user), default=0),
        "max_steps_lost": max((t.steps_lost or 0 for t in infra), default=0),
    }
