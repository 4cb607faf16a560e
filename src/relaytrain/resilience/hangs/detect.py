"""Is the job hung, and which rank holds it: the pure judgement over every rank's published progress.

The job's hang monitor (in the batch driver) reads the node watchers' files, builds one ``RankView`` per
rank and calls ``assess``. The job is hung when no rank moved for longer than the largest ``phase_limit``
over the ranks, so one rank in a long, budgeted phase (a checkpoint save, a graph's compilation) protects
them all. A rank moves when it changes phase, enters or leaves a collective, or marks progress inside a
phase (a layer's forward or backward, an evaluation batch, a shard read or written, a graph compiled), so
a limit bounds the pause since the last move, not a whole phase. It comes from the run's own timing: a
multiple of the phase's usual longest pause between moves (its recent median), never below the floor,
never above ``resilience.hang_timeout_s`` (the cap); a phase with a budget (a save's or restore's
estimate) may take twice it. The start-up is phases of its own, from the task wrapper's first instruction
on (launch, rendezvous, set-up, the restore, compilation, the first step), each bounded the same way
(launch and set-up, which mark only per module imported, by ``FIRST_WORK_FLOORS`` x the floor until
measured), so a rank stuck in its rendezvous or restore is named within the floor.

On a hang the culprits are named, most certain first: a process that is gone, stopped or in uninterruptible
sleep (it cannot run Python, so its own stack may be missing); a rank outside any collective while others
wait in one; a rank that skipped a collective (desynchronised); else the ranks furthest behind. A rank that
is slower but still moving is no hang: ``slow_ranks.SlowRankTracker`` reports it. The markdown report is
``relaytrain.resilience.hangs.report``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from relaytrain.config.schema import ResilienceConfig
from relaytrain.job.progress import Phase, ProgressRecord

TRAINING_PHASES = frozenset({Phase.DATA, Phase.FORWARD_BACKWARD, Phase.OPTIMIZER, Phase.AFTER_STEP})
# Phases of the step under way (the record's step is the last finished one) and their order in it; every
# other phase comes after the step the record names (AFTER_STEP, evaluation, a save) or before the first.
IN_STEP_ORDER = {
    Phase.LAUNCH: -2,
    Phase.RENDEZVOUS: -1,
    Phase.STARTUP: 0,
    Phase.CHECKPOINT_LOAD: 0,
    Phase.FIRST_STEP: 1,
    Phase.COMPILE: 1,
    Phase.DATA: 1,
    Phase.FORWARD_BACKWARD: 2,
    Phase.OPTIMIZER: 3,
}
AFTER_STEP_ORDER = {
    Phase.AFTER_STEP: 10,
    Phase.EVALUATION: 11,
    Phase.CHECKPOINT_SAVE: 12,
    Phase.SNAPSHOT: 13,
    Phase.STOP: 14,
    Phase.DONE: 15,
}
# Phases whose length the rank may announce in advance (budget_s: a save's estimate).
BUDGETED_PHASES = frozenset(
    {Phase.EVALUATION, Phase.CHECKPOINT_SAVE, Phase.SNAPSHOT, Phase.CHECKPOINT_LOAD, Phase.STOP}
)
BUDGET_MULTIPLE = 2.0  # a phase with a budget may take twice its estimate before it is a hang
# The work of the start-up that marks only per module imported, not measured yet, may pause this many
# floors: the process start and its imports (launch), the model's build and the loaders (set-up). A
# graph's compilation marks each of its stages (tracing, each Inductor pass, each kernel file compiled,
# each kernel the compile workers finished: about a second apart), so the floor bounds it like any phase.
FIRST_WORK_FLOORS = 3.0
FIRST_WORK = {Phase.LAUNCH: "the imports", Phase.STARTUP: "set-up"}
MAX_NAMED = 4  # culprits named in the one-line summary; the report lists them all
GONE_STATES = {"X": "process gone (state X)", "Z": "process exited (state Z, not yet reaped)"}
STOPPED_STATES = frozenset({"T", "t"})


@dataclass(frozen=True)
class RankView:
    """One rank as its node watcher saw it. ``record`` None: the rank never published (still starting)."""

    rank: int
    node: str
    record: ProgressRecord | None
    idle_s: float  # seconds since the rank's progress token last changed, by the watcher's clock
    state: str  # /proc/<pid>/stat state letter; "X" when the process is gone
    wchan: str  # where in the kernel it sleeps ("" or "0" when running or unknown)
    read_at: float  # time.time() when the node watcher read the record: it held from record.updated to then


@dataclass(frozen=True)
class HangPolicy:
    floor_s: float  # no phase is called hung sooner
    multiple: float  # a phase may last this many times its recent median
    cap_s: float  # no phase waits longer (math.inf: no cap)

    @classmethod
    def from_config(cls, resilience: ResilienceConfig) -> HangPolicy:
        floor, multiple = float(resilience.hang_floor_s), float(resilience.hang_multiple)
        # hang_timeout_s = 0 turns the in-rank watchdog off; here it means no absolute cap.
        cap = float(resilience.hang_timeout_s) or math.inf
        return cls(floor_s=floor, multiple=multiple, cap_s=cap)


@dataclass(frozen=True)
class Culprit:
    rank: int
    node: str
    phase: str  # the phase's label
    why: str


@dataclass(frozen=True)
class Verdict:
    hung: bool
    step: int  # the lowest step among the ranks
    idle_s: float  # seconds since any rank moved
    limit_s: float  # the job's limit: the largest phase limit over the ranks
    limit_why: str
    culprits: tuple[Culprit, ...]  # empty when not hung
    waiting: str  # where the other ranks are, e.g. "rank 0 waits in stop_agreement (data, collective 37)"


def phase_limit(view: RankView, policy: HangPolicy) -> tuple[float, str]:
    """How long ``view``'s rank may go without progress in its present phase, and why."""
    record = view.record
    cap_name = _cap_name(policy)
    if view.state in GONE_STATES:  # nothing left to wait for: a gone process protects nobody
        return policy.floor_s, f"{phase_label(view)}, process gone: the floor resilience.hang_floor_s"
    if record is None:  # no task wrapper opened its board (a launcher other than relaytrain's)
        return policy.cap_s, f"start-up (no progress published yet): {cap_name}"
    if record.phase is Phase.DONE or record.phase is Phase.STOP and record.budget_s <= 0:
        # done may still finish an asynchronous save; a stop without an estimate is the hard deadline's
        return policy.cap_s, f"{record.phase.label}: {cap_name}"
    # The phase's usual longest pause between two moves (its length where it marks nothing inside)
    pause = record.pauses.get(record.phase)
    candidates = [(policy.floor_s, "the floor resilience.hang_floor_s")]
    if pause is not None:
        candidates.append(
            (policy.multiple * pause, f"{policy.multiple:g} x its usual longest pause {seconds(pause)}")
        )
    elif record.phase in FIRST_WORK:
        why = f"{FIRST_WORK_FLOORS:g} x the floor for {FIRST_WORK[record.phase]}"
        candidates.append((FIRST_WORK_FLOORS * policy.floor_s, why))
    if (record.phase in BUDGETED_PHASES or record.phase is Phase.COMPILE) and record.budget_s > 0:
        candidates.append(
            (
                BUDGET_MULTIPLE * record.budget_s,
                f"{BUDGET_MULTIPLE:g} x its budget {seconds(record.budget_s)}",
            )
        )
    limit, why = max(candidates, key=lambda c: c[0])
    if limit > policy.cap_s:
        return policy.cap_s, f"{record.phase.label}: {why}, capped by {cap_name}"
    return limit, f"{record.phase.label}: {why}"


def _cap_name(policy: HangPolicy) -> str:
    return f"the cap resilience.hang_timeout_s ({seconds(policy.cap_s)})"


def assess(views: list[RankView], policy: HangPolicy, world_size: int) -> Verdict:
    """The job's verdict from every rank's view; ranks of ``world_size`` without a view are starting."""
    limits = [(*phase_limit(v, policy), f"rank {v.rank}") for v in views]
    missing = sorted(set(range(world_size)) - {v.rank for v in views})
    if missing:
        limits.append((policy.cap_s, f"start-up (no view yet): {_cap_name(policy)}", ranks(missing)))
    limit, why, who = max(limits, key=lambda item: item[0], default=(policy.cap_s, "no rank seen", "none"))
    published = [v.record for v in views if v.record is not None]
    idle = min((v.idle_s for v in views), default=0.0)
    # A job whose every rank is done has finished: its exit is the launcher's business, not a hang.
    hung = any(r.phase is not Phase.DONE for r in published) and idle > limit
    step = min((r.step for r in published), default=0)
    if not hung:
        return Verdict(False, step, idle, limit, f"{who} in {why}", (), "")
    named = _culprits(views)
    blamed = {v.rank for v, _ in named}
    culprits = tuple(Culprit(v.rank, v.node, phase_label(v), why) for v, why in named)
    waiting = _where_others_are([v for v in views if v.rank not in blamed])
    return Verdict(True, step, idle, limit, f"{who} in {why}", culprits, waiting)


def _culprits(views: list[RankView]) -> list[tuple[RankView, str]]:
    """The ranks that hold the job, each with why; never empty when ``views`` is not."""
    held = [(v, why) for v in views if (why := _process_state(v))]
    if held:
        return held
    waiters = [v for v in views if v.record is not None and v.record.in_collective]
    outside = [v for v in views if v.record is None or not v.record.in_collective]
    if waiters and outside:
        names = ", ".join(sorted({v.record.collective or "a collective" for v in waiters if v.record}))
        others = f"{ranks([v.rank for v in waiters])} {'wait' if len(waiters) > 1 else 'waits'} in {names}"
        return [(v, f"{_outside_why(v)}, while {others}{_kernel(v)}") for v in outside]
    off_sequence = _off_sequence(waiters)
    if off_sequence:
        return off_sequence
    desynced = [(v, why) for v in views if (why := _desync(v))]
    # Every rank off its usual count is a step unlike the others (an evaluation's), not one rank's skip.
    if desynced and len(desynced) < len(views):
        return desynced
    lowest = min(progress_key(v) for v in views)
    behind = [v for v in views if progress_key(v) == lowest]
    alone = "furthest behind" if len(behind) < len(views) else "no rank is ahead of it (all stopped alike)"
    return [(v, f"{alone}: {_position(v)}{_kernel(v)}") for v in behind]


def _process_state(view: RankView) -> str:
    if view.state in GONE_STATES:
        return GONE_STATES[view.state]
    if view.state in STOPPED_STATES:
        return f"stopped (state {view.state}: SIGSTOP or a debugger)"
    if view.state == "D":
        where = f", wchan {view.wchan}" if _sleeps_at(view) else ""
        return f"blocked in the kernel (state D{where})"
    return ""


def _outside_why(view: RankView) -> str:
    if view.record is None:
        return "never published its progress (start-up)"
    return "not in a collective"


def _off_sequence(waiters: list[RankView]) -> list[tuple[RankView, str]]:
    """Ranks waiting in a collective other than the one they entered at this place in the step before,
    while other ranks wait in that one: they skipped it (desynchronised). Every rank off its sequence
    alike is a step unlike the one before (a log or save step), not one rank's skip."""
    records = [v for v in waiters if v.record is not None and v.record.expected_collective]
    off = [v for v in records if v.record.collective != v.record.expected_collective]
    on = {v.record.collective for v in records if v.record.collective == v.record.expected_collective}
    culprits = [v for v in off if v.record.expected_collective in on]
    return [
        (
            v,
            f"waits in {v.record.collective} where the step before entered {v.record.expected_collective}, "
            f"in which {_who_waits(records, v.record.expected_collective)}: it skipped it (desynchronised)",
        )
        for v in culprits
    ]


def _who_waits(views: list[RankView], name: str) -> str:
    waiting = [v.rank for v in views if v.record is not None and v.record.collective == name]
    return f"{ranks(waiting)} {'wait' if len(waiting) > 1 else 'waits'}"


def _desync(view: RankView) -> str:
    r = view.record
    if r is None or r.usual_step_collectives <= 0 or r.last_step_collectives == r.usual_step_collectives:
        return ""
    entered, usual = r.last_step_collectives, r.usual_step_collectives
    if entered < usual:
        return f"skipped a collective in step {r.step} (entered {entered} of the usual {usual})"
    return f"entered an extra collective in step {r.step} ({entered}, usually {usual})"


def _position(view: RankView) -> str:
    r = view.record
    if r is None:
        return "never published its progress (start-up)"
    return f"step {r.step}, {r.phase.label}, {r.collectives_entered} collectives entered"


def _kernel(view: RankView) -> str:
    """Where a sleeping rank sleeps (a FIFO or pipe read, a futex of a stalled loader), or that it runs."""
    if view.state == "S" and _sleeps_at(view):
        return f"; asleep in the kernel at {view.wchan} (state S)"
    if view.state == "R":
        return "; running (state R)"
    return ""


def _sleeps_at(view: RankView) -> bool:
    return view.wchan not in ("", "0", "-")


def _where_others_are(views: list[RankView]) -> str:
    """Where the ranks that are not culprits wait, grouped: "ranks 0,2-3 wait in x (data, collective 7)"."""
    groups: dict[tuple, list[int]] = {}
    for v in sorted(views, key=lambda v: v.rank):
        r = v.record
        if r is None:
            key: tuple = ("start",)
        elif r.in_collective:
            key = ("wait", r.collective or "a collective", r.phase.label, r.collectives_entered)
        else:
            key = ("in", r.phase.label, r.step)
        groups.setdefault(key, []).append(v.rank)
    parts = []
    for key, members in groups.items():
        many = len(members) > 1
        if key[0] == "start":
            parts.append(f"{ranks(members)} never published (start-up)")
        elif key[0] == "wait":
            verb = "wait" if many else "waits"
            parts.append(f"{ranks(members)} {verb} in {key[1]} ({key[2]}, collective {key[3]})")
        else:
            parts.append(f"{ranks(members)} {'are' if many else 'is'} in {key[1]} at step {key[2]}")
    return "; ".join(parts)


def progress_key(view: RankView) -> tuple[int, int, int]:
    """How far a rank got: (step, phase order, collectives entered); a rank never published is lowest."""
    r = view.record
    if r is None:
        return (-1, -1, -1)
    if r.phase in IN_STEP_ORDER:  # working on the step after the last finished one
        return (r.step + 1, IN_STEP_ORDER[r.phase], r.collectives_entered)
    return (r.step, AFTER_STEP_ORDER[r.phase], r.collectives_entered)


def phase_label(view: RankView) -> str:
    return view.record.phase.label if view.record is not None else "start-up"


def hang_line(verdict: Verdict, report: str) -> str:
    """The one job-log line of a hang: culprits with node, phase and why, idle and limit, the others, the
    report."""
    named = [f"rank {c.rank} on {c.node} in {c.phase} ({c.why})" for c in verdict.culprits[:MAX_NAMED]]
    if len(verdict.culprits) > MAX_NAMED:
        named.append(f"and {len(verdict.culprits) - MAX_NAMED} more ranks")
    parts = [
        f"{', '.join(named) or 'no rank named'} at step {verdict.step}",
        f"{seconds(verdict.idle_s)} without progress (limit {seconds(verdict.limit_s)}: {verdict.limit_why})",
    ]
    if verdict.waiting:
        parts.append(verdict.waiting)
    parts.append(f"report {report}")
    return "hang detected: " + one_line("; ".join(parts))


def one_line(text: str) -> str:
    """Names from a rank or /proc (a collective, a wchan) cannot break the line or the table."""
    return "".join(c if c.isprintable() else " " for c in text)


def seconds(value: float) -> str:
    if math.isinf(value):
        return "no limit"
    return f"{value:.0f} s" if value >= 10 else f"{value:.2g} s"


def ranks(numbers: list[int] | set[int]) -> str:
    """ "rank 3", "ranks 0,2-3": runs of consecutive ranks compressed."""
    ordered = sorted(set(numbers))
    runs: list[list[int]] = []
    for n in ordered:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    text = ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
    return f"{'ranks' if len(ordered) > 1 else 'rank'} {text}"
