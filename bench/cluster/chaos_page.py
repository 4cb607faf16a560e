"""The chaos benchmark's sections of docs/benchmarks.md, written from kept results files (bench/results/
chaos-seed*.json, bench/kept.py) and nothing else, so that `python -m bench.chaos --page-from FILES
--section NAME` rewrites a section byte for byte: each section's heading and introduction (SECTIONS), the
random trials' table, the targeted trials' (several runs merged), the verdict against the issue's targets
for the targets its trials ran, and each run's notes. A trial counts only with evidence that its fault
landed (chaos_run.fault_evidence): the tables show it."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench import kept
from bench.cluster import chaos_kinds
from bench.cluster.chaos_kinds import SPECIAL_KINDS, SpecialTrial
from bench.cluster.chaos_run import EVAL_EVERY, INTERVAL, STEPS, Trial
from bench.cluster.ledger_figures import (
    inferred_recorded,
    ledger_cell,
    ledger_column,
    ledger_sentence,
    time_adds_up,
)
from bench.report import REPO, table

# Named on the page: the module that defines the targeted kinds.
KINDS_SOURCE = Path(chaos_kinds.__file__).resolve().relative_to(REPO.resolve()).as_posix()
COMMAND = "python -m bench.chaos"


@dataclass(frozen=True)
class Section:
    title: str
    intro: str = ""


# The page's chaos sections: `--section NAME` writes NAME's heading and introduction above the trials.
SECTIONS = {
    "chaos": Section("Chaos: random interruptions on real Slurm"),
    "chaos-restart": Section(
        "Chaos with restarts in place (random kills, a hang, the restart cap)",
        "The same trials as the chaos section above, run after restarts in place came in: a SIGKILLed rank "
        "and a hung rank now restart the job step inside the allocation (`restarts` counts requeues only, "
        "so a crash restarted in place shows in the evidence column, as a crashes.jsonl line); "
        "`kill_in_place_then_requeue` runs with `resilience.max_step_restarts=1`, so the first kill "
        "restarts in place and the second requeues.",
    ),
    "chaos-snapshots": Section(
        "Chaos with in-memory snapshots (a rank killed between interval checkpoints)",
        "`kill_with_snapshots`: `checkpoint.snapshot_every=1`, interval checkpoints every 10 steps, rank 1 "
        "SIGKILLed at a random step at least 2 past the last checkpoint (one node: the snapshots are "
        "node-local, no replica). The step restarts in place and must resume from the snapshot of the "
        "step it reached, not from the checkpoint behind it (at most one step replayed, against up to 9 "
        "from the checkpoint). The wipe of a node and the peer replica are tested on 2 nodes by "
        "`tests/test_snapshot_slurm.py`, and at random steps by the next section's trials.",
    ),
    "chaos-snapshot-peers": Section(
        "Chaos with peer replicas (2 nodes: a node's snapshots wiped, or both copies of a shard)",
        "`wipe_node_with_snapshots` and `wipe_both_copies_with_snapshots` "
        "(bench/cluster/chaos_snapshots.py): 2 nodes × 1 task, each node with its own `/dev/shm`, "
        "`checkpoint.snapshot_every=1`, interval checkpoints every 10 steps; rank 1 SIGKILLed at a random "
        "step 2 to 7 past an interval checkpoint "
        "(not the first). In the first kind its node's memory is wiped too (every snapshot of the job on "
        "it: rank 1's own files and the replicas of rank 0's): the step restarts in place and must resume "
        "from the snapshot of the step it reached, rank 1's file fetched from its replica on rank 0's node "
        "(`(1 of 2 rank file(s) from a peer node)` in the log). In the second rank 1's files are gone from "
        "both nodes (its node's copy and its replica; rank 0's files stay): no snapshot step is complete, "
        "the log must say `skipping the partial snapshot of step N: no node holds the file of rank(s) 1` "
        "and `no snapshot newer than the checkpoints is complete: resuming from the checkpoint`, and the "
        "run replays from the interval checkpoint.",
    ),
    "chaos-ledger": Section(
        "Chaos with the time ledger and `relaytrain verify`",
        "The same kinds of trials as above (at random phases: Slurm's USR2 time-limit signal, a preemption, "
        "a rank SIGKILLed, a node killed; a time limit; a kill with snapshots; a node's snapshots wiped; a "
        "rank throttled from outside until the trainer named it a straggler and a spare node took its "
        "node's place: `straggler_replace`, on the straggler trials' small model, its own reference run), "
        "each also judged by the run's own accounts: `relaytrain verify RUN` must exit 0 (every sample "
        "read exactly once and in order across the interruptions, the tokens each rank read those the "
        "prepared data holds there, every checkpoint intact, the time ledger adding up, at most 1 % of it "
        "unaccounted or inferred by rule with no other source to confirm it), and the ledger's allocations "
        "must add up to sacct's elapsed time of the run's jobs within 1 %, with at most 1 % of it "
        "unaccounted. The column's last figure is the share of the allocated time the ledger inferred by "
        "rule (a tail to Slurm's End, a failed step's tail) rather than measured, confirmed or not.",
    ),
}


@dataclass
class KeptRun:
    """One invocation's kept results: what measured them, and its trials."""

    path: str  # as the page names it
    command: str
    date: str
    seed: str
    cpu: str
    cores: int | str
    load: str
    transcribed: str
    notes: list[str]
    trials: list[Trial]
    special: list[SpecialTrial]
    not_run: list[str] = field(default_factory=list)  # kinds of targeted trials the run never started


def results_data(command: str, date: str, seed: int | str, info: dict, load: str, rows: list) -> dict:
    """A kept results file's content (chaos.py writes it as the run goes)."""
    return {"command": command, "date": date, "seed": str(seed), "cpu": info.get("cpu", "?"),
            "cores": info.get("cores", "?"), "load": load, "trials": [asdict(t) for t in rows]}  # fmt: skip


def load_run(path: str | Path) -> KeptRun:
    """A kept results file; the targeted trials carry its seed."""
    data = kept.load(path)
    seed = str(data.get("seed", ""))
    trials, special, not_run = [], [], []
    for row in data.get("trials", []):
        if "kind" in row and not (row.get("job") or row.get("error") or row.get("seconds")):
            not_run.append(row["kind"])  # saved before it began: the benchmark was stopped first
        elif "kind" in row:
            special.append(SpecialTrial(**{**row, "seed": row.get("seed") or seed}))
        else:
            trials.append(Trial(**row))
    return KeptRun(kept.relative(path), data.get("command", ""), data.get("date", ""), seed,
                   data.get("cpu", "?"), data.get("cores", "?"), data.get("load", ""),
                   data.get("transcribed", ""), list(data.get("notes", [])), trials, special,
                   not_run)  # fmt: skip


def load_results(paths: list[str]) -> tuple[list[Trial], list[SpecialTrial]]:
    """Trials of several kept results files, in the order given."""
    runs = [load_run(p) for p in paths]
    return [t for r in runs for t in r.trials], [t for r in runs for t in r.special]


def evidence_cell(t: Trial | SpecialTrial) -> str:
    return "; ".join(t.evidence) or "**none recorded**"


def preamble(runs: list[KeptRun], section: str) -> str:
    dates = ", ".join(dict.fromkeys(r.date for r in runs))
    machines = ", ".join(dict.fromkeys(f"{r.cpu} ({r.cores} cores)" for r in runs))
    seeds = ", ".join(r.seed for r in runs)
    commands = "; ".join(f"`{r.command}`" for r in runs)
    loads = "; ".join(
        (f"seed {r.seed}: " if len(runs) > 1 else "") + (r.load or "not recorded") for r in runs
    )
    head = SECTIONS[section]
    return (
        f"## {head.title}\n\n"
        + (f"{head.intro}\n\n" if head.intro else "")
        + f"Date {dates}, machine: {machines}, local Slurm cluster (`relaytrain "
        f"cluster up`). Seed(s) **{seeds}**. Command(s): {commands}.\n"
        f"Load average (1/5/15 min) at the start → end: {loads}.\n"
        f"A 2-rank tiny run ({STEPS} steps, async checkpoint every {INTERVAL}, eval every {EVAL_EVERY}) "
        "per trial, compared with one uninterrupted reference run. Leftovers: files outside config.toml, "
        "metrics.jsonl, run_state.json, crashes.jsonl, slurm/, logs/, checkpoints/latest and complete "
        "checkpoints. A trial counts only with evidence that its fault landed: a crashes.jsonl line, a "
        "stop or resume event, a requeue or resubmission, or the killed process gone.\n"
    )


def render(trials: list[Trial]) -> str:
    if not trials:
        return ""
    ok = sum(t.ok for t in trials)
    unproven = sum(not t.evidence for t in trials)
    ledger = any(t.verify_exit is not None for t in trials)  # older kept results did not record it
    inferred = inferred_recorded(trials)
    rows = [
        (t.index, t.phase, t.event, t.fired_at_step, evidence_cell(t), t.restarts, t.resubmits,
         "yes" if t.bit_exact else "**no**", t.steps_replayed, "yes" if t.latest_complete else "**no**",
         ", ".join(t.leftovers) or "none", t.final_status, *((ledger_cell(t, inferred),) if ledger else ()),
         t.seconds, kept.in_repository(t.error or ""))
        for t in trials
    ]  # fmt: skip
    header = ["#", "phase", "event", "fired at step", "evidence that the fault landed", "restarts",
              "resubmits", "bit-exact", "steps replayed", "latest complete", "leftovers", "final status",
              *((ledger_column(trials),) if ledger else ()), "s", "error"]  # fmt: skip
    return (
        f"\n**{ok} of {len(trials)} trials passed** (evidence that the fault landed, bit-exact losses and "
        "val_losses, latest complete, no leftovers, finished"
        + (", verify exit 0 and the ledger adding up" if ledger else "")
        + ")"
        + (f"; {unproven} without evidence of their fault do not count" if unproven else "")
        + "."
        + ledger_sentence(trials)
        + "\n\n"
        + table(header, rows)
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
    kept_rows = [t for t in others if t.seed == latest[t.kind]]
    order = {kind: i for i, kind in enumerate(SPECIAL_KINDS)}
    kept_rows.sort(key=lambda t: order.get(t.kind, len(order)))  # stable: a run's own order within a kind
    superseded = [t for t in others if t.seed != latest[t.kind]]
    rows = [replace(t, index=i) for i, t in enumerate(kills + kept_rows)]
    return MergedSpecial(rows, superseded, relabelled)


FELL_BACK = "resumed from the previous complete checkpoint"


def kill_save_line(trials: list[SpecialTrial]) -> str:
    kill = [t for t in trials if t.kind.startswith("kill_save")]
    if not kill:
        return ""
    in_flight = sum(t.checks.get("save in flight when killed", False) for t in kill)
    fell_back = sum(t.checks.get(FELL_BACK, False) and t.ok for t in kill)
    modes = ", ".join(
        f"{sum(t.kind == f'kill_save_{m}' for t in kill)} {m}" for m in ("async", "sync")
    )  # fmt: skip
    return (
        f"SIGKILL during a save: **{fell_back} of {len(kill)}** ({modes}) fell back to the previous complete "
        f"checkpoint and finished bit-exact ({in_flight} of {len(kill)} kills landed while the save was in "
        "flight: its step directory existed without COMPLETE). "
    )


def render_special(trials: list[SpecialTrial], merged: MergedSpecial | None = None) -> str:
    if not trials:
        return ""
    seeds = merged is not None
    ledger = any(t.verify_exit is not None for t in trials)  # older kept results did not record it
    inferred = inferred_recorded(trials)
    rows = [
        ((t.index, t.seed) if seeds else (t.index,)) + (t.kind, t.detail or "–",
         "; ".join(f"{name}: {'yes' if ok else '**no**'}" for name, ok in t.checks.items()) or "–",
         evidence_cell(t), "yes" if t.bit_exact else "**no**", t.steps_replayed, t.restarts, t.resubmits,
         "yes" if t.latest_complete else "**no**", ", ".join(t.leftovers) or "none", t.final_status,
         *((ledger_cell(t, inferred),) if ledger else ()), t.seconds, kept.in_repository(t.error or ""))
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
        + f"The kinds: `{KINDS_SOURCE}`."
        + notes
        + ledger_sentence(trials)
        + "\n\n"
        + table(header + ["kind", "what happened", "checks", "evidence that the fault landed", "bit-exact",
                          "steps replayed", "restarts", "resubmits", "latest complete", "leftovers",
                          "final status", *((ledger_column(trials),) if ledger else ()), "s", "error"], rows)
    )  # fmt: skip


RANDOM_TARGET, KILL_SAVE_TARGET = 20, 10


def summary(trials: list[Trial], special: list[SpecialTrial]) -> str:
    """The issue's targets that this section's trials ran, each scored on the trials run against it."""

    def verdict(kinds: tuple[str, ...]) -> str:
        parts = []
        for t in [t for t in special if t.kind in kinds]:
            failed = [name for name, ok in t.checks.items() if not ok]
            if not t.evidence:
                failed.append("no evidence that the fault landed")
            state = "pass" if t.ok else "**fail** (" + ", ".join(failed or [t.error or "not finished"]) + ")"
            parts.append(f"{t.kind} (row {t.index}): {state}")
        return "; ".join(parts)

    def met(yes: bool) -> str:
        return "**met**" if yes else "**not met**"

    lines = []
    if trials:
        ok = sum(t.ok for t in trials)
        short = f"; {len(trials)} trials ran, not {RANDOM_TARGET}" if len(trials) < RANDOM_TARGET else ""
        lines.append(
            f"- {RANDOM_TARGET} random trials, every one bit-exact with evidence that its fault landed: "
            f"{met(len(trials) >= RANDOM_TARGET and ok == len(trials))}: {ok} of {len(trials)} passed "
            f"({sum(t.bit_exact for t in trials)} bit-exact, {sum(bool(t.evidence) for t in trials)} with "
            f"evidence){short}."
        )
    kill = [t for t in special if t.kind.startswith("kill_save")]
    if kill:
        fell_back = sum(t.ok and t.checks.get(FELL_BACK, False) for t in kill)
        lines.append(
            f"- ≥ {KILL_SAVE_TARGET} SIGKILL-during-save trials fall back: "
            f"{met(len(kill) >= KILL_SAVE_TARGET and fell_back == len(kill))}: {fell_back} of {len(kill)}."
        )
    disk = [t for t in special if t.kind == "disk_full"]
    if disk:
        lost = sum(not t.checks.get("previous checkpoint intact", False) for t in disk)
        lines.append(f"- Disk full, 0 checkpoints lost: **{lost} lost** in {len(disk)} trial(s); "
                     f"{verdict(('disk_full',))}.")  # fmt: skip
    for label, kinds in (("Requeue cap", ("time_limit_cap", "time_limit_cap_budget")), ("Hang", ("hang",))):
        if any(t.kind in kinds for t in special):
            lines.append(f"- {label}: {verdict(kinds)}.")
    return "\n### Against the issue's targets\n\n" + "\n".join(lines) + "\n" if lines else ""


LEDGER_SECTION = "chaos-ledger"


def ledger_targets(trials: list) -> str:
    """The ledger section's own target: every trial ends with `relaytrain verify` exiting 0 and a ledger
    within 1 % of sacct's elapsed time (the older sections' trial counts are not its targets)."""
    measured = [t for t in trials if t.verify_exit is not None]
    held = sum(bool(time_adds_up(t)) for t in measured)
    met = "**met**" if measured and held == len(trials) else "**not met**"
    return (
        "\n### Against the issue's targets\n\n"
        "- Every chaos run ends with `relaytrain verify RUN` exiting 0 (its ledger at most 1 % unaccounted "
        "or inferred by rule with no other source to confirm it) and a time ledger within 1 % of sacct's "
        f"elapsed time: {met}: {held} of {len(trials)} trials.\n"
    )


def render_section(paths: list[str], section: str) -> str:
    """The section `section` from kept results files, in run order: what `--page-from` writes. One run's
    targeted trials keep their order and numbers; several runs' are merged (merge_special)."""
    runs = [load_run(p) for p in paths]
    trials = [t for r in runs for t in r.trials]
    special = [t for r in runs for t in r.special]
    several = len(runs) > 1
    merged = merge_special(special) if several else MergedSpecial(special, [], 0)
    notes = "".join(f"\n{note}\n" for r in runs for note in r.notes)
    if stopped := [r for r in runs if r.not_run]:
        said = "; ".join(
            f"seed {r.seed}: {len(r.not_run)} ({', '.join(sorted(set(r.not_run)))})" for r in stopped
        )
        notes += (
            f"\nTargeted trials never started (the benchmark was stopped before them), not counted: {said}.\n"
        )
    texts = dict.fromkeys(r.transcribed for r in runs if r.transcribed)
    transcribed = "".join(
        f"\n{', '.join(f'`{r.path}`' for r in runs if r.transcribed == text)}: {text}\n" for text in texts
    )
    files = " ".join(r.path for r in runs)
    return (
        preamble(runs, section)
        + render(trials)
        + render_special(merged.trials, merged if several else None)
        + (
            ledger_targets(trials + merged.trials)
            if section == LEDGER_SECTION
            else summary(trials, merged.trials)
        )
        + notes
        + transcribed
        + f"\nResults: {', '.join(f'`{r.path}`' for r in runs)}. Rewritten from the kept results by "
        f"`{COMMAND} --page-from {files} --section {section}`.\n"
    )
