"""Job facts for `relaytrain status/logs/cancel`: squeue, scontrol show job, sacct and the run files.

`scontrol show job` is asked first (immediate, kept for MinJobAge after the end), then `sacct`, then
`sacct -c` (the job completion file) where accounting storage is disabled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from relaytrain.errors import UserError
from relaytrain.job import RunDir, jsonl
from relaytrain.job.slurmctld import queue_states
from relaytrain.slurm.client import run_slurm, slurm_error
from relaytrain.slurm.submit import read_jobs

_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9:_/]*)=")
ACTIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}
SACCT_FIELDS = "JobID,JobName,State,ExitCode,Elapsed,NNodes,Start,End,NodeList"


@dataclass
class Job:
    job_id: str
    name: str = ""
    state: str = ""
    restarts: int = 0
    elapsed: str = ""
    time_limit: str = ""
    nodes: str = ""
    reason: str = ""
    exit_code: str = ""
    stdout: str = ""
    workdir: str = ""
    source: str = ""  # which tool answered
    run_dir: str = ""
    last_step: int | None = None
    nodes_per_run: str = ""  # node count of the first run and each requeue, e.g. "2, 1, 2" (elastic)
    extra: dict[str, str] = field(default_factory=dict)


def parse_scontrol_record(line: str) -> dict[str, str]:
    """One `scontrol show job -o` line -> {key: value}; values may contain spaces."""
    matches = list(_KEY.finditer(line))
    out = {}
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        out[match.group(1)] = line[match.end() : end].strip()
    return out


def _job_from_scontrol(rec: dict[str, str]) -> Job:
    job_id = rec.get("JobId", "")
    if rec.get("ArrayJobId") and rec.get("ArrayTaskId"):
        job_id = f"{rec['ArrayJobId']}_{rec['ArrayTaskId']}"
    return Job(
        job_id=job_id,
        name=rec.get("JobName", ""),
        state=rec.get("JobState", ""),
        restarts=int(rec.get("Restarts", "0") or 0),
        elapsed=rec.get("RunTime", ""),
        time_limit=rec.get("TimeLimit", ""),
        nodes=rec.get("NodeList", ""),
        reason=rec.get("Reason", ""),
        exit_code=rec.get("ExitCode", ""),
        stdout=rec.get("StdOut", ""),
        workdir=rec.get("WorkDir", ""),
        source="scontrol",
        extra=rec,
    )


def _jobs_from_sacct(text: str, source: str) -> list[Job]:
    jobs = []
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < 9 or not parts[0] or "." in parts[0]:
            continue  # steps (123.batch, 123.0) are not jobs
        jobs.append(
            Job(
                job_id=parts[0],
                name=parts[1],
                state=parts[2].split()[0] if parts[2] else "",
                exit_code=parts[3],
                elapsed=parts[4],
                nodes=parts[8] or parts[5],
                source=source,
            )
        )
    return jobs


def _answer(cmd: list[str]) -> str:
    """What a Slurm query printed, "" when it had no answer (an unknown job, accounting disabled)."""
    result = run_slurm(cmd)
    return result.stdout if result.returncode == 0 else ""


def query_job(job_id: str) -> list[Job]:
    """Records of a job (one per array task), from scontrol, else sacct, else sacct -c."""
    out = _answer(["scontrol", "show", "job", "-o", job_id])
    if out.strip():
        return [_job_from_scontrol(parse_scontrol_record(line)) for line in out.splitlines() if line.strip()]
    out = _answer(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", SACCT_FIELDS])
    if out.strip():
        jobs = _jobs_from_sacct(out, "sacct")
        if jobs:
            return _merge_requeued(jobs)
    out = _answer(["sacct", "-c", "-j", job_id, "-n", "-P", "-o", SACCT_FIELDS])
    if out.strip():
        return _merge_requeued(_jobs_from_sacct(out, "sacct -c"))
    return []


def _merge_requeued(jobs: list[Job]) -> list[Job]:
    """A requeued job appears once per run in sacct -c: keep the last, count the others as restarts."""
    merged: dict[str, Job] = {}
    for job in jobs:
        if job.job_id in merged:
            job.restarts = merged[job.job_id].restarts + 1
        merged[job.job_id] = job
    return list(merged.values())


def list_queue(user_only: bool = True) -> list[Job]:
    cmd = ["squeue", "-h", "-o", "%i|%j|%T|%M|%l|%D|%R"]
    if user_only:
        cmd.append("--me")
    result = run_slurm(cmd)
    if result.returncode != 0:
        raise UserError(f"{' '.join(cmd[:1])} failed: {slurm_error(result)}")
    jobs = []
    for line in result.stdout.splitlines():
        parts = line.split("|")
        if len(parts) == 7:
            jobs.append(
                Job(
                    job_id=parts[0],
                    name=parts[1],
                    state=parts[2],
                    elapsed=parts[3],
                    time_limit=parts[4],
                    nodes=parts[5],
                    reason=parts[6],
                    source="squeue",
                )
            )
    return jobs


def last_step(run: RunDir) -> int | None:
    """`step` of the last record of <run_dir>/metrics.jsonl that has one; for a --command program
    that writes no metrics, the step of its last stop in run_state.json (docs/programs.md)."""
    if not run.metrics.is_file():
        from relaytrain.resilience.run_state import recorded_step

        step = recorded_step(run)
        return step if step is not None and step >= 0 else None
    for record in reversed(jsonl.tail(run.metrics)):
        if record.get("kind") == "job":  # the batch job's own records carry no training step
            continue
        step = record.get("step")
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            return step  # -1: a stop whose step the batch script could not know (exit 75)
    return None


def nodes_per_run(run: RunDir, job_id: str) -> str:
    """The node count each run of a job (its first start, then every restart in place and every requeue)
    trained on, from the start and resume events in <run_dir>/metrics.jsonl: "2, 1, 2" for a job that
    lost a node and got it back."""
    counts: dict[tuple[int, int], object] = {}
    try:
        lines = run.metrics.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    starts = [line for line in lines if '"resume"' in line or '"start"' in line]  # parse only these
    for rec in jsonl.parse(starts).records:
        if (
            rec.get("event") in ("start", "resume")
            and str(rec.get("job_id")) == job_id
            and rec.get("nodes") is not None
        ):
            counts[int(rec.get("restart") or 0), int(rec.get("step_restart") or 0)] = rec["nodes"]
    return ", ".join(str(counts[k]) for k in sorted(counts))


def run_state_note(run: RunDir) -> str:
    """For a failed run, `<reason>: <message>` from its run_state.json (a crash loop says so), else ``""``."""
    from relaytrain.resilience.run_state import RunStateFile, RunStatus

    state = RunStateFile(run).read()
    if state is None or state.status is not RunStatus.FAILED:
        return ""
    return f"{state.reason or '?'}: {state.message or ''}".strip()


def find_entry(job_id: str, runs_root: Path = Path("runs")) -> dict | None:
    """The jobs.jsonl record `relaytrain launch/sweep` wrote for this job id (array task ids too)."""
    base = job_id.split("_")[0]
    fallback = None
    for jobs_file in sorted(runs_root.glob(str(RunDir(Path("*")).jobs))):
        for entry in read_jobs(jobs_file):
            if str(entry.get("job_id")) == job_id:
                return entry
            if str(entry.get("job_id")) == base:
                fallback = entry
    return fallback


def find_run_dir(job: Job, runs_root: Path = Path("runs")) -> RunDir | None:
    """From the job's StdOut (`<run_dir>/slurm/%j.out`), else a `jobs.jsonl` that names the job."""
    entry = find_entry(job.job_id, runs_root)
    if entry and entry.get("run_dir"):
        return RunDir(Path(entry["run_dir"]))
    if job.stdout:
        return RunDir.holding_job_log(Path(job.stdout))
    return None


def describe_run(run: RunDir) -> list[Job]:
    """The last jobs `relaytrain launch/sweep` recorded in the run's jobs.jsonl, as Slurm knows them."""
    jobs = []
    for entry in read_jobs(run.jobs)[-5:]:
        found = query_job(str(entry["job_id"])) or [Job(job_id=str(entry["job_id"]), state="UNKNOWN")]
        jobs.extend(found)
    for job in jobs:
        job.run_dir = str(run.root)
        job.last_step = last_step(run)
        job.nodes_per_run = nodes_per_run(run, job.job_id)
    if jobs:
        jobs[-1].reason = run_state_note(run) or jobs[-1].reason
    return jobs


def describe(job_or_run: str, runs_root: Path = Path("runs")) -> list[Job]:
    """Jobs for a job id, or for a run (name or directory) through its jobs.jsonl."""
    run = RunDir(Path(job_or_run) if "/" in job_or_run else runs_root / job_or_run)
    if not re.fullmatch(r"\d+(_\d+)?", job_or_run) and run.slurm.is_dir():
        return describe_run(run)
    jobs = query_job(job_or_run)
    for job in jobs:
        found = find_run_dir(job, runs_root)
        if found is not None:
            job.run_dir = str(found.root)
            job.last_step = last_step(found)
            job.nodes_per_run = nodes_per_run(found, job.job_id)
            job.reason = run_state_note(found) or job.reason
    return jobs


def log_path(job: Job, runs_root: Path = Path("runs")) -> Path | None:
    """The job's output file: StdOut from scontrol, else the `log` that jobs.jsonl recorded."""
    if job.stdout and Path(job.stdout).is_file():
        return Path(job.stdout)
    entry = find_entry(job.job_id, runs_root)
    path = entry_log(entry, job.job_id) if entry else None
    return path if path is not None and path.is_file() else None


def entry_log(entry: dict, job_id: str) -> Path | None:
    """The output file a jobs.jsonl entry's `log` pattern names for `job_id` (`123`, `123_4`)."""
    if not entry.get("log"):
        return None
    array_id, _, task = job_id.partition("_")
    return Path(str(entry["log"]).replace("%A", array_id).replace("%a", task).replace("%j", job_id))


def is_active(job_id: str) -> bool:
    return any(state in ACTIVE_STATES for state in queue_states(job_id) or [])


def cancel_command(job_id: str, signal: str | None = None) -> list[str]:
    """scancel: without --signal it ends the job; with one it reaches the job steps (training
    processes and torchrun) directly, the way Slurm's own pre-timeout signal reaches them.

    --verbose: without it scancel says nothing and exits 0 for a job id it does not know."""
    if signal:
        return ["scancel", "--verbose", f"--signal={signal.removeprefix('SIG')}", job_id]
    return ["scancel", "--verbose", job_id]
