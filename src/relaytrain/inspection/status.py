"""CLI: `relaytrain status` and `relaytrain logs`, for a job id or a run (a name under --runs, or a path).

A run's own files answer with or without Slurm (relaytrain.inspection.run_view); its jobs are added where
Slurm can be asked.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rich.table import Table
from rich.text import Text

from relaytrain.errors import UserError
from relaytrain.job import RunDir
from relaytrain.slurm.commands import _console


def _job_table(jobs) -> Table:
    table = Table(show_header=True)
    columns = ("job", "name", "state", "restarts", "elapsed", "limit", "nodes", "reason/exit", "last step")
    for column in (*columns, "run dir"):
        table.add_column(column, overflow="fold")
    for job in jobs:
        table.add_row(
            job.job_id,
            job.name,
            job.state,
            str(job.restarts),
            job.elapsed,
            job.time_limit,
            f"{job.nodes} (nodes per run: {job.nodes_per_run})" if job.nodes_per_run else job.nodes,
            job.reason or job.exit_code,
            "" if job.last_step is None else str(job.last_step),
            job.run_dir,
        )
    return table


def cmd_status(args: argparse.Namespace) -> int:
    from relaytrain.slurm import jobs

    console = _console()
    runs = Path(args.runs)
    if not args.target and getattr(args, "json", False):
        raise UserError("--json describes a run: name one (relaytrain status RUN --json)")
    if not args.target:
        found = jobs.list_queue(user_only=not args.all)  # a UserError when Slurm cannot be asked
        for job in found:
            found_run = jobs.find_run_dir(job, runs)
            if found_run is not None:
                job.run_dir, job.last_step = str(found_run.root), jobs.last_step(found_run)
        console.print(_job_table(found) if found else "no pending or running jobs")
        return 0
    from relaytrain.inspection.run_view import find_run, run_json, run_rows
    from relaytrain.resilience.run_state import RunStateFile
    from relaytrain.slurm.client import SlurmUnavailable

    run = find_run(args.target, runs)
    if run is not None and getattr(args, "json", False):
        print(json.dumps(run_json(run), indent=1))
        return 1 if RunStateFile(run).damage() else 0
    if run is None and getattr(args, "json", False):
        raise UserError(f"--json describes a run: no run {args.target!r} under {args.runs}/ or at that path")
    if run is None:
        try:
            found = jobs.describe(args.target, runs)
        except SlurmUnavailable as exc:
            raise UserError(f"no run {args.target!r} under {args.runs}/ or at that path, and {exc}") from None
        if not found:
            raise UserError(
                f"no job or run {args.target!r} found (squeue, scontrol, sacct and "
                f"{RunDir(Path(args.runs) / '*').jobs} know nothing of it)"
            )
        console.print(_job_table(found))
        return 0
    facts = Table(title=f"run {run.root.name}", show_header=False)
    facts.add_column("what")
    facts.add_column("value", overflow="fold")
    for name, value in run_rows(run):
        facts.add_row(name, Text(value))  # literal: a recorded error may hold [brackets] rich reads as markup
    console.print(facts)
    if run.slurm.is_dir():
        from relaytrain.slurm.submit import read_jobs, submission_line

        if not read_jobs(run.jobs):  # written by a dry run (or a launch refused before sbatch)
            again = f"; submit with: {submission_line(run.job_script)}" if run.job_script.is_file() else ""
            console.print(f"its Slurm jobs: none submitted (no job recorded in {run.jobs}){again}")
        else:
            try:
                console.print(_job_table(jobs.describe_run(run)))
            except SlurmUnavailable as exc:  # the run's own files above still answer
                console.print(f"its Slurm jobs: unknown ({exc})")
    if damaged := RunStateFile(run).damage():
        print(f"relaytrain: error: {damaged}", file=sys.stderr)
        return 1
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from relaytrain.inspection.run_view import JOB_ID, find_run
    from relaytrain.resilience.run_lock import RunLock
    from relaytrain.slurm import jobs

    run = find_run(args.target, Path(args.runs))
    if run is not None:
        path, job_id = _run_log(run, args.follow)  # a UserError when the run has no log yet
        print(f"==> {path} <==", file=sys.stderr, flush=True)
        if job_id:
            return _print_log(path, args.follow, lambda: jobs.is_active(job_id))
        return _print_log(path, args.follow, lambda: RunLock(run).current_holder()[1])
    if not JOB_ID.fullmatch(args.target):
        raise UserError(f"no run {args.target!r} under {args.runs}/ or at that path, and not a job id")
    records = jobs.query_job(args.target) or [jobs.Job(job_id=args.target)]
    path = jobs.log_path(records[0], Path(args.runs))
    if path is None:
        raise UserError(f"no output file found for job {args.target}; is it still pending?")
    return _print_log(path, args.follow, lambda: jobs.is_active(args.target))


def _run_log(run: RunDir, follow: bool) -> tuple[Path, str]:
    """The run's log (run_view.run_log). With `follow`, while the run's newest job is queued and has
    written nothing yet (`logs -f` right after `launch`), wait for its output to appear."""
    from relaytrain.inspection.run_view import run_log
    from relaytrain.slurm import jobs
    from relaytrain.slurm.submit import read_jobs

    said = False
    while True:
        try:
            return run_log(run)
        except UserError:
            newest = str((read_jobs(run.jobs) or [{}])[-1].get("job_id", ""))
            if not follow or not newest or not jobs.is_active(newest):
                raise
        if not said:
            print(f"waiting for job {newest} to start", file=sys.stderr, flush=True)
            said = True
        time.sleep(1.0)


def _print_log(path: Path, follow: bool, running: Callable[[], bool]) -> int:
    """Print the file; with `follow`, keep printing what is appended while `running()` says so."""
    with open(path, errors="replace") as f:
        sys.stdout.write(f.read())
        sys.stdout.flush()
        if not follow:
            return 0
        idle_checks = 0
        while True:
            chunk = f.read()
            if chunk:
                sys.stdout.write(chunk)
                sys.stdout.flush()
                continue
            idle_checks += 1
            if (idle_checks == 1 or idle_checks % 5 == 0) and not running():
                sys.stdout.write(f.read())
                return 0
            time.sleep(1.0)


def register(subparsers) -> None:
    p = subparsers.add_parser("status", help="your queued jobs, a job, or a run's state and its jobs")
    p.add_argument("target", nargs="?", help="job id or run name/directory (default: your queued jobs)")
    p.add_argument("--all", action="store_true", help="every user's jobs")
    p.add_argument("--runs", default="runs", help="where run directories live (default: runs)")
    p.add_argument("--json", action="store_true", help="a run's state and its time ledger as one JSON record")
    p.set_defaults(func=cmd_status)

    p = subparsers.add_parser("logs", help="print a job's or a run's output")
    p.add_argument("target", metavar="JOBID|RUN", help="a job id, or a run name or directory")
    p.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing until the job ends (waits for a queued job)",
    )
    p.add_argument("--runs", default="runs", help="where run directories live (default: runs)")
    p.set_defaults(func=cmd_logs)
