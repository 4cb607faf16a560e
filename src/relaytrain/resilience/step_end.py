"""After a job step ended: one decision about what happens to the job, and why.

The generated batch script runs ``python -m relaytrain.resilience.step_end --exit-code N ...`` once after
the job step (it runs outside the step, so it survives the ranks). ``decide`` reads the facts (the
step's exit code, ``run_state.json`` as the step left it, this job's crashes, the job log) and says:

* **fail**, nothing touched: the step was refused because another run holds the run directory
  (``run.lock``; its output says so);
* **requeue** or **fail** after a crash of relaytrain's trainer (``crash.classify``): requeued from the
  last complete checkpoint while the job had fewer than ``resilience.max_crash_requeues`` crashes,
  else recorded as ``crash_loop`` (or ``crash`` when requeueing is off or outside Slurm);
* **requeue** or **fail** after a ``--command`` program exited 75 without recording its stop through
  ``relaytrain.program``: its request to continue (``program_exit``), capped by ``resilience.max_requeues``;
* **requeue** when ``run_state.json`` says ``requeue_pending``: the run asked for a requeue it could not do
  (no ``scontrol`` inside a container, or it failed);
* else **finished** (the step exited 0, or the run's own stop decided and did its requeue) or **fail**
  (the run failed and is not retried: NaN, a damaged checkpoint, a config error, a program's exit code).

``perform`` carries it out: ``crashes.jsonl``, ``run_state.json``, and ``requeue.requeue``, the one
function that requeues a job (the run's own stop path calls it too).
"""

from __future__ import annotations

import argparse
import enum
import json
import logging
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relaytrain.config.schema import ResilienceConfig
from relaytrain.job import JobFacts, RunDir
from relaytrain.job.rundir import metrics_record
from relaytrain.resilience.codes import EXIT_RESUME, StopReason
from relaytrain.resilience.crash import CRASH_LOG_FILE, CrashLog, cause_of, classify
from relaytrain.resilience.requeue import StateRecord, decide_requeue, requeue
from relaytrain.resilience.run_lock import is_busy_refusal
from relaytrain.resilience.run_state import RunStateFile

log = logging.getLogger(__name__)

# The keys RunStateFile.write sets itself: a record rewritten from run_state.json passes the others on.
_RECORD_KEYS = ("status", "reason", "step", "requeue_requested", "requeue_pending", "requeued")


class Action(enum.Enum):
    FINISHED = "finished"  # nothing left to do: the step ended well, or the run's own stop decided
    REQUEUE = "requeue"  # requeue the job: it resumes from the last complete checkpoint
    FAIL = "fail"  # the job ends here and is not requeued


@dataclass(frozen=True)
class RunFacts:
    """What the run directory and the job's output say about the step that ended."""

    state: dict[str, Any] | None  # run_state.json as the step left it
    earlier_crashes: int  # crashes of this job in crashes.jsonl
    job_log_tail: str  # this run's part of the job's output

    @classmethod
    def read(cls, run_dir: Path | str, job: JobFacts, job_log_tail: str = "") -> RunFacts:
        # The output file holds every run of the job (--open-mode=append): keep only this run's part.
        start = job_log_tail.rfind(f"restart count {job.restart_count},")
        tail = job_log_tail[start:] if start >= 0 else job_log_tail
        return cls(RunStateFile(run_dir).read(), CrashLog(run_dir).count(job.job_id), tail)


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str  # why, for a human
    say: tuple[str, ...] = ()  # the job log's lines about it
    record: StateRecord | None = None  # what run_state.json is to say (None: it stays as the step left it)
    crash: Mapping[str, Any] | None = None  # the crashes.jsonl entry to append
    program_stop: bool = False  # a program's stop: also a `stop` event in metrics.jsonl
    requeue_why: str = "the job"  # completes "could not requeue ..." when scontrol fails


def decide(
    exit_code: int, run: RunFacts, resilience: ResilienceConfig, job: JobFacts, *, program: bool = False
) -> Decision:
    """What happens after a step of relaytrain's trainer (``program=False``) or of a ``--command``
    program that ended with ``exit_code``."""
    if exit_code != 0 and is_busy_refusal(run.job_log_tail):
        # The run directory belongs to another job or process: its files are not this job's to touch.
        why = "the run directory was in use by another run; nothing to recover"
        return Decision(Action.FAIL, why, (f"step exit code {exit_code}: {why}",))
    if program:
        return _after_program(exit_code, run, resilience, job)
    crash, why = classify(run.state, job, exit_code)
    if crash:
        return _after_crash(exit_code, why, run, resilience, job)
    say = (f"step exit code {exit_code} is not a crash to recover from: {why}",) if exit_code else ()
    return _pending(run, job, say) or Decision(_settled(exit_code, run.state, job), why, say)


def _after_crash(
    exit_code: int, why: str, run: RunFacts, resilience: ResilienceConfig, job: JobFacts
) -> Decision:
    r, state = resilience, run.state
    step = int(state.get("step", 0)) if state else 0
    cause = cause_of(exit_code, why, state, run.job_log_tail)
    allowed = r.requeue and job.in_slurm and run.earlier_crashes < r.max_crash_requeues
    count = run.earlier_crashes + 1
    if allowed:
        reason = "crash"
        message = f"crash {count} of this job ({why}); requeuing from the last complete checkpoint"
    else:
        reason = "crash_loop" if r.requeue and job.in_slurm else "crash"
        message = (
            f"crash {count} of job {job.job_id}: "
            f"resilience.max_crash_requeues={r.max_crash_requeues} reached; "
            f"fix the cause (see {CRASH_LOG_FILE} and the job log) and resubmit"
            if reason == "crash_loop"
            else f"crash ({why}); not requeued (resilience.requeue is off or not in SLURM)"
        )
    facts = {
        **job.identity(),
        "saved": False,
        "exit_code": exit_code,
        "message": message[:500],
        "crash": cause,
        "crash_count": count,
        "max_crash_requeues": r.max_crash_requeues,
    }
    return Decision(
        Action.REQUEUE if allowed else Action.FAIL,
        message,
        (message,),
        StateRecord("failed", reason, step, facts),
        crash={**job.identity(), "step": step, **cause},
        requeue_why="after the crash",
    )


def _after_program(exit_code: int, run: RunFacts, resilience: ResilienceConfig, job: JobFacts) -> Decision:
    """Exit 75 asks for the program to be continued (docs/programs.md), unless it recorded its stop."""
    state = run.state or {}
    if exit_code != EXIT_RESUME:
        why = f"the program exited {exit_code}"
        return _pending(run, job) or Decision(Action.FINISHED if exit_code == 0 else Action.FAIL, why)
    if _written_by(state, job) and state.get("status") in ("stopped", "failed", "finished"):
        recorded = f"{state.get('reason')}, requeue {state.get('requeue_requested')}"
        why = f"the program recorded its stop ({recorded})"
        return _pending(run, job, (why,)) or Decision(_settled(exit_code, state, job), why, (why,))
    r = resilience
    step = int(state.get("step", -1)) if state.get("status") == "running" else -1
    reason = StopReason.PROGRAM_EXIT
    wanted = decide_requeue(reason, r.requeue, r.max_requeues, job.restart_count, job.in_slurm)
    message = f"the program exited {EXIT_RESUME} without recording a stop: continue it"
    facts = {**job.identity(), "saved": True, "exit_code": EXIT_RESUME, "message": message}
    say = [f"exit {EXIT_RESUME}: requeue {'requested' if wanted else 'refused'}"]
    why = message
    if not wanted and job.in_slurm and r.requeue:
        capped = f"not requeuing: SLURM_RESTART_COUNT={job.restart_count} reached resilience.max_requeues="
        why += f"; {capped}{r.max_requeues}"
        say.insert(0, f"{capped}{r.max_requeues}")
    elif not wanted:
        why += "; not requeued (resilience.requeue is off or not in SLURM)"
    return Decision(
        Action.REQUEUE if wanted else Action.FAIL,
        why,
        tuple(say),
        StateRecord("stopped", reason.label, step, facts),
        program_stop=True,
    )


def _pending(run: RunFacts, job: JobFacts, say: tuple[str, ...] = ()) -> Decision | None:
    """A requeue the run asked for and could not do (no scontrol inside the container, or it failed)."""
    state = run.state
    if not (state and state.get("requeue_pending") is True and job.in_slurm):
        return None
    why = "the run asked for a requeue it could not do"
    facts = {k: v for k, v in state.items() if k not in _RECORD_KEYS}  # its time and host included
    record = StateRecord(str(state["status"]), str(state.get("reason", "")), int(state.get("step", 0)), facts)
    line = f"{why}: scontrol requeue {job.requeue_id}"
    return Decision(Action.REQUEUE, why, (*say, line), record, requeue_why="what the run asked for")


def _written_by(state: Mapping[str, Any], job: JobFacts) -> bool:
    """Whether this run of the job (its id and restart count) wrote ``state``."""
    written = (str(state.get("job_id", "")), int(state.get("restart_count", -1)))
    return written == (job.job_id, job.restart_count)


def _settled(exit_code: int, state: Mapping[str, Any] | None, job: JobFacts) -> Action:
    """No crash, nothing to requeue: finished when the step exited 0 or this run recorded a stop or its
    end, else failed."""
    if exit_code == 0:
        return Action.FINISHED
    ended = bool(state) and _written_by(state, job) and state.get("status") in ("stopped", "finished")
    return Action.FINISHED if ended else Action.FAIL


def perform(decision: Decision, job: JobFacts, run_dir: Path | str) -> bool:
    """Carry the decision out: the crash record, run_state.json, the requeue. Returns whether it requeued."""
    if decision.crash is not None:
        CrashLog(run_dir).append({**decision.crash, "time": round(time.time(), 3)})
    for line in decision.say:
        print(f"relaytrain: {line}", flush=True)
    requeued = False
    run_state = RunStateFile(run_dir)
    if decision.record is not None:
        if decision.action is Action.REQUEUE:
            requeued = requeue(job, run_state, decision.record, decision.requeue_why)
        else:
            decision.record.write(run_state, requeue=False)
    if decision.program_stop and decision.record is not None:
        _note_program_stop(run_dir, decision.record, decision.action is Action.REQUEUE)
    return requeued


def _note_program_stop(run_dir: Path | str, record: StateRecord, requested: bool) -> None:
    """The `stop` event relaytrain.program writes for a stop it records, so that `relaytrain status` and
    `report` tell this stop like the others. One JSON line, as monitor/'s sink writes it (same layer)."""
    fields = {"saved": record.facts.get("saved"), "requeue_requested": requested}
    event = metrics_record("event", record.step, {"event": "stop", "reason": record.reason, **fields,
                                                  "exit_code": record.facts.get("exit_code")})  # fmt: skip
    path = RunDir(Path(run_dir)).metrics
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(event, allow_nan=False) + "\n")
    except OSError as error:
        log.warning("could not record the stop in %s: %s", path, error)


def end_step(
    run_dir: Path | str,
    exit_code: int,
    resilience: ResilienceConfig,
    *,
    program: bool = False,
    job_log_tail: str = "",
    env: Mapping[str, str] | None = None,
) -> Decision:
    """Decide and perform what follows the step that ended with ``exit_code``; returns the decision."""
    job = JobFacts.from_env(env)
    decision = decide(exit_code, RunFacts.read(run_dir, job, job_log_tail), resilience, job, program=program)
    perform(decision, job, run_dir)
    return decision


def _tail(path: str, size: int = 65536) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def main(argv: list[str] | None = None, prog: str = "python -m relaytrain.resilience.step_end") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--exit-code", type=int, required=True, help="the job step's exit code")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--config", default="", help="the run's resolved config (TOML)")
    parser.add_argument("--job-log", default="", help="the job's output file (srun names the dead tasks)")
    parser.add_argument("--program", action="store_true", help="the step ran a --command program")
    args = parser.parse_args(argv)
    return run(args.run_dir, args.exit_code, args.config, args.program, args.job_log)


def run(run_dir: str, exit_code: int, config: str = "", program: bool = False, job_log: str = "") -> int:
    """The command line's work: always exit 0, the decision is in the job log and run_state.json."""
    # Its own `scontrol requeue` ends this batch job, and Slurm's SIGTERM reaches this process too (a
    # child of the batch shell), at any moment after that call: the record must still be written and
    # the exit be 0, or the script logs the check as failed.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="relaytrain: %(message)s", stream=sys.stdout)
    if config:
        from relaytrain.config import load_config

        resilience = load_config(config).resilience
    else:
        resilience = ResilienceConfig()
    end_step(run_dir, exit_code, resilience, program=program, job_log_tail=_tail(job_log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
