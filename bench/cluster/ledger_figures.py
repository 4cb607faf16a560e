"""What a cluster benchmark keeps of a run's time ledger (relaytrain's `monitor/run_ledger.py`, the one
computation `relaytrain status` shows): its seconds per bucket, and how it compares with Slurm.

bench.goodput reads a run's productive and allocated seconds from it; bench.chaos keeps it per trial
with `relaytrain verify`'s exit code, and a trial counts only when the ledger adds up (`adds_up`).
"""

from __future__ import annotations

from typing import Any

from relaytrain.monitor.run_ledger import RunTime

from bench.report import table

WITHIN = 0.01  # the bound: the buckets add up to sacct's elapsed, and at most this unaccounted


def ledger_figures(measured: RunTime) -> dict[str, Any]:
    """Of a run's ledger (`RunFiles.time_ledger`): its `allocated_s`, `queue_s`, `goodput` and `buckets`
    (as `relaytrain status --json` gives them), its number of `allocations`, and against Slurm: `sacct_s`
    (sacct's elapsed time of every run of the run's jobs; None when accounting did not answer, 0 outside
    Slurm), `vs_sacct` (the ledger's Slurm allocations less that, relative to it; None without it),
    `unaccounted_share` and `inferred_share` (the time a rule put in a bucket where no record measured it,
    `inferred_s`, relative to the allocated time: `relaytrain verify` counts what no other source confirms
    of it in its 1 % check)."""
    ledger = measured.ledger
    figures = {key: value for key, value in ledger.as_json().items() if key != "jobs"}
    runs = measured.slurm_runs
    sacct = None if runs is None else sum(r.end - r.start for r in runs)
    slurm_s = sum(job.seconds for job in ledger.jobs if job.allocation.job_id is not None)
    allocated = ledger.allocated_s
    figures.update({
        "allocations": len(ledger.jobs),
        "sacct_s": None if sacct is None else round(sacct, 3),
        "vs_sacct": round((slurm_s - sacct) / sacct, 6) if sacct else None,
        "unaccounted_share": round(ledger.buckets["unaccounted"] / allocated, 6) if allocated else None,
        "inferred_share": round(sum(ledger.inferred.values()) / allocated, 6) if allocated else None,
    })  # fmt: skip
    return figures


def adds_up(figures: dict[str, Any]) -> bool:
    """The buckets add up to sacct's elapsed time within `WITHIN`, and at most `WITHIN` is unaccounted."""
    vs, unaccounted = figures.get("vs_sacct"), figures.get("unaccounted_share")
    return vs is not None and abs(vs) <= WITHIN and unaccounted is not None and unaccounted <= WITHIN


def time_adds_up(trial: Any) -> bool | None:
    """A chaos trial's: `relaytrain verify` exited 0 and its ledger `adds_up`; None for a trial kept before
    the benchmark recorded them (its `verify_exit` None)."""
    if trial.verify_exit is None:
        return None
    return trial.verify_exit == 0 and adds_up(trial.ledger)


# -- on the page: only for results that carry the ledger (older kept files render as they did) ----------


def inferred_recorded(trials: list[Any]) -> bool:
    """Whether any of the trials kept its ledger's inferred share (older kept results did not)."""
    return any("inferred_share" in (t.ledger or {}) for t in trials if t.verify_exit is not None)


def ledger_cell(trial: Any, inferred: bool = False) -> str:
    """A chaos trial's `verify` exit code; the ledger's Slurm allocations against sacct's elapsed time;
    its unaccounted share; with `inferred`, its inferred share."""
    if trial.verify_exit is None:
        return "–"
    figures = trial.ledger
    vs, unaccounted = figures.get("vs_sacct"), figures.get("unaccounted_share")
    against = "no sacct" if vs is None else f"{100 * vs:+.1f}%"
    share = "–" if unaccounted is None else f"{100 * unaccounted:.1f}%"
    text = f"{trial.verify_exit}; {against}; {share}"
    if inferred:
        guessed = figures.get("inferred_share")
        text += "; –" if guessed is None else f"; {100 * guessed:.1f}%"
    return text if time_adds_up(trial) else f"**{text}**"


LEDGER_COLUMN = "verify exit; ledger − sacct; unaccounted"
INFERRED_COLUMN = LEDGER_COLUMN + "; inferred"


def ledger_column(trials: list[Any]) -> str:
    return INFERRED_COLUMN if inferred_recorded(trials) else LEDGER_COLUMN


def ledger_sentence(trials: list[Any]) -> str:
    """How many of the trials that recorded it ended with `relaytrain verify` exiting 0 and a ledger
    that adds up; "" when none recorded it."""
    measured = [t for t in trials if t.verify_exit is not None]
    if not measured:
        return ""
    held = sum(bool(time_adds_up(t)) for t in measured)
    return (
        f" `relaytrain verify RUN` exited 0 and the run's time ledger added up to sacct's elapsed time of "
        f"its jobs within {WITHIN:.0%}, at most {WITHIN:.0%} unaccounted, in **{held} of {len(measured)}** "
        f"trials (column `{ledger_column(trials)}`)." + inferred_sentence(measured)
    )


def inferred_sentence(trials: list[Any]) -> str:
    """The time the trials' ledgers inferred by rule, all together and at most in one trial; "" when none
    kept it."""
    kept = [t.ledger for t in trials if "inferred_share" in (t.ledger or {}) and t.ledger.get("allocated_s")]
    if not kept:
        return ""
    allocated = sum(f["allocated_s"] for f in kept)
    inferred = sum(f.get("inferred_s", 0.0) for f in kept)
    largest = max(f["inferred_share"] for f in kept)
    return (
        f" The ledgers inferred by rule (no record measured it) {100 * inferred / allocated:.1f}% of "
        f"{allocated:.0f} s allocated in all, at most {100 * largest:.1f}% of one trial's; verify counts "
        f"what no other source confirms of it in its {WITHIN:.0%} check (the inferred share in the column)."
    )


def bucket_table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """Seconds per ledger bucket of each named run that has a ledger, the buckets no run used left out;
    "" when none has one."""
    shown = [(name, figures) for name, figures in runs if figures]
    if not shown:
        return ""
    names = list(shown[0][1]["buckets"])
    used = [b for b in names if any(f["buckets"].get(b, 0) > 0 for _, f in shown)]
    header = ["run", "allocated s", *used, "goodput", "ledger − sacct"]
    rows = [
        (name, f"{f['allocated_s']:.1f}", *(f"{f['buckets'].get(b, 0.0):.1f}" for b in used),
         "–" if f.get("goodput") is None else f"{100 * f['goodput']:.1f}%",
         "–" if f.get("vs_sacct") is None else f"{100 * f['vs_sacct']:+.1f}%")
        for name, f in shown
    ]  # fmt: skip
    return table(header, rows)
