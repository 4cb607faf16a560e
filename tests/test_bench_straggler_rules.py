"""bench.straggler_rules: the straggler judge replayed over kept windows, and what it counts."""

from __future__ import annotations

import json

import pytest

from relaytrain.resilience.rank.straggler import MIN_HOST_PHASE_S, MIN_PHASE_S, phase_floor

from bench import straggler_rules as rules
from bench.straggler_rules import Rule

EVERY = 5
SETTINGS = {"threshold": 0.15, "every": EVERY, "windows": 6, "needed": 4}


def windows(rank1: list[float], fastest: list[float] | None = None) -> list[dict]:
    """Kept rank_times windows: rank 0's optimizer takes 40 ms (fastest 36 ms); rank 1's median is
    `rank1[i]` times that, its fastest `fastest[i]` times (default: the same)."""
    fastest = fastest or rank1
    out = []
    for i, (typical, quick) in enumerate(zip(rank1, fastest, strict=True)):
        window = {"step": EVERY * (i + 1)}
        for rank, (m, f) in enumerate([(1.0, 1.0), (typical, quick)]):
            window |= {f"rank{rank}_data_s": 0.0005, f"rank{rank}_data_fastest_s": 0.0004}
            window |= {f"rank{rank}_optimizer_s": 0.040 * m, f"rank{rank}_optimizer_fastest_s": 0.036 * f}
            window |= {f"rank{rank}_step_s": 0.1}
        out.append(window)
    return out


def slowed(name: str, after: list[float], named: list[tuple[int, int]] = ()) -> dict:
    """A slowed trial throttled at step 30 (6 windows level, then `after`), with the run's verdicts."""
    return {"name": name, "factor": 1.2, "hog": 0, "rank": 1, "throttled_at": 30, "error": "",
            "windows": windows([1.0] * 6 + after),
            "named": [{"step": s, "rank": r} for s, r in named]}  # fmt: skip


def clean(name: str, rank1: list[float], fastest: list[float] | None = None) -> dict:
    return {"name": name, "factor": 1.0, "hog": 1, "rank": None, "throttled_at": None, "error": "",
            "windows": windows(rank1, fastest), "named": []}  # fmt: skip


def test_the_replay_names_a_slowed_rank_as_the_judge_does():
    # 1.3x from step 35 on: over 15 % in 5 of 6 windows first at the window ending at step 55
    trial = slowed("s", [1.3] * 18)
    assert rules.replay(Rule(0.15, 6, 5), trial["windows"], EVERY) == [(55, 1)]
    assert rules.replay(Rule(0.15, 6, 4), trial["windows"], EVERY) == [(50, 1)]
    assert rules.replay(Rule(0.35, 6, 4), trial["windows"], EVERY) == []


def test_a_window_without_a_whole_step_on_a_rank_is_not_judged():
    trial = slowed("s", [1.3] * 18)
    for window in trial["windows"][6:9]:
        window["rank0_step_s"] = 0.0  # as the run skips it
    assert rules.replay(Rule(0.15, 6, 5), trial["windows"], EVERY) == [(70, 1)]


def test_outcomes_count_detection_steps_and_every_kind_of_false_report():
    trials = [
        slowed("fast", [1.3] * 18),
        slowed("never", [1.05] * 18),
        clean("quiet", [1.0] * 24),
        clean("noisy", [1.0] * 10 + [1.5] * 14),  # a clean run named: a false report
        {**slowed("early", [1.3] * 18), "windows": windows([1.5] * 24)},  # named before its throttle
    ]
    out = rules.judge_trials(Rule(0.15, 6, 5), trials, EVERY)
    assert out.steps == [25, None, None] and out.within == 1
    assert out.false == ["noisy", "early"]
    ranked = sorted([out, rules.judge_trials(Rule(0.15, 6, 4), trials[:3], EVERY)], key=rules.Outcome.key)
    assert rules._best(ranked, 2).startswith("No rule replayed names every slowed trial within 50 steps")
    assert rules._best(ranked, 2).endswith("the best name 1 of 2 (1 rule).")
    # the rank the throttle did not touch named: a false report too
    other = slowed("other", [1.0] * 18)
    for window in other["windows"][6:]:
        window["rank0_optimizer_s"] *= 1.5
        window["rank0_optimizer_fastest_s"] *= 1.5
    assert rules.judge_trials(Rule(0.15, 6, 5), [other], EVERY).false == ["other"]


def test_the_typical_step_must_agree_in_every_rule_that_requires_it_and_the_grid_has_both():
    # rank 1's fastest step is 1.5x slow, its median is level: no rule that needs the typical step names it
    trial = clean("peer-caught-idle-cores", [1.0] * 24, fastest=[1.5] * 24)
    grid = rules.all_rules()
    assert all(not rules.replay(rule, trial["windows"], EVERY) for rule in grid if rule.typical)
    assert rules.replay(Rule(0.15, 6, 5, typical=False), trial["windows"], EVERY) == [(25, 1)]
    assert Rule(0.15, 6, 5, typical=False).label == "15 % in 5 of 6 windows, fastest times only"


def test_the_grid_chooses_the_floor_and_the_typical_step_with_the_rule():
    grid = rules.all_rules()
    assert {r.min_phase_s for r in grid} >= {0.005, 0.010, 0.020} and {r.typical for r in grid} == {
        True,
        False,
    }
    assert rules.shipped_rule() in grid and len(grid) == len(set(grid))


def test_the_replay_is_checked_against_the_runs_own_verdicts():
    shipped = rules.shipped_rule()
    good = slowed("good", [1.3] * 18)
    good["named"] = [{"step": s, "rank": r} for s, r in rules.replay(shipped, good["windows"], EVERY)]
    assert good["named"], "the shipped rule names a 1.3x rank"
    bad = slowed("bad", [1.3] * 18, named=[(115, 1)])
    judged = [{**t, rules.RULE: shipped} for t in (good, bad)]
    assert rules.agrees(judged, EVERY) == (1, ["bad"])
    # a run kept before its rule's `needed` was recorded judged by all but one of K windows, and one kept
    # before its floor was recorded compared phases from the device's floor (1 ms) on
    assert rules.run_rule({"threshold": 0.15, "windows": 6}) == Rule(0.15, 6, 5, MIN_PHASE_S)
    assert rules.run_rule(SETTINGS) == Rule(0.15, 6, 4, MIN_PHASE_S)
    assert rules.run_rule({**SETTINGS, "min_phase_s": MIN_HOST_PHASE_S}) == Rule(0.15, 6, 4)
    assert shipped.min_phase_s == phase_floor("cpu") and Rule(0.15, 6, 4, MIN_PHASE_S).label.endswith(
        ", phases from 1 ms"
    )


def test_the_replay_compares_a_phase_from_the_rules_floor_on():
    """A 1.5x rank whose optimizer phase takes 10 ms: named by a rule comparing phases from 1 ms on (as runs
    kept before the host's floor were judged), not by one from the host's 20 ms on."""
    trial = slowed("s", [1.5] * 18)
    for window in trial["windows"]:
        for key in [k for k in window if "_optimizer_" in k]:
            window[key] /= 4
    assert rules.replay(Rule(0.15, 6, 5, MIN_PHASE_S), trial["windows"], EVERY) == [(55, 1)]
    assert rules.replay(Rule(0.15, 6, 5), trial["windows"], EVERY) == []


def test_results_kept_before_the_fastest_times_were_recorded_are_refused_clearly(tmp_path):
    trial = slowed("s", [1.3] * 18)
    for window in trial["windows"]:
        del window["rank1_optimizer_fastest_s"]
    path = tmp_path / "stragglers-old.json"
    path.write_text(json.dumps({"command": "c", "date": "d", "settings": SETTINGS, "trials": [trial]}))
    with pytest.raises(ValueError, match="records no rank1_optimizer_fastest_s"):
        rules.render([str(path)])
    assert rules.main(["--results", str(path)]) == 2


def test_the_section_lists_the_shipped_rule_the_best_ones_and_the_replays_faithfulness(tmp_path, monkeypatch):
    monkeypatch.setattr(rules, "phase_timed", lambda windows, phase: True)  # ranked as the forward-timed runs
    shipped = rules.shipped_rule()
    trials = [slowed(f"s{i}", [1.3] * 18) for i in range(2)] + [clean("c", [1.0] * 24)]
    for trial in trials:
        trial["named"] = [{"step": s, "rank": r} for s, r in rules.replay(shipped, trial["windows"], EVERY)]
    path = tmp_path / "stragglers-x.json"
    settings = {"threshold": shipped.threshold, "every": EVERY, "windows": shipped.windows,
                "needed": shipped.needed, "min_phase_s": shipped.min_phase_s}  # fmt: skip
    path.write_text(json.dumps({"command": "python -m bench.stragglers", "date": "d",
                                "settings": settings, "trials": trials}))  # fmt: skip
    text = rules.render([str(path)])
    assert text.startswith("## Straggler rules, replayed")
    assert "phases of 5 ms, 10 ms, 20 ms or more compared" in text and "Not a fresh test:" in text
    assert "it gives 3 of 3 trials the runs' own first verdict" in text
    assert f"* The shipped rule ({shipped.label}) replayed on each kept run: " in text
    assert "rules name every slowed trial within 50 steps without a false report." in text
    assert (
        f"(judged by {shipped.label}; forward noise not recorded): 2 of 2 named within 50 steps, 0 of 3 "
        "with a false report" in text
    )
    assert f"| {shipped.label} (shipped) | 2 of 2 |" in text
    assert "| 10 % in 2 of 3 windows | 2 of 2 | 10, 10 | 0 of 3 | - |" in text  # the best first


def test_a_rule_is_judged_on_each_run_by_the_rule_chosen_without_it():
    """Run a's slowed rank is over the threshold in every other window, run b's clean one too: chosen on
    b alone, the strict rule misses a's rank; chosen on a alone, the loose rule (a lower floor: the floor is
    chosen as any other setting) falsely names b's."""
    loose, strict = Rule(0.15, 6, 3, 0.005), Rule(0.15, 6, 6)
    a = {**slowed("sa", [1.4, 1.0] * 9), rules.SOURCE: "a"}
    b = {**clean("cb", [1.4, 1.0] * 12), rules.SOURCE: "b"}
    assert rules.judge_trials(loose, [a, b], EVERY).false == ["cb"]
    assert rules.judge_trials(loose, [a], EVERY).steps == [25]
    assert rules.judge_trials(strict, [a, b], EVERY).steps == [None]
    per_run = {(rule, t[rules.SOURCE]): rules.judge_trials(rule, [t], EVERY) for rule in (loose, strict)
               for t in (a, b)}  # fmt: skip
    text = rules._held_out(per_run, ["a", "b"], 2)
    assert "0 of 1 (95 % lower bound 0 %) slowed trials named within 50 steps" in text
    assert "trials with a false report 1 of 2 (95 % upper bound 97 %)" in text
    assert "clean trials with a report 1 of 1 (95 % upper bound 100 %)" in text
    assert f"{strict.label} without a; {loose.label} without b (cb falsely named)" in text
    assert loose.label.endswith(", phases from 5 ms")
    assert rules._held_out(per_run, ["a"], 1).startswith("Under two kept runs timed the forward phase")


def test_a_run_kept_as_the_shipped_rules_test_is_judged_by_it_alone_and_kept_out_of_every_choice(
    tmp_path, monkeypatch
):
    """A run of `bench.stragglers --test` is not ranked and not in the leave-one-run-out check: its trials
    are judged by the shipped rule, with their bounds, and a failure is named with what it was."""
    monkeypatch.setattr(rules, "phase_timed", lambda windows, phase: True)
    shipped = rules.shipped_rule()
    settings = {"threshold": shipped.threshold, "every": EVERY, "windows": shipped.windows,
                "needed": shipped.needed, "min_phase_s": shipped.min_phase_s}  # fmt: skip

    def keep(name: str, trials: list[dict], test: bool) -> str:
        for trial in trials:
            trial["named"] = [
                {"step": s, "rank": r} for s, r in rules.replay(shipped, trial["windows"], EVERY)
            ]
        path = tmp_path / name
        data = {
            "command": "c",
            "date": "d",
            "settings": settings,
            "trials": trials,
            "dim": 192,
            "seq_len": 128,
        }
        path.write_text(json.dumps(data | ({rules.TEST: True} if test else {})))
        return str(path)

    chosen = keep("chosen.json", [slowed("s0", [1.3] * 18), clean("c0", [1.0] * 24)], False)
    # the test run: one slowed rank named, one never (2 % slower), a clean run over 30 % in every window
    tested = [slowed("t0", [1.3] * 18), slowed("t1", [1.02] * 18), clean("t2", [1.3] * 24)]
    test = keep("test.json", tested, True)
    text = rules.render([chosen, test])
    assert (
        "Ranked over the 1 runs that timed the forward phase (each layer's forward computation, as " in text
    )
    assert ": 1 slowed trials, 1 clean ones." in text  # the test's trials are not ranked
    assert f"| {shipped.label} (shipped) | 1 of 1 |" in text
    assert "(a test of the shipped rule: kept out of every choice and of the ranking)" in text
    assert "The rule's test: 1 run(s) kept as a test of the shipped rule and seen by no choice" in text
    assert "dim 192, seq 128" in text
    # run by run, with the conditions it ran under; the clean trials apart by busy processes beside them
    assert (
        f"{test} (dim 192, seq 128, load average ? at the end, forward noise not recorded): slowed " in text
    )
    assert (
        "slowed 1 of 2 named within 50 steps (0 with a false report); clean beside busy processes 1 of 1"
        in text
    )
    assert "Over all 1: 1 of 2 (95 % lower bound 3 %) slowed trials named within 50 steps" in text
    assert "clean trials with a report: beside busy processes 1 of 1 (95 % upper bound 100 %)" in text
    assert "without busy processes 0 of" not in text  # no such clean trial: no count
    assert (
        "On these runs the rule fails: t1 (never), t2 (false report). Against the threshold of 10 %: " in text
    )
    assert "Still open" not in text
    assert "Still open: two fresh runs" in rules.render([chosen])


def test_a_slowed_rank_named_before_the_rule_could_see_its_slowdown_is_named_as_such():
    """Named 10 steps after its throttle, with 5 windows of 5 steps needed: three windows from before the
    throttle were over the threshold, so the naming is not the throttle's alone, and the page says so."""
    from bench.straggler_rule_test import _failures, too_soon

    rule = rules.shipped_rule()
    early = {**slowed("early", []), "windows": windows([1.0] * 3 + [1.3] * 21)}  # over from step 16 on
    trials = [early, slowed("normal", [1.3] * 18), clean("c", [1.0] * 24)]
    o = rules.judge_trials(rule, trials, EVERY)
    assert o.steps == [10, 25] and o.false == []
    failed, soon = _failures(trials, o, rule, EVERY, lambda name: f"{name} of run")
    assert failed == [] and soon == ["early of run (10 steps)"]
    assert too_soon(soon, 2, rule, EVERY) == (
        " Named sooner than 5 windows of 5 steps after the throttle, so with windows from before it over the "
        "threshold: 1 of 2 slowed trials (early of run (10 steps))."
    )
    assert _failures(trials[1:], rules.judge_trials(rule, trials[1:], EVERY), rule, EVERY, str)[1] == []
    assert too_soon([], 1, rule, EVERY) == ""


def test_the_rules_test_sums_its_runs_counts_though_their_trials_share_names():
    """Two test runs each with a clean trial "c0", reported in one only: 1 of 2 with a report, the failure
    named with its run (a count over the pooled trials by name would say 2 of 2)."""
    from bench.straggler_rule_test import SHAPE, SOURCE, tested

    rule = rules.shipped_rule()
    tests = [{**clean("c0", [1.3] * 24), SOURCE: "bench/results/a.json", SHAPE: "shape a"},
             {**clean("c0", [1.0] * 24), SOURCE: "bench/results/b.json", SHAPE: "shape b"}]  # fmt: skip
    text = tested(tests, rule, lambda trials: rules.judge_trials(rule, trials, EVERY), EVERY)
    assert (
        "bench/results/a.json (shape a): slowed 0 of 0 named within 50 steps (0 with a false report); "
        in text
    )
    assert "clean trials with a report: beside busy processes 1 of 2 (95 % upper bound 97 %);" in text
    assert "On these runs the rule fails: c0 of a (false report)." in text
