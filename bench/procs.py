"""Running the measured programs as subprocesses and reading what they recorded.

Every measured program runs in its own process with the same environment (thread count pinned by
``OMP_NUM_THREADS``), so that neither side inherits the other's warmed-up allocator, thread pool or
imported modules.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from relaytrain.errors import UserError
from relaytrain.job import RunDir
from relaytrain.monitor.history import read_records

from bench.report import REPO

WORK = REPO / "bench" / "out"  # git-ignored scratch space for runs


class BenchError(RuntimeError):
    """A measured program failed; the message carries the tail of its output."""


@dataclass
class Finished:
    argv: list[str]
    returncode: int
    start_unix: float  # time.time() just before the process was spawned
    wall_s: float
    stdout: str
    stderr: str


def bench_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    for key in [k for k in env if k.startswith("SLURM_")]:
        env.pop(key)  # a benchmark run inside an allocation must not act as a Slurm job step
    src = str(REPO / "src")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run(
    argv: list[str], threads: int, *, cwd: Path | None = None, timeout: float = 900, ok_codes=(0,)
) -> Finished:
    start_unix = time.time()
    start = time.perf_counter()
    proc = subprocess.run(
        argv,
        cwd=cwd or REPO,
        env=bench_env(threads),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    done = Finished(argv, proc.returncode, start_unix, time.perf_counter() - start, proc.stdout, proc.stderr)
    if proc.returncode not in ok_codes:
        raise BenchError(
            f"`{shlex.join(argv)}` exited {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n"
            f"--- stderr\n{proc.stderr[-3000:]}"
        )
    return done


def relaytrain_argv(args: list[str]) -> list[str]:
    """``relaytrain ...`` through this interpreter (the console script may belong to another venv)."""
    return [sys.executable, "-m", "relaytrain.cli", *args]


def shown(argv: list[str]) -> str:
    """The command as a reader would type it: ``relaytrain`` and ``python``, not interpreter paths."""
    words = list(argv)
    if words[:3] == [sys.executable, "-m", "relaytrain.cli"]:
        words = ["relaytrain", *words[3:]]
    elif words and words[0] == sys.executable:
        words[0] = "python"
    return shlex.join(words).replace(str(REPO) + "/", "")


def read_metrics(run_dir: Path) -> list[dict]:
    """Every record of the run's metrics.jsonl in file order, read by relaytrain's own reader."""
    try:
        return read_records(RunDir(Path(run_dir)).metrics)[0]
    except UserError as err:  # not written, or no record in it
        raise BenchError(str(err)) from None


def train_records(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("kind") == "train"]


def events(records: list[dict], name: str) -> list[dict]:
    return [r for r in records if r.get("kind") == "event" and r.get("event") == name]


def last_json_line(text: str) -> dict:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise BenchError(f"no JSON result in output:\n{text[-2000:]}")
