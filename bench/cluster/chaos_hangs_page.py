"""The "hangs" section of docs/benchmarks.md, from kept results files (bench/results/hangs-seed*.json) and
nothing else, so that `python -m bench.chaos --page-from FILES --section hangs` rewrites it byte for byte:
the trials' table (bench/cluster/chaos_hangs.py runs them, chaos_hangs_judge.py judges them) and the verdict
against issue 37's targets for the kinds that ran."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from bench import kept
from bench.cluster import chaos_hangs_judge
from bench.cluster.chaos_hangs_judge import DETECTION_TARGET_S, HANG_KINDS, HangTrial
from bench.cluster.chaos_run import EVAL_EVERY, INTERVAL, STEPS
from bench.report import REPO, table

SECTION = "hangs"
COMMAND = "python -m bench.chaos"
JUDGE_SOURCE = Path(chaos_hangs_judge.__file__).resolve().relative_to(REPO.resolve()).as_posix()
CLEAN_TARGET = 20  # clean runs without a false detection


@dataclass
class KeptHangs:
    """One invocation's kept results (chaos_page.results_data's fields) and its hang trials."""

    path: str
    command: str
    date: str
    seed: str
    cpu: str
    cores: int | str
    load: str
    trials: list[HangTrial]
    notes: list[str]  # what a run's trials do not say of themselves (a defect found after the run)


def load_hangs(path: str) -> KeptHangs:
    """A kept results file of `--hangs`; each trial carries the file's seed."""
    data = kept.load(path)
    seed = str(data.get("seed", ""))
    try:
        trials = [HangTrial(**{**row, "seed": row.get("seed") or seed}) for row in data.get("trials", [])]
    except TypeError as err:
        raise ValueError(f"{kept.relative(path)} holds no hang trials ({err})") from None
    return KeptHangs(kept.relative(path), data.get("command", ""), data.get("date", ""), seed,
                     data.get("cpu", "?"), data.get("cores", "?"), data.get("load", ""), trials,
                     list(data.get("notes", [])))  # fmt: skip


def _s(value: float | None) -> str:
    return "–" if value is None else f"{value:g}"


def _yes(value: bool) -> str:
    return "yes" if value else "**no**"


def rows_table(trials: list[HangTrial]) -> str:
    rows = [
        (t.index, f"{t.kind} ({t.variant})" if t.variant else t.kind,
         "–" if t.rank < 0 else f"{t.rank} on {t.node or '?'}", t.detail or "–",
         "; ".join(t.evidence) or "**none recorded**", _s(t.detection_s), t.detections,
         _yes(t.culprit_correct) if t.kind in HANG_KINDS else "–", _s(t.restart_s), t.step_restarts,
         t.steps_replayed, _yes(t.bit_exact), "; ".join(t.slow_lines) or "–",
         "; ".join(f"{name}: {_yes(ok)}" for name, ok in t.checks.items()) or "–", t.final_status,
         t.seconds, kept.in_repository(t.error or ""))
        for t in trials
    ]  # fmt: skip
    header = ["#", "kind", "rank on node", "what happened", "evidence that the fault landed",
              "fault → `hang detected:` s", "`hang detected:` lines", "culprit named",
              "fault → first step again s", "restarts in place", "steps replayed", "bit-exact",
              "`straggler hint:` line (`slow rank:` before issue 53)", "checks", "final status", "s",
              "error"]  # fmt: skip
    return table(header, rows)


def targets(trials: list[HangTrial]) -> str:
    """Issue 37's targets, each scored on the trials that ran against it."""

    def met(yes: bool) -> str:
        return "**met**" if yes else "**not met**"

    lines = []
    hangs = [t for t in trials if t.kind in HANG_KINDS]
    if hangs:
        times = [t.detection_s for t in hangs if t.detection_s is not None]
        within = sum(t.detection_s is not None and t.detection_s <= DETECTION_TARGET_S for t in hangs)
        spread = f" (median {statistics.median(times):g} s, max {max(times):g} s)" if times else ""
        lines.append(f"- Detection ≤ {DETECTION_TARGET_S:g} s after the fault: {met(within == len(hangs))}: "
                     f"{within} of {len(hangs)} hang trials{spread}.")  # fmt: skip
        named = sum(t.culprit_correct for t in hangs)
        lines.append(f"- Culprit rank and node named in every hang trial: {met(named == len(hangs))}: "
                     f"{named} of {len(hangs)}.")  # fmt: skip
        after = [t.restart_s - t.detection_s for t in hangs if None not in (t.restart_s, t.detection_s)]
        if after:
            lines.append(
                "- Fault → first step again ≤ detection + start-up + restore + 5 s: from the detection to "
                f"the first step again took median {statistics.median(after):.1f} s, max {max(after):.1f} s "
                "(start-up and restore are inside it, not measured apart)."
            )
    slow = [t for t in trials if t.kind == "slow_rank"]
    if slow:
        ok = sum(t.ok for t in slow)  # its checks: the slow line, no restart, no hang detected
        lines.append(
            f"- A 5x slower rank reported as slow, no restart: {met(ok == len(slow))}: {ok} of {len(slow)}."
        )
    every_clean = [t for t in trials if t.kind == "clean"]
    clean = [t for t in every_clean if t.job]  # a stopped run's trials that never started have no job
    if clean:
        false = sum(t.detections for t in clean)
        short = f"; {len(clean)} clean runs, not {CLEAN_TARGET}" if len(clean) < CLEAN_TARGET else ""
        unrun = len(every_clean) - len(clean)
        short += f"; {unrun} more never started (stopped runs, named below)" if unrun else ""
        enough = len(clean) >= CLEAN_TARGET and all(t.evidence for t in clean)
        lines.append(f"- 0 false detections in ≥ {CLEAN_TARGET} clean runs: {met(enough and false == 0)}: "
                     f"{false} `hang detected:` line(s) in {len(clean)} clean runs{short}.")  # fmt: skip
        nearest: dict[str, list[float]] = {}  # per phase, the worst clean run's
        for t in clean:
            for phase, (idle, limit) in t.nearest.items():
                if phase not in nearest or idle / limit > nearest[phase][0] / nearest[phase][1]:
                    nearest[phase] = [idle, limit]
        if nearest:
            worst = "; ".join(
                f"{p} {i:g} s of {x:g} s ({i / x:.0%})" for p, (i, x) in sorted(nearest.items())
            )
            measured = sum(bool(t.nearest) for t in clean)
            lines.append(f"- The pause nearest its limit in the clean runs, per phase that set the job's "
                         f"limit (the worst of {measured} runs that report it): {worst}.")  # fmt: skip
    exact = sum(t.bit_exact for t in trials)
    lines.append(f"- Losses bit-identical to the uninterrupted run: {met(exact == len(trials))}: "
                 f"{exact} of {len(trials)} trials.")  # fmt: skip
    return "\n### Against the issue's targets\n\n" + "\n".join(lines) + "\n"


def render_hangs_section(paths: list[str]) -> str:
    """The section from kept results files, in run order (what `--page-from ... --section hangs` writes)."""
    runs = [load_hangs(p) for p in paths]
    trials = [t for r in runs for t in r.trials]
    commands = "; ".join(f"`{r.command}`" for r in runs)
    loads = "; ".join(f"seed {r.seed}: {r.load or 'not recorded'}" for r in runs)
    ok = sum(t.ok for t in trials)
    first = runs[0]
    return (
        "## Hangs: detected, named and restarted on real Slurm\n\n"
        f"Date {', '.join(dict.fromkeys(r.date for r in runs))}, machine: {first.cpu} ({first.cores} cores), "
        f"local Slurm cluster (`relaytrain cluster up`), 2 nodes × 1 task. Command(s): {commands}. Load "
        f"average (1/5/15 min) at the start → end: {loads}.\n"
        f"A run of the debug config's model and batch per trial ({STEPS} steps, checkpoints every "
        f"{INTERVAL}, evaluations every {EVAL_EVERY}, snapshots every 2 steps, "
        "`resilience.hang_timeout_s=600` so that the hang monitor with its default floor and multiple "
        "acts), compared with one uninterrupted reference run of the same config. Clean runs, by variant "
        "(bench/cluster/chaos_hangs_clean.py): debug; wide (about 1.2 GB of model and AdamW state, 6 steps, "
        "checkpoints every 2, evaluations every 3, no in-memory snapshots: they do not fit a local node's "
        "memory); long (the debug run, 8 steps, every layer's forward delayed 2.5 s: about 21 s a step); "
        "compile (`parallel.compile=true`); compile_cold (the same, Inductor's caches off and an empty "
        "cache folder per job: every graph compiled from scratch); restart (one rank "
        "SIGKILLed, the step restarted in place); checkpoint.mode async and sync in turn, a CPU-bound "
        "process beside each. A trial whose job ran with a time limit other than the profile's 10 minutes "
        'says so in its "what happened" column (`--slurm.time=00:30:00`: with 10 minutes a job trains '
        "about 300 s before its time budget stops it, and seed 5305's wide trials were requeued so after "
        "their restarts in place). "
        "Fault time: the benchmark's SIGSTOP, or the time on the fault's landed line; detection time: "
        "`detected_at` of hang/last.json, else the job log's stamp on the `hang detected:` line. A trial "
        f"counts only with evidence that its fault landed. How each figure is read: `{JUDGE_SOURCE}`.\n\n"
        f"**{ok} of {len(trials)} trials passed.**\n\n"
        + rows_table(trials)
        + targets(trials)
        + "".join(f"\n{note}\n" for r in runs for note in r.notes)
        + f"\nResults: {', '.join(f'`{r.path}`' for r in runs)}. Rewritten from the kept results by "
        f"`{COMMAND} --page-from {' '.join(r.path for r in runs)} --section {SECTION}`.\n"
    )
