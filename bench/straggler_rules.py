"""Straggler rules replayed over the straggler trials' kept windows: which rule names a slowed rank
soonest with no false report.

    python -m bench.straggler_rules                 # every kept bench/results/stragglers-*.json
    python -m bench.straggler_rules --results bench/results/stragglers-2026-11-28-0530.json --page

Every trial of `python -m bench.stragglers` keeps its run's `rank_times` records: each window's median and
fastest seconds per rank and phase, the judge's whole input. This module feeds them, window by window, to
`StragglerJudge` with other settings (the threshold; K, the windows weighed; how many of them must be
over) and counts what each rule would have said: the slowed trials named within `NAMED_WITHIN` steps of
their throttle (the right rank), and the false reports (a clean trial with a report, a slowed trial's
report before its throttle, or a report of its other rank). The window length (`straggler_every`) is the
runs' own and is not replayed. Replayed with the settings the runs had, the rule must give the runs' own
verdicts (`agrees`): the replay is checked against what was measured before it is trusted.
`--page` writes the "straggler-rules" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

from relaytrain.config.schema import ResilienceConfig
from relaytrain.resilience.rank.straggler import MIN_HOST_PHASE_S, MIN_PHASE_S, StragglerJudge
from relaytrain.resilience.rank.straggler_watch import judged_times

from bench import kept
from bench.bounds import rate
from bench.report import table, write_page
from bench.straggler_noise import TEST, forward_noise
from bench.straggler_records import matrix_from_record, phase_timed, stages_from_record
from bench.straggler_rule_test import NAMED_WITHIN, SHAPE, SOURCE, conditions, tested

SECTION = "straggler-rules"
THRESHOLDS = (0.10, 0.15, 0.20)
WINDOWS = range(3, 9)
FLOORS = (0.005, 0.010, MIN_HOST_PHASE_S)  # the shortest phase compared: part of the rule, chosen with it
TYPICAL = (True, False)  # the typical (median) step must agree, or the fastest times alone decide
SHOWN = 8  # rules listed besides the shipped one
RULE = "rule"  # a loaded trial's key: the rule its run judged by (run_rule)
TESTS = "test"  # and whether that run is a test of the shipped rule (bench.stragglers --test)


@dataclass(frozen=True, order=True)
class Rule:
    """A judge's settings; ``min_phase_s``: the shortest phase compared (the trials ran on CPU: the host's
    floor, as the watch ships it there); ``typical``: whether the typical (median) step must agree."""

    threshold: float
    windows: int
    needed: int
    min_phase_s: float = MIN_HOST_PHASE_S
    typical: bool = True

    def judge(self, peers: list[int] | None = None) -> StragglerJudge:
        return StragglerJudge(
            self.threshold, self.windows, self.needed, self.min_phase_s, peers, self.typical
        )

    @property
    def label(self) -> str:
        text = f"{100 * self.threshold:.0f} % in {self.needed} of {self.windows} windows"
        if self.min_phase_s != MIN_HOST_PHASE_S:
            text += f", phases from {_ms(self.min_phase_s)}"
        return text if self.typical else f"{text}, fastest times only"


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:g} ms"


def shipped_rule() -> Rule:
    r = ResilienceConfig()
    return Rule(r.straggler_threshold, r.straggler_windows, r.straggler_windows_over)


def needed_of(settings: dict[str, Any]) -> int:
    """How many of its K windows a kept run's rule needed over the threshold; results kept before `needed`
    was recorded were judged by all but one of them (all for K <= 2), the judge's rule then."""
    windows = int(settings["windows"])
    return int(settings.get("needed", windows - 1 if windows > 2 else windows))


def run_rule(settings: dict[str, Any]) -> Rule:
    """The rule a kept run judged by (its `settings`, `needed_of`); those kept before `min_phase_s` was
    recorded compared every phase from ``MIN_PHASE_S`` on."""
    windows, needed = int(settings["windows"]), needed_of(settings)
    return Rule(
        float(settings["threshold"]), windows, needed, float(settings.get("min_phase_s", MIN_PHASE_S))
    )


def all_rules() -> list[Rule]:
    return [
        Rule(t, k, n, floor, typical)
        for t in THRESHOLDS
        for k in WINDOWS
        for n in range(k // 2 + 1, k + 1)
        for floor in FLOORS
        for typical in TYPICAL
    ]


def judge_input(window: dict[str, Any], ranks: int) -> tuple[list[list[float]], list[list[float]]] | None:
    """(fastest, median) seconds per rank and phase of one kept window, as the run's judge was fed them;
    None for a window the run did not judge (a rank with no whole step in it)."""
    try:
        matrix = matrix_from_record(window, ranks)
    except KeyError as err:
        raise ValueError(f"a window at step {window.get('step')} records no {err.args[0]} (results kept "
                         "before the fastest times were recorded cannot be replayed)") from None  # fmt: skip
    return judged_times(matrix)


def replay(rule: Rule, windows: list[dict[str, Any]], every: int, ranks: int = 2) -> list[tuple[int, int]]:
    """(the step it was named at, the rank) for each straggler the rule names over a run's windows."""
    judge, named = rule.judge(stages_from_record(windows[0]) if windows else None), []
    for window in windows:
        fed = judge_input(window, ranks)
        if fed is None:
            continue
        straggler, _ = judge.feed(int(window["step"]) - every + 1, *fed)
        if straggler is not None:
            named.append((int(window["step"]), straggler.rank))
    return named


@dataclass
class Outcome:
    rule: Rule
    steps: list[int | None] = field(default_factory=list)  # per slowed trial: steps to its naming
    false: list[str] = field(default_factory=list)  # the trials with a false report
    trials: int = 0  # judged: slowed and clean
    clean_false: int = 0  # the clean trials among `false`

    @property
    def within(self) -> int:
        return sum(1 for s in self.steps if s is not None and s <= NAMED_WITHIN)

    def key(self) -> tuple:
        late = [s if s is not None else 10**6 for s in self.steps]
        return (len(self.false), -self.within, statistics.median(late) if late else 0, self.rule)


def judge_trials(rule: Rule, trials: list[dict[str, Any]], every: int) -> Outcome:
    out = Outcome(rule, trials=len(trials))
    for trial in trials:
        named = replay(rule, trial["windows"], every)
        at = trial.get("throttled_at")
        if at is None:
            if named:
                out.false.append(trial["name"])
                out.clean_false += 1
            continue
        if any(step <= at or rank != trial["rank"] for step, rank in named):
            out.false.append(trial["name"])
        right = [step - at for step, rank in named if step > at and rank == trial["rank"]]
        out.steps.append(right[0] if right else None)
    return out


def agrees(trials: list[dict[str, Any]], every: int) -> tuple[int, list[str]]:
    """How many trials the replay of the rule their run judged by (`RULE`) gives the run's own first
    verdict (step and rank), and the names of those where it does not."""
    wrong = []
    for trial in trials:
        named = replay(trial[RULE], trial["windows"], every)
        measured = [(int(n["step"]), int(n["rank"])) for n in trial["named"]]
        if named[:1] != measured[:1]:
            restarted = any(int(n.get("restart") or 0) > 0 for n in trial["named"])
            # a job requeued mid-trial: its judge began again there; the replay weighs every window
            wrong.append(
                trial["name"]
                + (
                    " (its job restarted mid-run: the run's judge began again there, "
                    "the replay weighs the windows before it too)"
                    if restarted
                    else ""
                )
            )
    return len(trials) - len(wrong), wrong


def load_trials(paths: list[str]) -> tuple[list[dict[str, Any]], int, list[str]]:
    """(the replayable trials of every kept file, their window length, the files' commands)."""
    trials, every, commands = [], set(), []
    for path in paths:
        data = kept.load(path)
        usable = [t for t in data.get("trials", []) if t.get("windows") and not t.get("error")]
        if not usable or "settings" not in data:
            raise ValueError(f"kept results {kept.relative(path)} keep no trial's windows to replay")
        every.add(int(data["settings"]["every"]))
        rule = run_rule(data["settings"])
        test = bool(data.get(TEST))
        shape = conditions(data) if test else ""  # the conditions a test of the shipped rule ran under
        usable = [{**t, RULE: rule, SOURCE: kept.relative(path), TESTS: test, SHAPE: shape} for t in usable]
        trials += usable
        commands.append(f"`{data.get('command', '?')}` ({data.get('date', '?')}, {kept.relative(path)})")
    if len(every) != 1:
        raise ValueError(f"the kept runs judged windows of different lengths ({sorted(every)} steps)")
    return trials, every.pop(), commands


def default_results() -> list[str]:
    return [kept.relative(p) for p in sorted(kept.RESULTS_DIR.glob("stragglers-*.json"))]


# The run that played no part in choosing the shipped rule, and what changed after the others' false
# reports (git history: commits 2c85bfc, 30aedf5, 324fa34).
UNTUNED_RUN = "stragglers-2026-11-28-1828.json"
TUNING = (
    "Not a fresh test: the shipped floor and rule were chosen on these runs. The host's floor was raised "
    "from 1 to 10 ms (commit 2c85bfc) and from 10 to 20 ms (30aedf5) after false reports in runs of this "
    "set, and the rule changed from 5 of 7 to 5 of 8 windows (324fa34) after false reports in runs 1548 and "
    "1622; six of the seven ran one command, and all one model and one step time on one machine on one "
    "day."
)


def render(paths: list[str]) -> str:
    trials, every, commands = load_trials(paths)
    tests = [t for t in trials if t[TESTS]]  # the shipped rule's test: judged by it alone, never chosen on
    timed = [t for t in trials if phase_timed(t["windows"], "forward") and not t[TESTS]]
    runs = sorted({t[SOURCE] for t in timed})
    per_run = {(rule, run): judge_trials(rule, [t for t in timed if t[SOURCE] == run], every)
               for rule in all_rules() for run in runs}  # fmt: skip
    pooled = {rule: _merged(rule, [per_run[rule, run] for run in runs]) for rule in all_rules()}
    outcomes = sorted(pooled.values(), key=Outcome.key)
    rule = shipped_rule()
    shipped = pooled[rule]
    same, differ = agrees(trials, every)
    slowed = len(shipped.steps)

    def row(o: Outcome, note: str = "") -> list[object]:
        steps = ", ".join("never" if s is None else str(s) for s in o.steps)
        return [o.rule.label + note, f"{o.within} of {slowed}", steps, f"{len(o.false)} of {len(timed)}",
                ", ".join(o.false) or "-"]  # fmt: skip

    rows = [row(shipped, " (shipped)")] + [row(o) for o in outcomes[:SHOWN] if o.rule != shipped.rule]
    return "\n".join([
        "## Straggler rules, replayed",
        "",
        f"Rewritten from the kept results by `python -m bench.straggler_rules --page --results "
        f"{' '.join(paths)}`: the straggler "
        f"trials' kept windows (each window's median and fastest phase times per rank, {every} steps each) "
        f"replayed through the straggler judge with {len(all_rules())} rules: thresholds "
        f"{', '.join(f'{100 * t:.0f} %' for t in THRESHOLDS)}; K = {WINDOWS.start}..{WINDOWS.stop - 1} "
        "windows weighed; over the threshold (by the fastest times) in more than half of them up to all "
        f"of them; phases of {', '.join(_ms(f) for f in FLOORS)} or more compared (shipped for CPU runs: "
        f"{_ms(MIN_HOST_PHASE_S)}); with the typical (median) step required to agree, as shipped, or not. "
        "The trials: " + "; ".join(commands) + ".",
        "",
        f"* The replay is faithful: with the settings the runs had it gives {same} of {len(trials)} trials "
        f"the runs' own first verdict (step and rank){': not ' + ', '.join(differ) if differ else ''}.",
        f"* Ranked over the {len(runs)} runs that timed the forward phase (each layer's forward computation, "
        f"as the shipped watch does): {slowed} slowed trials, {len(timed) - slowed} clean ones. A false "
        "report: a clean trial named a straggler, or a slowed trial named one before its throttle or named "
        f"its other rank. Ranked by false reports, then by slowed trials named within {NAMED_WITHIN} steps, "
        "then by the median steps to the line.",
        f"* The shipped rule ({shipped.rule.label}) replayed on each kept run: "
        + "; ".join(_on_run(path, trials, every) for path in paths) + ".",
        f"* {_variants(pooled, slowed, len(timed))}",
        f"* {_best(outcomes, slowed)}",
        f"* {_held_out(per_run, runs, len(timed))}",
        f"* {_untuned(per_run, runs)}",
        f"* {TUNING} {tested(tests, rule, lambda trials: judge_trials(rule, trials, every), every)}",
        "",
        table(["rule", f"named within {NAMED_WITHIN} steps", "steps from throttle to the line",
               "trials with a false report", "false reports in"], rows),  # fmt: skip
    ])  # fmt: skip


def _on_run(path: str, trials: list[dict[str, Any]], every: int) -> str:
    """The shipped rule on one kept run; a run that did not time the forward phase is named as left out of
    the ranking, with why."""
    mine = [t for t in trials if t[SOURCE] == kept.relative(path)]
    o = judge_trials(shipped_rule(), mine, every)
    noise = forward_noise({"trials": mine, "settings": {"min_phase_s": mine[0][RULE].min_phase_s}})
    text = (f"{path} (judged by {mine[0][RULE].label}; {noise}): {o.within} of {len(o.steps)} named within "
            f"{NAMED_WITHIN} steps, {len(o.false)} of {len(mine)} with a false report")  # fmt: skip
    if mine[0][TESTS]:
        text += " (a test of the shipped rule: kept out of every choice and of the ranking)"
    elif not phase_timed(mine[0]["windows"], "forward"):
        text += (" (superseded code that did not time the forward phase, which the shipped rule watches: "
                 "left out of the ranking)")  # fmt: skip
    return text


def _variants(pooled: dict[Rule, Outcome], slowed: int, trials: int) -> str:
    """The shipped rule with each other floor, and without the typical step's condition."""
    base = shipped_rule()
    variants = [Rule(base.threshold, base.windows, base.needed, f) for f in FLOORS if f != base.min_phase_s]
    variants.append(Rule(base.threshold, base.windows, base.needed, base.min_phase_s, typical=False))
    counts = [f"{v.label}: {pooled[v].within} of {slowed} named, {len(pooled[v].false)} of {trials} trials "
              "with a false report" for v in variants]  # fmt: skip
    return "The shipped rule changed in one setting: " + "; ".join(counts) + "."


def _best(outcomes: list[Outcome], slowed: int) -> str:
    """What the best rules without a false report reach (`outcomes` ranked by Outcome.key)."""
    clean = [o for o in outcomes if not o.false]
    if not clean:
        return "Every rule replayed made a false report."
    best = clean[0].within
    reaching = sum(o.within == best for o in clean)
    if best == slowed:
        rules = "1 rule names" if reaching == 1 else f"{reaching} rules name"
        return f"{rules} every slowed trial within {NAMED_WITHIN} steps without a false report."
    return (f"No rule replayed names every slowed trial within {NAMED_WITHIN} steps without a false report: "
            f"the best name {best} of {slowed} ({reaching} rule{'s' * (reaching != 1)}).")  # fmt: skip


def _held_out(per_run: dict[tuple[Rule, str], Outcome], runs: list[str], trials: int) -> str:
    """How far choosing a rule this way holds on runs it was not chosen on: the best rule of the other
    runs (threshold, windows, floor and the typical step's condition, all chosen without the run, ranked as
    the table is) judges each run in turn; the counts with their 95 % bounds."""
    if len(runs) < 2:
        return "Under two kept runs timed the forward phase: no rule is judged on a run it was not chosen by."
    rules = sorted({rule for rule, _ in per_run})
    named = slowed = false = clean = clean_false = 0
    chosen = []
    for held in runs:
        others = [_merged(rule, [per_run[rule, run] for run in runs if run != held]) for rule in rules]
        best = min(others, key=Outcome.key).rule
        judged = per_run[best, held]
        named, slowed, false = named + judged.within, slowed + len(judged.steps), false + len(judged.false)
        clean, clean_false = clean + judged.trials - len(judged.steps), clean_false + judged.clean_false
        chosen.append(f"{best.label} without {held}" + (f" ({', '.join(judged.false)} falsely named)"
                                                        if judged.false else ""))  # fmt: skip
    return (f"Chosen without the run it judges (over the {len(runs)} runs that timed the forward phase, the "
            "best rule of the other runs, its threshold, windows, floor and typical-step condition all "
            "chosen without the run, ranked as the table is, judges each run in turn): "
            f"{rate(named, slowed, 'lower')} slowed trials named within {NAMED_WITHIN} steps; trials with a "
            f"false report {rate(false, trials, 'upper')}, clean trials with a report "
            f"{rate(clean_false, clean, 'upper')}. The rules chosen: {'; '.join(chosen)}.")  # fmt: skip


def _untuned(per_run: dict[tuple[Rule, str], Outcome], runs: list[str]) -> str:
    """The one run that no choice of the shipped rule saw, judged by it, with its bounds."""
    run = next((r for r in runs if r.endswith(UNTUNED_RUN)), None)
    if run is None:
        return f"The run untouched by tuning ({UNTUNED_RUN}) is not among the runs replayed."
    o = per_run[shipped_rule(), run]
    clean = o.trials - len(o.steps)
    return (f"The only run untouched by tuning ({run}), judged by the shipped rule: "
            f"{rate(o.within, len(o.steps), 'lower')} slowed trials named within {NAMED_WITHIN} steps; "
            f"clean trials with a report {rate(o.clean_false, clean, 'upper')}.")  # fmt: skip


def _merged(rule: Rule, outcomes: list[Outcome]) -> Outcome:
    return Outcome(rule, [s for o in outcomes for s in o.steps], [n for o in outcomes for n in o.false],
                   sum(o.trials for o in outcomes), sum(o.clean_false for o in outcomes))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.straggler_rules", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--results", nargs="+", help="kept bench.stragglers results (default: all kept)")
    parser.add_argument("--page", action="store_true", help="write the section of docs/benchmarks.md")
    args = parser.parse_args(argv)
    paths = args.results or default_results()
    if not paths:
        print("error: no kept straggler results (bench/results/stragglers-*.json): run python -m "
              "bench.stragglers first", file=sys.stderr)  # fmt: skip
        return 2
    try:
        text = render([kept.relative(p) for p in paths])
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(text)
    if args.page:
        write_page({SECTION: text}, order=("stragglers", SECTION))
    return 0


if __name__ == "__main__":
    sys.exit(main())
