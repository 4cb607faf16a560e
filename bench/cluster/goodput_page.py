"""The goodput benchmark's section of docs/benchmarks.md: the commands that measured the runs, the runs'
table and what in it is local (the 7B extrapolation is goodput_extrapolation.py's)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from bench.cluster.goodput_results import ResultsFile, RunResult
from bench.cluster.ledger_figures import bucket_table
from bench.report import code, fmt, pct, table

STEP_DELAY_S = 0.5  # each step of a goodput run is slowed to this, so that a run lasts minutes
CKPT_INTERVAL = 10


def mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r and r[key] == r[key]]
    return sum(values) / len(values) if values else float("nan")


def interruptions_cell(r: RunResult) -> str:
    if not r.interruptions:
        return "0"
    counts = Counter(r.stop_reasons)
    if len(counts) == 1:
        return f"{r.interruptions} ({next(iter(counts))})"
    reasons = ", ".join(f"{n} {reason}" for reason, n in counts.items())
    return f"{r.interruptions} ({reasons})" if reasons else str(r.interruptions)


def run_rows(runs: list[RunResult]) -> list[tuple]:
    rows = []
    for r in runs:
        s2e, r2s = r.signal_to_exit, r.requeue_to_step
        rows.append((
            r.name, r.interruption, r.steps, interruptions_cell(r), fmt(r.allocated_s), fmt(r.productive_s),
            pct(r.goodput), fmt(r.replayed / r.interruptions) if r.interruptions else "–",
            (f"{fmt(mean(s2e, 'total'))} ({fmt(mean(s2e, 'save'))} + "
             f"{fmt(mean(s2e, 'exit'))})") if s2e else "–",
            (f"{fmt(mean(r2s, 'total'))} ({fmt(mean(r2s, 'queue'))} + {fmt(mean(r2s, 'startup'))} + "
             f"{fmt(mean(r2s, 'load'))})") if r2s else "–",
            r.error or r.final,
        ))  # fmt: skip
    return rows


def source_line(results: ResultsFile, runs: list[RunResult]) -> str:
    names = ", ".join(r.name for r in runs)
    command = code(results.command) if results.command else "command not recorded"
    facts = [results.date or "date not recorded"]
    load = f"load average 1/5/15 min start → end: {results.load}" if results.load else "load not recorded"
    facts.append(load)
    return f"- {names}: {command} ({'; '.join(facts)})\n"


def render(sources: list[tuple[ResultsFile, list[RunResult]]], info: dict, notes: Sequence[str] = ()) -> str:
    """The section: the commands that measured the runs (one line per results file), the runs' table,
    what is local, then the notes, one paragraph each."""
    runs = [r for _, file_runs in sources for r in file_runs]
    return (
        "## Goodput under preemption and time limits\n\n"
        f"Machine: {info.get('cpu', '?')} ({info.get('cores', '?')} cores), local Slurm cluster "
        f"(`relaytrain cluster up`). A tiny 2-rank run, steps slowed to {STEP_DELAY_S} s "
        f"(`RELAYTRAIN_FAULT_STEP_DELAY_S` from faults/), async checkpoint every {CKPT_INTERVAL} steps. "
        "Times in seconds; "
        "means over the interruptions of a run. Measured by:\n\n"
        + "".join(source_line(results, file_runs) for results, file_runs in sources)
        + "\n"
        + table(["run", "interruption", "steps", "interruptions (stop reason)", "allocated s", "productive s",
                 "goodput", "steps lost / interruption", "signal→exit (save + exit)",
                 "requeue→first step (queue + start-up + load)", "end of run"], run_rows(runs))
        + "\n**What is an artefact of the local cluster.** The queue part is local Slurm settings: a "
        "requeued job may start only `AuthInfo=cred_expire` + 1 s after its end (10 + 1 s here; 121 s "
        "with Slurm's default), then at the next scheduling pass (`sched_interval`, 2 s here; 60 s by "
        "default); a preemption adds GraceTime (5 s) and the high job's own run. Start-up is dominated by"
        " `import torch` on 2 shared cores; the saves and loads are of a 2 MB checkpoint. Goodput on this"
        " page is therefore a lower bound driven by fixed local costs over minute-long intervals; the "
        "extrapolation below replaces them.\n"
        + ledger_part(runs)
        + "".join(f"\n{note}\n" for note in notes)
    )  # fmt: skip


def ledger_part(runs: list[RunResult]) -> str:
    """Where each run's allocated time went, from the runs' time ledgers (results kept before the
    benchmark read the ledger have none, and their section shows no such table)."""
    buckets = bucket_table([(r.name, r.ledger) for r in runs])
    if not buckets:
        return ""
    return (
        "\nWhere the allocated time went: each run's time ledger (`relaytrain status RUN --json`), whose "
        "productive and allocated seconds are the table's above; seconds per bucket, and the ledger's "
        "Slurm allocations against sacct's elapsed time of the job's runs.\n\n" + buckets
    )
