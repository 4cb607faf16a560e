"""The straggler rule's test on the benchmarks page: the runs kept as its test (`bench.stragglers --test`),
judged by the shipped rule alone (bench/straggler_rules.py judges them and writes the section)."""

from __future__ import annotations

from typing import Any

from bench.bounds import rate
from bench.straggler_noise import forward_noise, spread
from bench.straggler_records import niceness

NAMED_WITHIN = 50  # issue target: a rank >= 20 % slower named within this many steps of its slowdown
SOURCE = "source"  # a loaded trial's key: the kept file it came from
SHAPE = "shape"  # and that run's model shape, the machine's load, niceness and the ranks' noise
STILL_OPEN = (
    "Still open: two fresh runs that play no part in any choice, with another model shape and step time "
    "(e.g. a 3x longer forward, and a phase-heavy data step), as the rule's test."
)
QUIET, BUSY = "without busy processes", "beside busy processes"


def conditions(data: dict[str, Any]) -> str:
    """A kept run's model shape, the machine's load over it, the niceness its processes ran at and the
    ranks' noise: what the rule's counts on it hold under."""
    parts = [f"dim {data.get('dim', 128)}", f"seq {data.get('seq_len', 64)}", _load(data), niceness(data)]
    return ", ".join([p for p in parts if p] + [forward_noise(data)])


def _load(data: dict[str, Any]) -> str:
    """The machine's 1-minute load average over a run, as it recorded it (at its start and end)."""
    if "load_start" in data:
        start, end = data["load_start"][0], data["load_end"][0]
        return f"1-minute load average {start:.2f} at the start, {end:.2f} at the end"
    return f"load average {data.get('load', '?')} at the end"


def _kind(trial: dict[str, Any]) -> str:
    return QUIET if not trial["hog"] else BUSY


def _counts(tests: list[dict[str, Any]], o) -> dict[str, list[int]]:
    """The shipped rule's counts on `tests` (`o`: its Outcome): {"slowed": [named within NAMED_WITHIN, of],
    "slowed_false": [slowed trials with a false report, of], QUIET and BUSY: [clean trials with a report,
    of], "false": [trials with a false report, of]}."""
    slowed = [t for t in tests if t.get("throttled_at") is not None]
    within = sum(1 for s in o.steps if s is not None and s <= NAMED_WITHIN)
    out = {"slowed": [within, len(slowed)], QUIET: [0, 0], BUSY: [0, 0], "false": [len(o.false), o.trials]}
    out["slowed_false"] = [sum(t["name"] in o.false for t in slowed), len(slowed)]
    for t in tests:
        if t.get("throttled_at") is None:
            out[_kind(t)][0] += t["name"] in o.false
            out[_kind(t)][1] += 1
    return out


def _run_line(run: str, tests: list[dict[str, Any]], judge) -> str:
    """One test run: its conditions, then the shipped rule's counts on it."""
    mine = [t for t in tests if t[SOURCE] == run]
    c = _counts(mine, judge(mine))
    clean = "; ".join(f"clean {k} {c[k][0]} of {c[k][1]} with a report" for k in (QUIET, BUSY) if c[k][1])
    return (f"{run} ({mine[0][SHAPE]}): slowed {c['slowed'][0]} of {c['slowed'][1]} named within "
            f"{NAMED_WITHIN} steps ({c['slowed_false'][0]} with a false report); {clean}")  # fmt: skip


def too_soon(tests: list[dict[str, Any]], o, rule, every: int) -> str:
    """The slowed trials named sooner after their throttle than the rule can see a slowdown (``needed``
    whole windows after it): windows from before the throttle counted towards the naming, so the rank
    was over the threshold before anything slowed it."""
    slowed = [t for t in tests if t.get("throttled_at") is not None]
    soon = [f"{t['name']} ({s} steps)" for t, s in zip(slowed, o.steps, strict=True)
            if s is not None and s < rule.needed * every]  # fmt: skip
    if not soon:
        return ""
    return (
        f" Named sooner than {rule.needed} windows of {every} steps after the throttle, so with windows "
        f"from before it over the threshold: {len(soon)} of {len(slowed)} slowed trials ({', '.join(soon)})."
    )


def tested(tests: list[dict[str, Any]], rule, judge, every: int) -> str:
    """The shipped rule on the runs kept as its test (`bench.stragglers --test`): runs that played no part
    in any choice, judged by the rule as shipped (`judge`: trials -> Outcome), run by run with the
    conditions each ran under, then pooled with 95 % bounds, the clean trials apart by whether busy
    processes ran beside them; each failure named with what it was."""
    if not tests:
        return STILL_OPEN
    o = judge(tests)
    runs = sorted({t[SOURCE] for t in tests})
    c = _counts(tests, o)
    late = [f"{t['name']} ({'never' if s is None else f'{s} steps'})"
            for t, s in zip([t for t in tests if t.get("throttled_at") is not None], o.steps, strict=True)
            if s is None or s > NAMED_WITHIN]  # fmt: skip
    clean = "; ".join(f"{k} {rate(*c[k], 'upper')}" for k in (QUIET, BUSY) if c[k][1])
    text = (
        f"The rule's test: {len(runs)} run(s) kept as a test of the shipped rule and seen by no choice (the "
        f"runs above: dim 128, seq 64), judged by the shipped rule ({rule.label}), run by run: "
        + "; ".join(_run_line(run, tests, judge) for run in runs)
        + f". Over all {len(runs)}: {rate(*c['slowed'], 'lower')} slowed trials named within {NAMED_WITHIN} "
        f"steps; clean trials with a report: {clean}; trials with a false report "
        f"{rate(*c['false'], 'upper')}.{too_soon(tests, o, rule, every)}"
    )
    wrong = ", ".join([*late, *(f"{n} (false report)" for n in o.false)])
    if not wrong:
        return text + " On these runs the rule holds."
    noise = spread({"trials": tests, "settings": {"min_phase_s": rule.min_phase_s}})
    return (
        f"{text} On these runs the rule fails: {wrong}. Against the threshold of {100 * rule.threshold:.0f} "
        f"%: {noise}"
    )
