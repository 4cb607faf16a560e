"""What one hang trial measured and whether it passed, read from the run's job log, metrics and hang record
(bench/cluster/chaos_hangs.py runs the trials; chaos_hangs_page.py puts them on the page).

The times: the fault's (the bench's SIGSTOP, or the Unix time on the fault's landed line), the detection's
(hang/last.json's `detected_at` when its line is the job log's `hang detected:` line, else the line's own
stamp: `[relaytrain 2026-11-27T03:10:08]` from the batch driver, or a rank log's `2026-11-27 03:10:08`
prefix, whole seconds), and the first step after the restart (the `time` of the first train record that
carries `step_restart`). A clean trial passes with no `hang detected:` line and no restart; its
``restart`` variant (one rank SIGKILLed by the bench) instead with the killed process gone and a
restart in place that crashes.jsonl records (action restart, cause not a hang). Pure functions of text
and records: tests/test_bench_chaos_hangs.py feeds them synthetic logs.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from relaytrain.resilience.batch.crash import RESTARTED
from relaytrain.resilience.hangs.monitor import NEAREST

from bench.cluster.ledger_figures import time_adds_up

DETECTED = "hang detected:"
MISMATCH = "Is there a distributed collective mismatch"  # gloo's error when a rank skipped a collective
STAMP = re.compile(r"^\[[^\]]*\]\s*")  # `[relaytrain 2026-11-27T03:07:48] ` in front of a line
SLOW = "straggler hint:"  # the hang monitor's line of a rank behind (issue 53)
SLOW_BEFORE = "slow rank:"  # its name in trials kept before issue 53
DETECTION_TARGET_S = 60.0  # the target for the debug config
# A rank that stops itself (SIGSTOP) as it publishes a phase (faults/: stop_in_phase), issue 53's cases:
# (a) the restore of the 1.2 GB wide state, (b) a graph's compilation, (c) the rendezvous of a restart in
# place, (e) a sync save of the wide state, (f) an evaluation: (the phase's label, the clean variant whose
# config it runs (chaos_hangs_clean.py), checkpoint.mode, the job step it stops in: 1 is the restart in
# place after the bench SIGKILLed a rank).
PHASE_KINDS = {
    "hang_stop_restore": ("checkpoint load", "wide", "sync", 1),
    "hang_stop_compile": ("compilation", "compile", "async", 0),
    "hang_stop_rendezvous": ("rendezvous", "debug", "async", 1),
    "hang_stop_save": ("checkpoint save", "wide", "sync", 0),
    "hang_stop_eval": ("evaluation", "debug", "async", 0),
}
# (d): the bench SIGSTOPs a rank in the middle of a step of the ``long`` variant (every layer's forward
# delayed, faults/: layer_delay_s), a step whose median is at least LONG_STEP_S
LONG_STEP = "hang_stop_long_step"
LONG_STEP_S = 20.0
HANG_KINDS = ("hang_stop_rank0", "hang_stop_rank1", "hang_fifo", "hang_loader_stall", "hang_skip_collective")
HANG_KINDS += (*PHASE_KINDS, LONG_STEP)
KINDS = (*HANG_KINDS, "slow_rank", "clean")
_STAMPS = (
    re.compile(r"\[relaytrain (\d{4}-\d\d-\d\d)T(\d\d:\d\d:\d\d(?:\.\d+)?)\]"),  # the batch driver's log()
    re.compile(r"^\s*(\d{4}-\d\d-\d\d)[ T](\d\d:\d\d:\d\d(?:[.,]\d+)?)"),  # relaytrain's logging format
)


@dataclass
class HangTrial:
    index: int
    kind: str
    seed: str = ""
    variant: str = ""  # a clean trial's (chaos_hangs_clean.py)
    mode: str = ""  # a clean trial's checkpoint.mode
    rank: int = -1  # the faulted rank (-1: none, a clean run)
    node: str = ""  # its node
    at_step: int = -1  # the step the fault was aimed at
    job: str = ""
    fault_time: float | None = None  # Unix time of the SIGSTOP, or on the landed line
    detection_s: float | None = None  # fault -> `hang detected:`
    detection_source: str = ""
    detections: int = 0  # `hang detected:` lines in the job log
    culprits: list[dict] = field(default_factory=list)  # hang/last.json's
    culprit_correct: bool = False
    restart_s: float | None = None  # fault -> the first step after the restart
    step_restarts: int = 0  # restarts in place (the highest step_restart in metrics.jsonl)
    slow_lines: list[str] = field(default_factory=list)  # `straggler hint:` lines that name the faulted rank
    restarts: int = 0  # Slurm requeues
    resubmits: int = 0
    bit_exact: bool = False
    steps_replayed: int = 0
    latest_complete: bool = False
    leftovers: list[str] = field(default_factory=list)
    final_status: str = ""
    checks: dict[str, bool] = field(default_factory=dict)
    detail: str = ""
    seconds: float = 0.0
    error: str = ""
    hit: list[str] = field(default_factory=list)  # what the bench's own fault reached (the SIGSTOP)
    evidence: list[str] = field(default_factory=list)  # what shows the fault landed (or the clean run's load)
    verify_exit: int | None = None  # as chaos_run.Trial's
    verify: list[str] = field(default_factory=list)
    ledger: dict = field(default_factory=dict)
    # a clean trial's: per phase, the pause that came nearest its limit over the run's job steps (the hang
    # monitor's line), as [pause s, limit s]
    nearest: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (
            bool(self.evidence)
            and not self.error
            and self.bit_exact
            and self.latest_complete
            and not self.leftovers
            and self.final_status == "finished"
            and time_adds_up(self) is not False
            and all(self.checks.values())
        )


def line_time(line: str) -> float | None:
    """The Unix time a job-log or rank-log line is stamped with (local time, as written), None if none."""
    for stamp in _STAMPS:
        found = stamp.search(line)
        if found:
            return datetime.fromisoformat(f"{found[1]}T{found[2].replace(',', '.')}").timestamp()
    return None


@dataclass(frozen=True)
class Detection:
    line: str
    time: float | None
    source: str  # where the time came from; "" when nothing gives one


def detections(log: str, record: dict[str, Any]) -> list[Detection]:
    """Each `hang detected:` line of the job log, with its time: the hang record's `detected_at` (to the
    millisecond) for the line it recorded, else the line's stamp (whole seconds)."""
    recorded = str(record.get("line") or "")
    at = record.get("detected_at")
    found = []
    for line in log.splitlines():
        # The monitor's line starts with it (after a time stamp, where one is put in front); the end-of-step
        # decision's "crash (hang detected: ...)" quotes it and is not a detection of its own.
        if not STAMP.sub("", line, count=1).startswith(DETECTED):
            continue
        said = line[line.index(DETECTED) :].strip()
        if isinstance(at, int | float) and recorded.strip() and recorded.strip() in said:
            found.append(Detection(said, float(at), "hang/last.json detected_at"))
        elif (stamped := line_time(line)) is not None:
            found.append(Detection(said, stamped, "job log stamp"))
        else:
            found.append(Detection(said, None, ""))
    if not found and recorded and isinstance(at, int | float):  # the record without its log line
        found.append(Detection(recorded, float(at), "hang/last.json only (no job-log line)"))
    return found


def culprit_correct(record: dict[str, Any], rank: int, node: str) -> bool:
    """The hang record names exactly the faulted rank, and its node."""
    culprits = [c for c in record.get("culprits") or [] if isinstance(c, dict)]
    ranks = {c.get("rank") for c in culprits}
    nodes = {c.get("node") for c in culprits}
    return bool(culprits) and ranks == {rank} and nodes == {node}


def step_restarts(records: list[dict[str, Any]]) -> int:
    return max((int(r.get("step_restart") or 0) for r in records), default=0)


def first_step_after_restart(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first train record of a restarted step (metrics.jsonl order), None when no step restarted."""
    return next(
        (r for r in records if r.get("kind") == "train" and int(r.get("step_restart") or 0) >= 1), None
    )


def slow_lines(log: str, rank: int) -> list[str]:
    """The `straggler hint:` lines (`slow rank:` in older logs) of the job log that name `rank`."""
    lines = []
    for start in (SLOW, SLOW_BEFORE):
        named = re.compile(rf"{re.escape(start)}.*\brank {rank}\b")
        lines += [line[line.index(start) :].strip() for line in log.splitlines() if named.search(line)]
    return lines


def _judge_backend_mismatch(trial: HangTrial, records: list[dict[str, Any]]) -> None:
    """gloo pairs the skipper's next collective with the one the others wait in and fails both at once on
    the size mismatch: a crash (the end-of-step decision restarts the step), not a hang to detect."""
    restart = next(
        (r for r in records if r.get("kind") == "event" and r.get("event") == "step_restart"), None
    )
    if restart is not None and trial.fault_time is not None:
        trial.detection_s = round(float(restart["time"]) - trial.fault_time, 1)
        trial.detection_source = "the backend's collective mismatch error (step_restart event)"
    again = first_step_after_restart(records)
    if again is not None and trial.fault_time is not None:
        trial.restart_s = round(float(again["time"]) - trial.fault_time, 1)
    trial.detail += "; gloo failed the mismatched collective at once (a crash, no hang)"
    trial.checks["no hang detected"] = trial.detections == 0
    trial.checks["the backend failed the mismatch, the step restarted in place"] = (
        trial.step_restarts >= 1 and trial.restarts == 0 and trial.restart_s is not None
    )


NEAREST_PART = re.compile(r"(?P<phase>[^;]+?) (?P<idle>\d+(?:\.\d+)?) s of (?P<limit>\d+(?:\.\d+)?) s")


def nearest_pauses(log: str) -> dict[str, list[float]]:
    """Per phase, the pause nearest its limit over every `hang monitor: the pause nearest its limit, per
    phase:` line of a job log (one per job step that ended without a hang), as [pause, limit]."""
    nearest: dict[str, list[float]] = {}
    for line in log.splitlines():
        if NEAREST not in line:
            continue
        for part in line.split(NEAREST, 1)[1].split(";"):
            m = NEAREST_PART.fullmatch(part.strip())
            if m is None:
                continue
            idle, limit = float(m["idle"]), float(m["limit"])
            was = nearest.get(m["phase"])
            if limit > 0 and (was is None or idle / limit > was[0] / was[1]):
                nearest[m["phase"]] = [idle, limit]
    return nearest


def long_steps(trial: HangTrial, records: list[dict[str, Any]]) -> bool:
    """The median step time of the run's first job step before the fault is at least LONG_STEP_S (said
    in the trial's detail)."""
    before = trial.fault_time if trial.fault_time is not None else float("inf")
    times = [float(r["time_step_s"]) for r in records
             if r.get("kind") == "train" and not r.get("step_restart") and "time_step_s" in r
             and float(r.get("time", 0)) <= before]  # fmt: skip
    if not times:
        return False
    median = statistics.median(times)
    trial.detail += f"; step median {median:.1f} s over {len(times)} steps before the fault"
    return median >= LONG_STEP_S


def restarted_for_the_kill(crashes: Sequence[dict[str, Any]]) -> bool:
    """crashes.jsonl holds a restart in place whose cause is not a hang (the killed rank's crash)."""
    return any(c.get("action") == RESTARTED and not c.get("hang") for c in crashes)


def restarted_for_the_hang(crashes: Sequence[dict[str, Any]]) -> bool:
    """crashes.jsonl holds the hang's crash, and the step was restarted in place for it (the job may be
    requeued later for another cause, its time budget: that is not the hang's answer)."""
    hung = [c for c in crashes if c.get("hang")]
    return bool(hung) and hung[0].get("action") == RESTARTED


def judge(
    trial: HangTrial,
    log: str,
    record: dict[str, Any],
    records: list[dict[str, Any]],
    crashes: Sequence[dict[str, Any]] = (),
) -> None:
    """Fill in what the finished trial measured and its checks (the bench filled in the fault and the
    run's end: evidence, fault_time, rank, node, bit_exact, final_status, ...)."""
    found = detections(log, record)
    trial.detections = len(found)
    trial.step_restarts = step_restarts(records)
    again = first_step_after_restart(records)
    if again is not None and trial.fault_time is not None:
        trial.restart_s = round(float(again["time"]) - trial.fault_time, 1)
    trial.culprits = [c for c in record.get("culprits") or [] if isinstance(c, dict)]
    if trial.kind == "clean":
        trial.nearest = nearest_pauses(log)
    if trial.kind == "hang_skip_collective" and not found and MISMATCH in log:
        _judge_backend_mismatch(trial, records)
    elif trial.kind in HANG_KINDS:
        first = found[0] if found else None
        if first is not None and first.time is not None and trial.fault_time is not None:
            trial.detection_s = round(first.time - trial.fault_time, 1)
            trial.detection_source = first.source
        trial.culprit_correct = culprit_correct(record, trial.rank, trial.node)
        trial.checks["hang detected once"] = trial.detections == 1
        detected = trial.detection_s is not None and 0 <= trial.detection_s <= DETECTION_TARGET_S
        trial.checks[f"detected within {DETECTION_TARGET_S:g} s"] = detected
        trial.checks["culprit rank and node named"] = trial.culprit_correct
        trial.checks["restarted in place"] = restarted_for_the_hang(crashes) and trial.restart_s is not None
        if trial.kind == LONG_STEP:
            trial.checks[f"step median >= {LONG_STEP_S:g} s"] = long_steps(trial, records)
    elif trial.kind == "slow_rank":
        trial.slow_lines = slow_lines(log, trial.rank)
        trial.checks["reported as slow, naming the rank"] = bool(trial.slow_lines)
        trial.checks["no hang detected"] = trial.detections == 0
        trial.checks["no restart"] = trial.step_restarts == 0 and trial.restarts == 0
    elif trial.kind == "clean" and trial.variant == "restart":
        trial.checks["no hang detected"] = trial.detections == 0
        trial.checks["the killed rank's process gone"] = any(h.endswith(": gone") for h in trial.hit)
        in_place = trial.step_restarts >= 1 and trial.restarts == 0 and trial.resubmits == 0
        trial.checks["restarted in place for the kill"] = in_place and restarted_for_the_kill(crashes)
    elif trial.kind == "clean":
        trial.checks["no hang detected"] = trial.detections == 0
        trial.checks["no restart"] = trial.step_restarts == 0 and trial.restarts == 0 and not crashes
        if trial.variant == "long":  # its steps as long as the long-step hang trial's, or it proves nothing
            trial.checks[f"step median >= {LONG_STEP_S:g} s"] = long_steps(trial, records)
    else:
        raise ValueError(f"no hang trial kind {trial.kind!r}; the kinds: {', '.join(KINDS)}")
