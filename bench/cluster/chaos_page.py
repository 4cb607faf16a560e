"""The chaos benchmark's section of docs/benchmarks.md: the random trials' table, the targeted trials'
(several runs merged), the verdict against the issue's targets; and reading runs' results.json back."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from bench.cluster import chaos_kinds
from bench.cluster.chaos_kinds import SPECIAL_KINDS, SpecialTrial
from bench.cluster.chaos_run import EVAL_EVERY, INTERVAL, STEPS, Trial
from bench.report import REPO, code, table

# Named on the page: the module that defines the targeted kinds.
KINDS_SOURCE = Path(chaos_kinds.__file__).resolve().relative_to(REPO.resolve()).as_posix()


def render(trials: list[Trial], seed: int | str, command: str, info: dict, load: str = "") -> str:
    ok = sum(t.ok for t in trials)
    rows = [
        (t.index, t.phase, t.event, t.fired_at_step, t.restarts, t.resubmits,
         "yes" if t.bit_exact else "**no**", t.steps_replayed,
         "yes" if t.latest_complete else "**no**", ", ".join(t.leftovers) or "none",
         t.final_status, t.seconds, t.error or "")
        for t in trials
    ]  # fmt: skip
    return (
        "## Chaos: random interruptions on real Slurm\n\n"
        f"Date {datetime.now(UTC).date()}, machine: {info.get('cpu', '?')} ({info.get('cores', '?')} cores), "
        f"local Slurm cluster (`relaytrain cluster up`). Seed(s) **{seed}**. Command(s): {code(command)}.\n"
        f"Load average (1/5/15 min) at the start → end: {load or 'not recorded'}.\n"
        f"A 2-rank tiny run ({STEPS} steps, async checkpoint every {INTERVAL}, eval every {EVAL_EVERY}) "
        "per trial, "
        "compared with one uninterrupted reference run. Leftovers: files outside config.toml, metrics.jsonl, "
        "run_state.json, crashes.jsonl, slurm/, logs/, checkpoints/latest and complete checkpoints.\n\n"
        f"**{ok} of {len(trials)} trials passed** (bit-exact losses and val_losses, latest complete, "
        "no leftovers, finished).\n\n"
        + table(
            [
                "#",
                "phase",
                "event",
                "fired at step",
                "restarts",
                "resubmits",
                "bit-exact",
                "steps replayed",
                "latest complete",
                "leftovers",
                "final status",
                "s",
                "error",
            ],
            rows,
        )  # fmt: skip
    )


# A kill-save trial names the checkpoint.mode it really ran with (a benchmark bug once ran every one sync).
KILL_MODE = re.compile(r"in the (a?sync) save")


@dataclass
class MergedSpecial:
    """The targeted rows of several runs as the page shows them."""

    trials: list[SpecialTrial]
    superseded: list[SpecialTrial]  # replaced by a later run of the same kind
    relabelled: int  # kill-save rows whose kind was corrected to the mode they ran with


def merge_special(trials: list[SpecialTrial]) -> MergedSpecial:
    """Merge rows given in run order: kill-save trials add up (each is one more kill), any other kind
    shows only the latest run that has it. Rows are numbered again from 0."""
    kills, relabelled = [], 0
    for t in trials:
        if not t.kind.startswith("kill_save"):
            continue
        mode = KILL_MODE.search(t.detail)
        if mode and t.kind != f"kill_save_{mode.group(1)}":
            t, relabelled = replace(t, kind=f"kill_save_{mode.group(1)}"), relabelled + 1
        kills.append(t)
    others = [t for t in trials if not t.kind.startswith("kill_save")]
    latest = {t.kind: t.seed for t in others}  # the last run wins
    kept = [t for t in others if t.seed == latest[t.kind]]
    order = {kind: i for i, kind in enumerate(SPECIAL_KINDS)}
    kept.sort(key=lambda t: order.get(t.kind, len(order)))  # stable: a run's own order within a kind
    superseded = [t for t in others if t.seed != latest[t.kind]]
    rows = [replace(t, index=i) for i, t in enumerate(kills + kept)]
    return MergedSpecial(rows, superseded, relabelled)


def kill_save_line(trials: list[SpecialTrial]) -> str:
    kill = [t for t in trials if t.kind.startswith("kill_save")]
    in_flight = sum(t.checks.get("save in flight when killed", False) for t in kill)
    fell_back = sum(
        t.checks.get("resumed from the previous complete checkpoint", False) and t.ok for t in kill
    )
    modes = ", ".join(
        f"{sum(t.kind == f'kill_save_{m}' for t in kill)} {m}" for m in ("async", "sync")
    )  # fmt: skip
    return (
        f"SIGKILL during a save: **{fell_back} of {len(kill)}** ({modes}) fell back to the previous complete "
        f"checkpoint and finished bit-exact ({in_flight} of {len(kill)} kills landed while the save was in "
        "flight: its step directory existed without COMPLETE)."
    )


def render_special(trials: list[SpecialTrial], merged: MergedSpecial | None = None) -> str:
    if not trials:
        return ""
    seeds = merged is not None
    rows = [
        ((t.index, t.seed) if seeds else (t.index,)) + (t.kind, t.detail or "–",
         "; ".join(f"{name}: {'yes' if ok else '**no**'}" for name, ok in t.checks.items()) or "–",
         "yes" if t.bit_exact else "**no**", t.steps_replayed, t.restarts, t.resubmits,
         "yes" if t.latest_complete else "**no**", ", ".join(t.leftovers) or "none", t.final_status,
         t.seconds, t.error or "")
        for t in trials
    ]  # fmt: skip
    header = ["#", "seed"] if seeds else ["#"]
    notes = ""
    if merged is not None and merged.relabelled:
        notes += (
            f" {merged.relabelled} kill-save rows are listed under the checkpoint.mode they reported "
            "('what happened'), not the one their run asked for."
        )
    if merged is not None and merged.superseded:
        dropped = "; ".join(
            f"seed {seed}: " + ", ".join(sorted({t.kind for t in merged.superseded if t.seed == seed}))
            for seed in sorted({t.seed for t in merged.superseded})
        )  # fmt: skip
        notes += f" Not shown, because a later run of the same kind replaces them: {dropped}."
    return (
        "\n### Targeted trials\n\n"
        + kill_save_line(trials)
        + f" The kinds: `{KINDS_SOURCE}`."
        + notes
        + "\n\n"
        + table(header + ["kind", "what happened", "checks", "bit-exact", "steps replayed", "restarts",
                          "resubmits", "latest complete", "leftovers", "final status", "s", "error"], rows)
    )  # fmt: skip


def summary(trials: list[Trial], special: list[SpecialTrial]) -> str:
    """The issue's targets, each with what this page's trials show."""

    def verdict(kinds: tuple[str, ...]) -> str:
        rows = [t for t in special if t.kind in kinds]
        if not rows:
            return "not run"
        parts = []
        for t in rows:
            failed = [name for name, ok in t.checks.items() if not ok]
            state = "pass" if t.ok else "**fail** (" + ", ".join(failed or [t.error or "not finished"]) + ")"
            parts.append(f"{t.kind} (row {t.index}): {state}")
        return "; ".join(parts)

    bit_exact = sum(t.bit_exact for t in trials)
    kill = [t for t in special if t.kind.startswith("kill_save")]
    fell_back = sum(
        t.ok and t.checks.get("resumed from the previous complete checkpoint", False) for t in kill
    )
    disk = [t for t in special if t.kind == "disk_full"]
    lost = sum(not t.checks.get("previous checkpoint intact", False) for t in disk)
    lines = [
        f"- 20 random trials, 20 bit-exact: **{bit_exact} of {len(trials)}** bit-exact, "
        f"{sum(t.ok for t in trials)} passed every check.",
        f"- ≥ 10 SIGKILL-during-save trials fall back: **{fell_back} of {len(kill)}**.",
        "- Disk full, 0 checkpoints lost: "
        + (f"**{lost} lost** in {len(disk)} trial(s); " if disk else "")
        + f"{verdict(('disk_full',))}.",
        f"- Requeue cap: {verdict(('time_limit_cap', 'time_limit_cap_budget'))}.",
        f"- Hang: {verdict(('hang',))}.",
    ]  # fmt: skip
    return "\n### Against the issue's targets\n\n" + "\n".join(lines) + "\n"


def load_results(paths: list[str]) -> tuple[list[Trial], list[SpecialTrial]]:
    """Trials of several runs' results.json, in the order given; targeted ones carry their run's seed."""
    trials, special = [], []
    for path in paths:
        seed = m.group(1) if (m := re.search(r"seed(\d+)", str(path))) else ""
        for row in json.loads(Path(path).read_text()):
            if "kind" in row:
                special.append(SpecialTrial(**{**row, "seed": row.get("seed") or seed}))
            else:
                trials.append(Trial(**row))
    return trials, special
