"""`relaytrain verify RUN`: prove from a run directory's own files that no sample and no checkpoint was lost.

The checks, each a function of the run directory and its config that returns its violations and a
summary line:

- samples: along the run's surviving lineage across all its jobs and restarts, every global sample was
  consumed exactly once, in the order of an uninterrupted run (relaytrain/data/sample_check.py);
- data: the tokens each rank of each lineage step read are those an uninterrupted run reads there, read
  again from the prepared data's files, and the data settings did not change inside the run unless
  `--allow-data-change` (relaytrain/data/sample_data.py);
- checkpoints: every committed checkpoint matches its manifest's sizes and checksums, and `latest` names a
  committed one (relaytrain/checkpoint/integrity.py);
- ledger: the run's time ledger adds up: its buckets to the allocated time, no second counted twice, at
  most 1 % unaccounted or inferred by rule without another source to confirm it, every logged step in a
  window, no checkpoint committed outside the allocations, the steps' time to the train records' and a
  requeue's queue to Slurm's Submit to Start, and the Slurm allocations to sacct's elapsed time of the
  jobs' runs within 1 % (relaytrain/monitor/ledger_check.py, ledger_sources.py, ledger_steps.py,
  ledger_queue.py).

A further check is one more entry in `CHECKS`.

Exit 0 when every check holds (one summary line per check), 1 with one line per violation, 2 when the run
cannot be read (no such run, an unreadable config, damaged records). A part of a check that needs a
source outside the run that cannot be read (Slurm's accounting, its job completion file) is not made:
the summary line says so and why, and the exit status is that of the checks made.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from relaytrain.config import Config
from relaytrain.errors import UserError
from relaytrain.job import RunDir, jsonl

MAX_LINES = 200  # a systematic fault breaks every step: the first lines say what, the count how often


@dataclass(frozen=True)
class Options:
    allow_data_change: bool = False  # a change of the data settings inside the run is reported, not failed


class Report(Protocol):
    violations: list[str]

    def summary(self) -> str: ...


def _reached(run: RunDir) -> int | None:
    from relaytrain.resilience.run_state import RunStateFile

    state = RunStateFile(run).read()  # a damaged file: a UserError naming it
    return state.step if state is not None and state.step >= 0 else None


def _samples(run: RunDir, cfg: Config, opts: Options) -> Report:
    from relaytrain.data.sample_check import check_samples

    return check_samples(run, cfg.train.global_batch_size, _reached(run))


def _data(run: RunDir, cfg: Config, opts: Options) -> Report:
    from relaytrain.data.sample_data import check_data

    return check_data(run, cfg.train.global_batch_size, _reached(run), opts.allow_data_change)


def _checkpoints(run: RunDir, cfg: Config, opts: Options) -> Report:
    from relaytrain.checkpoint.integrity import check_checkpoints

    return check_checkpoints(Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run.checkpoints)


def _ledger(run: RunDir, cfg: Config, opts: Options) -> Report:
    from relaytrain.monitor.ledger_check import LedgerReport, check_ledger
    from relaytrain.monitor.run_ledger import run_time

    if not run.metrics.is_file():
        return LedgerReport(notes=[f"no {run.metrics.name}: no time recorded"])
    measured = run_time(run)
    crashes = jsonl.read(run.crashes).records if run.crashes.is_file() else []
    commits = _commits(cfg, run)
    return check_ledger(
        measured.ledger, measured.records, measured.slurm_runs, crashes, commits, measured.slurm_why
    )


def _commits(cfg: Config, run: RunDir) -> list[tuple[str, float]]:
    """(name, commit time) of every committed checkpoint: when its COMPLETE manifest was written."""
    from relaytrain.checkpoint.files import COMPLETE, list_steps

    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run.checkpoints
    steps = list_steps(ckpt_dir) if ckpt_dir.is_dir() else []
    return [(s.path.name, (s.path / COMPLETE).stat().st_mtime) for s in steps if s.complete]


CHECKS: list[tuple[str, Callable[[RunDir, Config, Options], Report]]] = [
    ("samples", _samples),
    ("data", _data),
    ("checkpoints", _checkpoints),
    ("ledger", _ledger),
]


def _run_config(run: RunDir) -> Config:
    from relaytrain.config import load_config

    if not run.config.is_file():
        raise UserError(f"{run.root} has no {run.config.name}: the run never started training")
    try:
        return load_config(run.config)
    except UserError as exc:
        raise UserError(f"cannot read the run's config {run.config}: {exc}") from None


def verify(run: RunDir, opts: Options = Options()) -> tuple[list[str], list[str]]:
    """(violations, summaries) of every check, each line prefixed with its check's name."""
    cfg = _run_config(run)
    violations, summaries = [], []
    for name, check in CHECKS:
        report = check(run, cfg, opts)
        violations += [f"{name}: {line}" for line in report.violations]
        summaries.append(f"{name}: {report.summary()}")
    return violations, summaries


def cmd_verify(args: argparse.Namespace) -> int:
    from relaytrain.inspection.run_view import required_run

    run = required_run(args.run, Path(args.runs))
    violations, summaries = verify(run, Options(allow_data_change=args.allow_data_change))
    for line in violations[:MAX_LINES]:
        print(line)
    if len(violations) > MAX_LINES:
        print(f"... and {len(violations) - MAX_LINES} more violations", file=sys.stderr)
    if violations:
        print(f"verify {run.root}: FAILED, {len(violations)} violation(s)", file=sys.stderr)
        return 1
    for line in summaries:
        print(line)
    print(f"verify {run.root}: OK")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "verify",
        help="prove from a run's files that each sample was read once and no checkpoint is damaged",
        description="Four checks over all the run's jobs, requeues and restarts. The samples check: every "
        "global sample was read exactly once, in the order of an uninterrupted run. The data check: the "
        "tokens each rank read are those the prepared data holds there. The checkpoints check: every "
        "committed checkpoint matches its checksums and `latest` names a committed one. The ledger check: "
        "the time ledger adds up, at most 1 % of it unaccounted or inferred without a source to confirm it, "
        "and its productive time agrees with the train records' step times within 1 %. Exit 0: all hold "
        "(one summary line per "
        "check). Exit 1: one line per violation. "
        "Exit 2: the run cannot be read. A part that needs Slurm's accounting or job completion file where "
        "this host cannot read them is not made: its summary line says so and why.",
    )
    p.add_argument("run", metavar="RUN", help="a run name under --runs, or the path of a run directory")
    p.add_argument("--runs", default="runs", help="where run directories live (default: runs)")
    p.add_argument(
        "--allow-data-change",
        action="store_true",
        help="accept a change of the data settings (seed, shuffle, weights, seq_len, sources) "
        "at a resume: the report states it, each part is checked against its own",
    )
    p.set_defaults(func=cmd_verify)
