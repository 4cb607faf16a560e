"""The straggler rule's test on the benchmarks page: the runs kept as its test (`bench.stragglers --test`),
judged by the shipped rule alone (bench/straggler_rules.py judges them and writes the section)."""

from __future__ import annotations

from typing import Any

from bench.bounds import rate
from bench.straggler_noise import spread

NAMED_WITHIN = 50  # issue target: a rank >= 20 % slower named within this many steps of its slowdown
SOURCE = "source"  # a loaded trial's key: the kept file it came from
SHAPE = "shape"  # and that run's model shape and the machine's load average
STILL_OPEN = (
    "Still open: two fresh runs that play no part in any choice, with another model shape and step time "
    "(e.g. a 3x longer forward, and a phase-heavy data step), as the rule's test."
)


def tested(tests: list[dict[str, Any]], rule, o) -> str:
    """The shipped rule on the runs kept as its test (`bench.stragglers --test`): runs that played no part
    in any choice, judged by the rule as shipped, with 95 % bounds; each failure named with what it was."""
    if not tests:
        return STILL_OPEN
    runs = sorted({t[SOURCE] for t in tests})
    clean = o.trials - len(o.steps)
    late = [f"{t['name']} ({'never' if s is None else f'{s} steps'})"
            for t, s in zip([t for t in tests if t.get("throttled_at") is not None], o.steps, strict=True)
            if s is None or s > NAMED_WITHIN]  # fmt: skip
    busy = {}
    for t in tests:
        if t.get("throttled_at") is None:
            kind = "without busy processes" if not t["hog"] else f"beside {int(t['hog'])} busy process(es)"
            busy.setdefault(kind, []).append(t["name"] in o.false)
    kinds = "; ".join(f"{sum(v)} of {len(v)} {k}" for k, v in busy.items())
    verdict = "holds" if not o.false and o.within == len(o.steps) else "fails"
    shapes = "; ".join(f"{run}: {next(t[SHAPE] for t in tests if t[SOURCE] == run)}" for run in runs)
    text = (
        f"The rule's test: {len(runs)} run(s) kept as a test of the shipped rule and seen by no choice "
        f"({shapes}; the runs above: dim 128, seq 64), judged by the shipped rule ({rule.label}): "
        f"{rate(o.within, len(o.steps), 'lower')} slowed trials named within {NAMED_WITHIN} steps; clean "
        f"trials with a report {rate(o.clean_false, clean, 'upper')} ({kinds}); trials with a false report "
        f"{rate(len(o.false), o.trials, 'upper')}. On these runs the rule {verdict}"
    )
    if verdict == "holds":
        return text + "."
    wrong = ", ".join([*late, *(f"{n} (false report)" for n in o.false)])
    again = STILL_OPEN.replace("Still open: two fresh runs", "A new rule needs fresh runs")
    noise = spread({"trials": tests, "settings": {"min_phase_s": rule.min_phase_s}})
    return f"{text}: {wrong}. Against the threshold of {100 * rule.threshold:.0f} %: {noise} {again}"
