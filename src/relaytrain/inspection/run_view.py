"""`relaytrain status RUN` without Slurm: what a run directory says of its run.

A run's own files answer for it (run_state.json, metrics.jsonl, checkpoints/latest), wherever it ran: on
a laptop, under torchrun or in a Slurm job. The jobs of a launched run are added by `jobs.describe`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from relaytrain.checkpoint.files import read_latest
from relaytrain.errors import UserError
from relaytrain.job import RunDir, jsonl
from relaytrain.monitor.ledger import Ledger
from relaytrain.monitor.run_ledger import run_ledger
from relaytrain.resilience.batch.bad_nodes import excluded_in_run
from relaytrain.resilience.batch.crash import RESTARTED, CrashLog, describe_crash
from relaytrain.resilience.batch.notify_counts import describe as describe_alerts
from relaytrain.resilience.batch.notify_counts import run_counts
from relaytrain.resilience.rank.straggler import describe_stragglers
from relaytrain.resilience.run_state import RUN_STATE_FILE, RunStateFile
from relaytrain.slurm.jobs import entry_log, last_step
from relaytrain.slurm.submit import read_jobs

# run_state.json keys shown in their own rows, or not worth a row.
_SHOWN = {"status", "reason", "step", "time", "unix_time", "host", "job_id", "restart_count", "message"}
JOB_ID = re.compile(r"\d+(_\d+)?")
_NOTE_KEY = re.compile(r"reason|error|message|problem|damage", re.IGNORECASE)


def find_run(target: str, runs_root: Path) -> RunDir | None:
    """A run name under `runs_root`, or the path of a run directory; None when it is neither.

    The one reading of a RUN argument: status, logs, verify and report all resolve theirs here."""
    candidates = [runs_root / target]
    if not JOB_ID.fullmatch(target):  # a bare number is a job id unless runs_root holds a run of that name
        candidates.append(Path(target))
    return next((RunDir(path) for path in candidates if RunDir(path).holds_run()), None)


def required_run(target: str, runs_root: Path) -> RunDir:
    """`find_run`, or one line saying that `target` names no run (verify and report need one)."""
    run = find_run(target, runs_root)
    if run is None:
        raise UserError(f"no run {target!r} under {runs_root}/ or at that path")
    return run


def preflight_rows(run: RunDir) -> list[tuple[str, str]]:
    """The newest `relaytrain preflight` results: its summary and each node below threshold."""
    import json

    files = (
        sorted(run.preflights.glob("*.json"), key=lambda p: p.stat().st_mtime)
        if run.preflights.is_dir()
        else []
    )
    if not files:
        return []
    try:
        record = json.loads(files[-1].read_text())
    except (OSError, ValueError):
        return [("preflight", f"{run.relative(files[-1])} unreadable")]
    rows = [
        (
            "preflight",
            f"job {record.get('job', '?')}: {record.get('summary', '?')} ({run.relative(files[-1])})",
        )
    ]
    return rows + [("preflight node", line.removeprefix("preflight: ")) for line in record.get("lines", [])]


def run_log(run: RunDir) -> tuple[Path, str]:
    """The run's log and the Slurm job that writes it: the output of its newest recorded job, else
    rank 0's log (a run without Slurm; job ""). A UserError when it has neither yet."""
    for entry in reversed(read_jobs(run.jobs)):
        job_id = str(entry.get("job_id", ""))
        if entry.get("kind") == "sweep":  # the array's own directory: its first task's output
            job_id += "_0"
        path = entry_log(entry, job_id)
        if path is not None and path.is_file():
            return path, job_id
    if run.rank_log(0).is_file():
        return run.rank_log(0), ""
    raise UserError(
        f"run {run.root} has no log yet: no job output under {run.slurm} and no {run.rank_log(0)} (a "
        "program writes its own output)"
    )


def _text(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


def run_rows(run: RunDir) -> list[tuple[str, str]]:
    """(what, value) rows: state, step, time, the job that wrote it, the latest checkpoint and every
    reason, error or message run_state.json records (whoever wrote it: the loop, the crash check, a
    checkpoint check)."""
    rows = [("run dir", str(run.root))]
    record_file = RunStateFile(run)
    record, damaged = record_file.read(), record_file.damage()
    if damaged:
        rows.append(("state", f"damaged: {damaged}"))
    elif record is None:
        rows.append(("state", f"unknown: no {RUN_STATE_FILE} yet (the run has not started yet)"))
    else:
        state = record.as_json()
        status, reason = record.status.value, record.reason
        rows.append(("state", f"{status} ({reason})" if reason else status))
        rows.append(("at step", str(record.step)))
        rows.append(("recorded", f"{record.time or '?'} on {record.host or '?'}"))
        if state.get("job_id"):
            rows.append(("slurm job", f"{state['job_id']} (restart {state.get('restart_count', 0)})"))
        if record.message:
            rows.append(("message", record.message))
        for key in sorted(state):
            if key not in _SHOWN and _NOTE_KEY.search(key) and state[key] not in ("", None, [], {}):
                rows.append((key, _text(state[key])))
    crashes = CrashLog(run).entries()
    if crashes:
        in_place = sum(1 for e in crashes if e.get("action") == RESTARTED)
        requeued = sum(1 for e in crashes if e.get("action", "requeue") == "requeue")
        rows.append(("crashes", f"{len(crashes)}: {in_place} in place, {requeued} requeued (crashes.jsonl)"))
        rows.append(("last crash", describe_crash(crashes[-1])))
        for job, node, why in excluded_in_run(crashes):
            rows.append(("excluded node", f"{node} from job {job}: {why}"))
    rows += preflight_rows(run)
    records = jsonl.read(run.metrics).records if run.metrics.is_file() else []
    rows += [("straggler", line) for line in describe_stragglers(records)]
    alerts = run_counts(records)
    if alerts is not None:
        rows.append(("alerts", describe_alerts(alerts)))
    step = last_step(run)
    rows.append(("last logged step", "none yet" if step is None else str(step)))
    latest = read_latest(run.checkpoints)
    if latest is not None:
        rows.append(("latest checkpoint", str(latest)))
    ledger = ledger_of(run)
    if ledger is not None:
        head, *rest = ledger.summary()
        rows.append(("goodput", head))
        rows += [("", line) for line in rest]
    return rows


def ledger_of(run: RunDir) -> Ledger | None:
    """The run's time ledger (Slurm's allocation times where accounting answers), None before its first
    metrics record or when metrics.jsonl cannot be read (its own row says so)."""
    if not run.metrics.is_file():
        return None
    try:
        return run_ledger(run)
    except (UserError, OSError):
        return None


def run_json(run: RunDir) -> dict[str, Any]:
    """`relaytrain status RUN --json`: the run's record, last step, latest checkpoint, time ledger and the
    alerts' counts ([notify]; None when no job sent any)."""
    record = RunStateFile(run).read()
    latest = read_latest(run.checkpoints)
    ledger = ledger_of(run)
    return {
        "run_dir": str(run.root),
        "state": None if record is None else record.as_json(),
        "last_step": last_step(run),
        "latest_checkpoint": None if latest is None else str(latest),
        "ledger": None if ledger is None else ledger.as_json(),
        "alerts": run_counts(jsonl.read(run.metrics).records) if run.metrics.is_file() else None,
    }
