"""Each run of a Slurm job as accounting knows it: Start..End, one per requeue, for the time ledger.

``sacct -D -X`` (every run of a requeued job, the allocation alone, with its Submit) where accounting
storage runs, else ``sacct -c`` (the job completion file, one line per run). ``sacct -c`` prints the
Start as Submit; where the job completion file is a text file this host can read (``JobCompType``
``jobcomp/filetxt``, its ``JobCompLoc`` from ``scontrol show config``), each run's Submit is read from
its line's ``SubmitTime`` (a requeued run's: when Slurm requeued it). Where no source gives a run's Submit,
`SlurmRuns.why` says why in one line (accounting not answering, no job completion file named, one of
another kind, missing, not a file, unreadable on this host, not text, or without that run's line); that
reading never raises. A run not finished yet ends now.
Runs are numbered by their start, which is Slurm's restart count for a job that was requeued in place.
Each run keeps its State: how it ended (COMPLETED, NODE_FAIL, PREEMPTED, CANCELLED, ...; in the job
completion file a run that gave way to a resize or requeue may say PENDING, the state the job went on in).

A job that shrank (a node lost, the run going on with the nodes left) gets a `RESIZING` record that ends
at the resize: the run goes on in the next record, so the two are one run. Slurm's job completion file
then gives every later record of the job the resize's time as its start, so its runs overlap; such a
job's runs are marked untrusted (`trusted`), and the time ledger bounds its allocations by the run's own
records instead. So is a job whose `RESIZING` record starts and ends at the resize (the job completion
file's, for a job that gave back its spare nodes): its run's Start is the resize's, not the run's.
"""

from __future__ import annotations

import re
import stat
import time
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from relaytrain.job.slurm_command import run_slurm_command
from relaytrain.job.slurmctld import SLURM_QUERY_TIMEOUT_S, parse_slurm_time

FIELDS = "JobID,Start,End,State"
BINARY_PROBE_BYTES = 65536  # the head of the job completion file that must hold no NUL byte (text)
# From accounting storage, Submit too (a requeued run's is when Slurm requeued it: the queue before it,
# for verify), then without it. The job completion file's Submit is read from the file itself
# (`completion_submits`: sacct -c prints the Start).
QUERIES = (
    ["sacct", "-D", "-X", "-n", "-P", "-o", FIELDS + ",Submit"],
    ["sacct", "-D", "-X", "-n", "-P", "-o", FIELDS],
    ["sacct", "-c", "-n", "-P", "-o", FIELDS],
)


class JobRun(NamedTuple):
    job_id: str
    restart: int  # its place among the job's runs, by start
    start: float
    end: float
    running: bool  # not ended yet: `end` is when it was asked
    trusted: bool = True  # False: a resize in the job completion file (its records' starts are the resize's)
    submit: float | None = None  # Slurm's Submit of this run (a requeue's: when it was requeued)
    state: str = ""  # sacct's State of the run (its last record's, for a resized run): how it ended


class SlurmRuns(NamedTuple):
    runs: list[JobRun] | None  # None: Slurm's accounting could not be asked or did not answer
    why: str = ""  # why accounting did not answer, or why a run has no Submit ("" when nothing is missing)


def parse_runs(job_id: str, text: str, now: float) -> list[JobRun]:
    """The runs of `job_id` in sacct's `JobID|Start|End|State[|Submit]` lines (steps and other jobs left
    out)."""
    found: list[tuple[float, float, bool, bool]] = []
    submits: dict[float, float] = {}  # a run's Submit by its start
    states: dict[tuple[float, float], str] = {}  # a run's State by its start and end
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < 3 or parts[0].strip() != job_id:
            continue
        start = parse_slurm_time(parts[1])
        if start is None:  # never started (pending, or cancelled in the queue)
            continue
        end = parse_slurm_time(parts[2])
        resizing = len(parts) > 3 and parts[3].strip().upper().startswith("RESIZING")
        found.append((start, end if end is not None else now, end is None, resizing))
        if len(parts) > 3 and not resizing:
            states.setdefault((start, found[-1][1]), parts[3].strip().split()[0] if parts[3].strip() else "")
        submit = parse_slurm_time(parts[4]) if len(parts) > 4 and not resizing else None
        if submit is not None:
            submits.setdefault(start, submit)
    runs: list[tuple[float, float, bool, float]] = []  # start, end, running, its own record's start
    carried: float | None = None  # the start of a run whose RESIZING record came before this one
    for start, end, running, resizing in sorted(set(found), key=lambda f: (f[0], f[1], f[3])):
        if resizing:
            carried = start if carried is None else carried
            continue
        runs.append((min(start, carried) if carried is not None else start, end, running, start))
        carried = None
    if carried is not None:  # the resize is the newest record: the run goes on
        runs.append((carried, now, True, carried))
    # the job completion file's RESIZING record starts and ends at the resize: the run's own start is lost
    blind = any(resizing and start == end for start, end, _, resizing in found)
    apart = all(later[0] >= earlier[1] for earlier, later in zip(runs, runs[1:], strict=False))
    trusted = apart and not blind
    return [
        JobRun(job_id, index, start, end, running, trusted, submits.get(start), states.get((own, end), ""))
        for index, (start, end, running, own) in enumerate(runs)
    ]


def slurm_runs(job_ids: Iterable[str], timeout: float = SLURM_QUERY_TIMEOUT_S) -> SlurmRuns:
    """Every run of the jobs (None when Slurm's accounting cannot be asked: no sacct, disabled, down), and
    why a Submit is missing."""
    ids = [str(job) for job in job_ids if str(job)]
    if not ids:
        return SlurmRuns([])
    now = time.time()
    failed = []
    for query in QUERIES:
        done = run_slurm_command([*query, "-j", ",".join(ids)], timeout)
        if not done.ran:
            return SlurmRuns(None, f"Slurm's accounting did not answer ({done.why().splitlines()[0]})")
        if done.ok and done.stdout.strip():
            runs = [run for job in ids for run in parse_runs(job, done.stdout, now)]
            if "-c" not in query:
                why = "" if all(r.submit is not None for r in runs) else "sacct gave no Submit"
                return SlurmRuns(runs, why)
            path, why = completion_file(timeout)
            submits, why = completion_submits(path, set(ids)) if path is not None else ({}, why)
            runs = [r._replace(submit=submits.get((r.job_id, r.start), r.submit)) for r in runs]
            if not why and any(r.submit is None for r in runs):
                why = f"Slurm's job completion file {path} has no line with that run's StartTime"
            return SlurmRuns(runs, why if any(r.submit is None for r in runs) else "")
        said = (done.stderr.strip() or done.stdout.strip() or "no line for the job(s)").splitlines()[0]
        failed.append(f"{' '.join(query[:2])}: {said}")
    why = completion_file(timeout)[1]
    told = f"Slurm's accounting gave no run of job(s) {', '.join(ids)} ({failed[-1]})"
    return SlurmRuns(None, told + f"; {why}" * bool(why))


def completion_file(timeout: float = SLURM_QUERY_TIMEOUT_S) -> tuple[Path | None, str]:
    """Slurm's job completion file where it is a text file (``jobcomp/filetxt``) this host can read, or
    None and why not (one line)."""
    done = run_slurm_command(["scontrol", "show", "config"], timeout)
    if not done.ok:
        return None, f"Slurm's job completion file was not found: {done.why()}"
    conf = dict(re.findall(r"^(JobComp(?:Type|Loc))\s*=\s*(\S+)", done.stdout, re.MULTILINE))
    kind, loc = conf.get("JobCompType", "jobcomp/none"), conf.get("JobCompLoc", "")
    if kind != "jobcomp/filetxt":
        return None, f"Slurm's job completion is {kind} (scontrol show config), not a text file"
    if not loc or loc == "(null)":
        return None, "scontrol show config names no job completion file (JobCompLoc)"
    path = Path(loc)
    try:
        mode = path.stat().st_mode
        if not stat.S_ISREG(mode):
            return None, f"Slurm's job completion file {path} is not a file on this host"
        with path.open("rb") as f:
            head = f.read(BINARY_PROBE_BYTES)
    except OSError as exc:
        return None, f"Slurm's job completion file {path} cannot be read on this host: {exc.strerror}"
    if b"\0" in head:
        return None, f"Slurm's job completion file {path} is not a text file (it holds NUL bytes)"
    return path, ""


def completion_submits(path: Path, job_ids: set[str]) -> tuple[dict[tuple[str, float], float], str]:
    """(job id, StartTime) -> SubmitTime of each line of the job completion file at `path` for `job_ids`
    (Slurm writes one line as each run ends; a requeued run's SubmitTime is its requeue's), and why it
    could not be read ("" when it was)."""
    found: dict[tuple[str, float], float] = {}
    try:
        with path.open("rb") as f:
            for raw in f:
                line = raw.decode(errors="replace")
                fields = dict(re.findall(r"(?:^|\s)(JobId|StartTime|SubmitTime)=(\S+)", line))
                if fields.get("JobId") not in job_ids:
                    continue
                start = parse_slurm_time(fields.get("StartTime", ""))
                submit = parse_slurm_time(fields.get("SubmitTime", ""))
                if start is not None and submit is not None:
                    found.setdefault((fields["JobId"], start), submit)
    except OSError as exc:
        return found, f"Slurm's job completion file {path} cannot be read on this host: {exc.strerror}"
    return found, ""
