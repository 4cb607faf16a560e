"""A requeue's Submit from Slurm's job completion file, and what `relaytrain verify` says where that file
cannot be read: missing, not a file, not text, unreadable by the verifying user, of another kind, or not
named by `scontrol show config`.

The files are real; Slurm's two clients are shell scripts on PATH that answer as they do on the local
cluster (accounting storage disabled: `sacct -D` says so and exits 1; `sacct -c` reads JobCompLoc itself:
nothing for a missing file, `sacct: fatal: open FILE: Permission denied` and exit 1 for an unreadable
one). A file the verifying user cannot read is read by a child process running as `nobody` where the
tests run as root (root reads any file).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from relaytrain.cli import main
from relaytrain.job.allocations import completion_submits, parse_runs, slurm_runs

DAY = "2026-12-07T03:"
LINE = ("JobId={job} UserId=root(0) GroupId=root(0) Name=a b JobState={state} Partition=debug "
        "TimeLimit=10 StartTime={day}{start} EndTime={day}{end} NodeList=nsnode1 "
        "SubmitTime={day}{submit} EligibleTime={day}{submit} ExitCode=0:0 \n")  # fmt: skip
JOB_5 = LINE.format(job=5, state="PENDING", day=DAY, start="41:15", end="42:16", submit="41:13")
JOB_5 += LINE.format(job=5, state="COMPLETED", day=DAY, start="42:40", end="43:10", submit="42:28")
SACCT_C = f"5|{DAY}41:15|{DAY}42:16|PENDING\n5|{DAY}42:40|{DAY}43:10|COMPLETED\n"  # what sacct -c prints
NOBODY = 65534


@pytest.fixture
def shared() -> Path:
    """A folder every user may enter (pytest's own are its owner's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="relaytrain-jobcomp-", dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def stub_slurm(folder: Path, monkeypatch, loc: Path | None, kind: str = "jobcomp/filetxt", prints: str = ""):
    """scontrol and sacct on PATH; `sacct -c` prints `prints` where it can read `loc`."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(exist_ok=True)
    conf = f"JobCompType             = {kind}\n" + (f"JobCompLoc              = {loc}\n" if loc else "")
    scripts = {
        "scontrol": f"#!/bin/sh\nprintf '%s' '{conf}'\n",
        "sacct": f"""#!/bin/sh
case " $* " in
  *" -c "*)
    err=$(cat '{loc}' 2>&1 >/dev/null)
    case "$err" in
      *"Permission denied"*) echo "sacct: fatal: open {loc}: Permission denied" >&2; exit 1;;
    esac
    [ -z "$err" ] && printf '%s' '{prints}'
    exit 0;;
  *) echo "Slurm accounting storage is disabled"; exit 1;;
esac
""",
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def as_nobody(fn: Callable[[], Any]) -> Any:
    """`fn()` in a child process running as `nobody` when this one is root; what it raised fails."""
    if os.geteuid() != 0:
        return fn()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no return from here
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            data = pickle.dumps(("returned", fn()))
        except BaseException as exc:  # noqa: BLE001 - carried to the parent, which fails on it
            data = pickle.dumps(("raised", repr(exc)))
        with os.fdopen(write, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    how, value = pickle.loads(data)
    assert how == "returned", value
    return value


def test_the_job_completion_files_submit_is_read_from_the_file(shared, monkeypatch):
    """`sacct -c` prints a run's Start as its Submit: each run's SubmitTime comes from the file's line
    (Slurm's filetxt lines, as the local cluster writes them), matched by job and StartTime."""
    jobcomp = shared / "jobcomp.txt"
    other = LINE.format(job=6, state="COMPLETED", day=DAY, start="41:20", end="42:00", submit="41:19")
    jobcomp.write_text(JOB_5 + other)
    submits, why = completion_submits(jobcomp, {"5"})
    runs = [r._replace(submit=submits.get((r.job_id, r.start))) for r in parse_runs("5", SACCT_C, 0.0)]
    assert why == ""
    assert [(r.start - r.submit, r.state) for r in runs] == [(2.0, "PENDING"), (12.0, "COMPLETED")]
    # through the clients: scontrol show config names it, sacct -c gives the runs
    stub_slurm(shared, monkeypatch, jobcomp, prints=SACCT_C)
    asked = slurm_runs(["5"])
    assert asked.why == "" and [r.start - r.submit for r in asked.runs] == [2.0, 12.0]
    # a line the file lacks: the run has no Submit, and the reason says so
    jobcomp.write_text(other)
    asked = slurm_runs(["5"])
    assert [r.submit for r in asked.runs] == [None, None]
    assert asked.why == f"Slurm's job completion file {jobcomp} has no line with that run's StartTime"


CASES = {  # what is at JobCompLoc -> the reason verify gives
    "missing": (lambda p: None, "cannot be read on this host: No such file or directory"),
    "a folder": (lambda p: p.mkdir(), "is not a file on this host"),
    "not text": (lambda p: p.write_bytes(b"JobId=5 \0\x7fELF\0"), "is not a text file (it holds NUL bytes)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_job_completion_file_that_cannot_be_read_is_named_with_why(shared, monkeypatch, case):
    make, why = CASES[case]
    jobcomp = shared / "jobcomp.txt"
    make(jobcomp)
    stub_slurm(shared, monkeypatch, jobcomp)
    asked = slurm_runs(["5"])
    assert asked.runs is None
    assert asked.why == (
        "Slurm's accounting gave no run of job(s) 5 (sacct -c: no line for the job(s)); "
        f"Slurm's job completion file {jobcomp} {why}"
    )


@pytest.mark.parametrize("where", ["the file", "its folder"])
def test_a_job_completion_file_the_verifying_user_cannot_read(shared, monkeypatch, where):
    """Slurm's file readable by its owner alone (0600), or in a folder only its owner may enter (0700):
    `sacct -c` fails on it, and the reason is Permission denied, not a traceback (a folder the user
    cannot enter made Path.is_file raise)."""
    folder = shared / "spool"
    folder.mkdir(mode=0o700 if where == "its folder" else 0o755)
    jobcomp = folder / "jobcomp.txt"
    jobcomp.write_text(JOB_5)
    jobcomp.chmod(0o600 if where == "the file" else 0o644)
    stub_slurm(shared, monkeypatch, jobcomp, prints=SACCT_C)
    asked = as_nobody(lambda: slurm_runs(["5"]))
    assert asked.runs is None
    assert asked.why == (
        f"Slurm's accounting gave no run of job(s) 5 (sacct -c: sacct: fatal: open {jobcomp}: Permission "
        f"denied); Slurm's job completion file {jobcomp} cannot be read on this host: Permission denied"
    )


@pytest.mark.parametrize(
    ("kind", "loc", "why"),
    [
        (
            "jobcomp/elasticsearch",
            "http://es:9200",
            "Slurm's job completion is jobcomp/elasticsearch (scontrol show config), not a text file",
        ),  # fmt: skip
        ("jobcomp/filetxt", None, "scontrol show config names no job completion file (JobCompLoc)"),
    ],
)
def test_a_job_completion_of_another_kind_or_none_named(shared, monkeypatch, kind, loc, why):
    stub_slurm(shared, monkeypatch, loc, kind=kind)
    assert slurm_runs(["5"]).why.endswith(f"; {why}")


def job_run_copy(run: Path, folder: Path) -> Path:
    """The stopped-and-resumed run as one Slurm job (7) requeued once: its stop ended run 0, the resume is
    run 1."""
    copy = Path(shutil.copytree(run, folder / "run", symlinks=True))
    rows = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    restart = 0
    for row in rows:
        restart = 1 if row.get("event") == "resume" else restart
        row.update(job_id="7", restart=restart)
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return copy


def test_verify_says_the_requeue_was_not_checked_and_why(stopped_and_resumed_run, shared, monkeypatch):
    """`relaytrain verify` on a requeued job whose completion file is missing: exit 0 (its exit status is
    that of the checks it made), the ledger's summary says the requeue was not checked against Slurm's
    Submit and why, nothing on stderr."""
    run = job_run_copy(stopped_and_resumed_run, shared)
    jobcomp = shared / "jobcomp.txt"
    stub_slurm(shared, monkeypatch, jobcomp)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["verify", str(run)])
    lines = out.getvalue().splitlines()
    assert (code, err.getvalue()) == (0, ""), lines
    (ledger,) = [line for line in lines if line.startswith("ledger: ")]
    assert ledger.endswith(
        "; queue: 0 requeue(s) checked against Slurm's Submit to Start, 1 NOT checked: Slurm's accounting "
        "gave no run of job(s) 7 (sacct -c: no line for the job(s)); Slurm's job completion file "
        f"{jobcomp} cannot be read on this host: No such file or directory"
    )
    assert lines[-1] == f"verify {run}: OK"
