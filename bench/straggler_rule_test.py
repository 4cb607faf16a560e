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


def _run_line(run: str, mine: list[dict[str, Any]], c: dict[str, list[int]]) -> str:
    """One test run (its trials `mine`): its conditions, then the shipped rule's counts on it (`c`)."""
    clean = "; ".join(f"clean {k} {c[k][0]} of {c[k][1]} with a report" for k in (QUIET, BUSY) if c[k][1])
    return (f"{run} ({mine[0][SHAPE]}): slowed {c['slowed'][0]} of {c['slowed'][1]} named within "
            f"{NAMED_WITHIN} steps ({c['slowed_false'][0]} with a false report); {clean}")  # fmt: skip


def too_soon(soon: list[str], slowed: int, rule, every: int) -> str:
    """The slowed trials (`soon`, of `slowed`) named sooner after their throttle than the rule can see a
    slowdown (``needed`` whole windows after it): windows from before the throttle counted towards the
    naming, so the rank was over the threshold before anything slowed it."""
    if not soon:
        return ""
    return (
        f" Named sooner than {rule.needed} windows of {every} steps after the throttle, so with windows "
        f"from before it over the threshold: {len(soon)} of {slowed} slowed trials ({', '.join(soon)})."
    )


def _failures(mine: list[dict[str, Any]], o, rule, every: int, tag) -> tuple[list[str], list[str]]:
    """One run's failures (slowed trials named late or never, trials with a false report) and its slowed
    trials named too soon (`too_soon`), each trial's name passed through `tag`."""
    slowed = [t for t in mine if t.get("throttled_at") is not None]
    late = [f"{tag(t['name'])} ({'never' if s is None else f'{s} steps'})"
            for t, s in zip(slowed, o.steps, strict=True) if s is None or s > NAMED_WITHIN]  # fmt: skip
    soon = [f"{tag(t['name'])} ({s} steps)" for t, s in zip(slowed, o.steps, strict=True)
            if s is not None and s < rule.needed * every]  # fmt: skip
    return [*late, *(f"{tag(n)} (false report)" for n in o.false)], soon


def tested(tests: list[dict[str, Any]], rule, judge, every: int) -> str:
    """The shipped rule on the runs kept as its test (`bench.stragglers --test`): runs that played no part
    in any choice, judged by the rule as shipped (`judge`: trials -> Outcome), run by run with the
    conditions each ran under, then summed with 95 % bounds, the clean trials apart by whether busy
    processes ran beside them; each failure named with what it was (and, with several runs, its run)."""
    if not tests:
        return STILL_OPEN
    runs = sorted({t[SOURCE] for t in tests})
    c: dict[str, list[int]] = {}
    wrong, soon, lines = [], [], []
    for run in runs:
        mine = [t for t in tests if t[SOURCE] == run]
        o = judge(mine)
        counts = _counts(mine, o)
        c = {k: [a + b for a, b in zip(c.get(k, [0, 0]), v, strict=True)] for k, v in counts.items()}
        stem = run.rsplit("/", 1)[-1].removesuffix(".json")
        failed, early = _failures(
            mine, o, rule, every, lambda n, s=stem: f"{n} of {s}" if len(runs) > 1 else n
        )
        wrong, soon = wrong + failed, soon + early
        lines.append(_run_line(run, mine, counts))
    clean = "; ".join(f"{k} {rate(*c[k], 'upper')}" for k in (QUIET, BUSY) if c[k][1]) or "no clean trial"
    named = "no slowed trial"
    if c["slowed"][1]:
        named = f"{rate(*c['slowed'], 'lower')} slowed trials named within {NAMED_WITHIN} steps"
    text = (
        f"The rule's test: {len(runs)} run(s) kept as a test of the shipped rule and seen by no choice (the "
        f"runs above: dim 128, seq 64), judged by the shipped rule ({rule.label}), run by run: "
        + "; ".join(lines)
        + f". Over all {len(runs)}: {named}; clean trials with a report: {clean}; trials with a false report "
        f"{rate(*c['false'], 'upper')}.{too_soon(soon, c['slowed'][1], rule, every)}"
    )
    if not wrong:
        return text + " On these runs the rule holds."
    noise = spread({"trials": tests, "settings": {"min_phase_s": rule.min_phase_s}})
    return (
        f"{text} On these runs the rule fails: {', '.join(wrong)}. Against the threshold of "
        f"{100 * rule.threshold:.0f} %: {noise}"
    )
