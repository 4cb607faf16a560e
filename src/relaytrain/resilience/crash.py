"""After a job step crashed: record the cause, and requeue the job until resilience.max_crash_requeues.

A crash is a job step that ended nonzero without a resumable stop: a rank killed (SIGKILL, the OOM
killer, a segfault), an exception, the hang watchdog, or a process that died before it wrote anything.
The generated batch script runs ``python -m relaytrain.resilience.crash`` after the step (it runs
outside the step, so it survives the ranks) and this module decides from ``run_state.json``:

* the step was refused because another run holds the run directory (``run.lock``; its output says
  so): not this job's run, nothing is recorded;
* ``stopped`` or ``finished`` by the current run: not a crash (the stop path already decided; torchrun
  exits 128 + the signal after a stop signal even when every worker saved);
* ``failed`` with reason ``nan`` or ``damaged_checkpoint`` (no checkpoint of the run loads), a
  UserError recorded as the message (a full disk during a save), or a step exit code 2 (a config or
  usage error): a deterministic failure, never requeued;
* ``failed`` with reason ``error`` or ``hang``, ``running``, or a marker written by an earlier run (the
  process died before or while loading its checkpoint): a crash.

Crashes are counted per SLURM job in ``<run_dir>/crashes.jsonl`` (one line per crash, never rewritten),
so a job resubmitted by hand starts with a fresh allowance; time-limit requeues have their own cap
(``max_requeues``). The requeued job resumes from the last complete checkpoint as after any requeue.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from relaytrain.job import JobFacts
from relaytrain.resilience.requeue import scontrol_requeue
from relaytrain.resilience.run_lock import is_busy_refusal
from relaytrain.resilience.run_state import RunStateFile

log = logging.getLogger(__name__)

CRASH_LOG_FILE = "crashes.jsonl"
USAGE_ERROR_EXIT = 2  # relaytrain's CLI exits 2 on a UserError/ConfigError: retrying cannot help
# nan: the same data would fail again; damaged_checkpoint: the same files would (the user must decide)
NEVER_REQUEUED_REASONS = frozenset({"nan", "damaged_checkpoint"})
CRASH_REASONS = frozenset({"error", "hang"})
# srun reports each task that died: `srun: error: node2: task 1: Killed` (or `... Exited with exit code 3`)
_SRUN_TASK_ERROR = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): (.+)")
# torchrun (one node) exits 1 whatever killed its worker; its failure summary names the signal
_TORCHRUN_SIGNAL = re.compile(r"Signal \d+ \((SIG[A-Z0-9]+)\) received by PID")


def signal_of(exit_code: int) -> str:
    """`SIGKILL` for 137 (128 + 9, the shells' convention), else empty."""
    if 128 < exit_code < 128 + 65:
        try:
            return signal.Signals(exit_code - 128).name
        except ValueError:
            return ""
    return ""


def srun_task_errors(job_log_tail: str) -> list[dict[str, str]]:
    """The `srun: error: NODE: task N: WHAT` lines of the job's output: which node and rank died, and how."""
    return [
        {"node": node, "tasks": tasks, "what": what.strip()}
        for node, tasks, what in _SRUN_TASK_ERROR.findall(job_log_tail)
    ]


def torchrun_signals(job_log_tail: str) -> list[str]:
    """`SIGKILL` for each `Signal 9 (SIGKILL) received by PID ...` of torchrun's failure summary."""
    return sorted(set(_TORCHRUN_SIGNAL.findall(job_log_tail)))


def classify(state: Mapping[str, Any] | None, job: JobFacts, exit_code: int) -> tuple[bool, str]:
    """(is it a crash to recover from, why). ``state`` is run_state.json as the step left it."""
    if exit_code == 0:
        return False, "the job step exited 0"
    written_by = (str(state.get("job_id", "")), int(state.get("restart_count", -1))) if state else None
    current = written_by == (job.job_id, job.restart_count)
    if not current:
        if exit_code == USAGE_ERROR_EXIT:
            return False, "exit code 2: a config or usage error (see the log)"
        return True, "the step died before its run wrote run_state.json (start-up or checkpoint load)"
    assert state is not None
    status, reason = state.get("status"), str(state.get("reason", ""))
    if status in ("stopped", "finished"):
        return False, f"the run {status} ({reason}); the stop path decided about requeueing"
    if status == "failed" and reason in NEVER_REQUEUED_REASONS:
        again = "the same data" if reason == "nan" else "the same checkpoint files"
        return False, f"the run failed ({reason}): not retried, {again} would fail again"
    if status == "failed" and str(state.get("message", "")).startswith("UserError("):
        # A condition the user must fix (a full disk during a save, a bad resume): torchrun exits 1 for any,
        # so the step's exit code does not say so; the same job would fail the same way again.
        return False, f"the run failed with an error the user must fix: {state['message']}"
    if status == "failed" and reason in CRASH_REASONS:
        return True, f"the run failed ({reason}): {state.get('message', '')}".strip()
    if status == "running":
        return True, f"a rank died at step >= {state.get('step')} without a record (killed, OOM, segfault?)"
    return False, f"run_state.json has status {status!r}: not a crash"


class CrashLog:
    """``<run_dir>/crashes.jsonl``: every crash of the run, one JSON object a line."""

    def __init__(self, run_dir: Path | str):
        self.path = Path(run_dir) / CRASH_LOG_FILE

    def entries(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict):
                out.append(entry)
        return out

    def count(self, job_id: str) -> int:
        return sum(1 for e in self.entries() if str(e.get("job_id")) == job_id)

    def append(self, entry: Mapping[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(dict(entry), sort_keys=True) + "\n")


def after_step(
    run_dir: Path | str,
    exit_code: int,
    max_crash_requeues: int,
    requeue_enabled: bool,
    job_log_tail: str = "",
    env: Mapping[str, str] | None = None,
) -> bool:
    """Record a crash and requeue the job while the cap allows. Returns whether it requeued."""
    job = JobFacts.from_env(env)
    # The output file holds every run of the job (--open-mode=append): read only this run's part.
    start = job_log_tail.rfind(f"restart count {job.restart_count},")
    job_log_tail = job_log_tail[start:] if start >= 0 else job_log_tail
    if is_busy_refusal(job_log_tail):
        # The run directory belongs to another job or process: its files are not this job's to touch.
        log.info(
            "step exit code %d: the run directory was in use by another run; nothing to recover", exit_code
        )
        return False
    state_file = RunStateFile(run_dir)
    state = state_file.read()
    crash, why = classify(state, job, exit_code)
    if not crash:
        log.info("step exit code %d is not a crash to recover from: %s", exit_code, why)
        return False
    crashes = CrashLog(run_dir)
    earlier = crashes.count(job.job_id)
    errors = srun_task_errors(job_log_tail)
    step = int(state.get("step", 0)) if state else 0
    cause = {
        "exit_code": exit_code,
        "signal": signal_of(exit_code) or ",".join(torchrun_signals(job_log_tail)),
        "why": why,
        "failed_tasks": errors,
        "nodes": sorted({e["node"] for e in errors}),
        "previous_state": {k: state.get(k) for k in ("status", "reason", "step", "host")} if state else None,
    }
    allowed = requeue_enabled and job.in_slurm and earlier < max_crash_requeues
    crashes.append({**job.identity(), "time": round(time.time(), 3), "step": step, **cause})
    count = earlier + 1
    if allowed:
        status, reason = "failed", "crash"
        message = f"crash {count} of this job ({why}); requeuing from the last complete checkpoint"
    else:
        status, reason = "failed", "crash_loop" if requeue_enabled and job.in_slurm else "crash"
        message = (
            f"crash {count} of job {job.job_id}: resilience.max_crash_requeues={max_crash_requeues} reached; "
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
        "max_crash_requeues": max_crash_requeues,
    }
    state_file.write(status, reason, step, requeue_requested=allowed, requeue_pending=allowed, **facts)
    print(f"relaytrain: {message}", flush=True)
    if not allowed:
        return False
    done, how = scontrol_requeue(job.requeue_id)
    if done:
        state_file.write(status, reason, step, requeue_requested=True, requeued=True, **facts)
        print(f"relaytrain: requeued ({how})", flush=True)
        return True
    print(f"relaytrain: could not requeue after the crash: {how}", file=sys.stderr, flush=True)
    return False


def _tail(path: str, size: int = 65536) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relaytrain.resilience.crash", description=__doc__)
    parser.add_argument("--config", required=True, help="the run's resolved config (TOML)")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--exit-code", type=int, required=True, help="the job step's exit code")
    parser.add_argument("--job-log", default="", help="the job's output file (srun names the dead tasks)")
    args = parser.parse_args(argv)
    # Its own `scontrol requeue` ends this batch job, and Slurm's SIGTERM reaches this process too (a
    # child of the batch shell), at any moment after that call: the record must still be written and
    # the exit be 0, or the script logs the check as failed.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="relaytrain: %(message)s")
    from relaytrain.config import load_config

    r = load_config(args.config).resilience
    after_step(args.run_dir, args.exit_code, r.max_crash_requeues, r.requeue, _tail(args.job_log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
