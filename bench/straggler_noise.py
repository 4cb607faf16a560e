"""The noise a straggler threshold must clear, from a stragglers run's kept windows (bench/stragglers.py
and bench/straggler_rules.py both print it)."""

from __future__ import annotations

import statistics

TEST = "test_of_shipped_rule"  # a kept run's key: it tests the shipped rule (bench.stragglers --test)


def apart(data: dict) -> dict[str, list[float]]:
    """Per phase the detector compares, how far apart the two ranks' fastest times were in each window
    where nothing slowed either (the clean runs without busy processes, the slowed runs before their
    throttle): the noise a threshold must clear."""
    from relaytrain.resilience.rank.straggler import MIN_PHASE_S, PHASES
    from relaytrain.resilience.rank.straggler_watch import judged_times

    from bench.straggler_records import matrix_from_record

    # the floor the runs compared phases from (results kept before it was recorded: MIN_PHASE_S)
    floor = float(data.get("settings", {}).get("min_phase_s", MIN_PHASE_S))
    out: dict[str, list[float]] = {p: [] for p in PHASES}
    for trial in data["trials"]:
        if trial["hog"] or trial.get("error"):
            continue
        for window in trial.get("windows", []):
            if trial["throttled_at"] is not None and int(window["step"]) > trial["throttled_at"]:
                continue
            if "rank0_optimizer_fastest_s" not in window:  # kept before the fastest times were recorded
                continue
            judged = judged_times(matrix_from_record(window, 2))
            if judged is None:
                continue
            for i, phase in enumerate(PHASES):
                a, b = judged[0][0][i], judged[0][1][i]
                if min(a, b) >= floor:
                    out[phase].append(abs(b / a - 1))
    return out


def forward_noise(data: dict) -> str:
    """One run's noise in the phase the shipped rule names ranks by ("forward"), for a line per run."""
    values = apart(data)["forward"]
    if not values:
        return "forward noise not recorded"
    return f"forward noise {100 * statistics.median(values):.1f} % (median of {len(values)} windows)"


def spread(data: dict) -> str:
    """How far apart the two ranks' fastest times per phase were in windows where nothing slowed either
    (`apart`), per phase the detector compares."""
    shown = [
        f"{phase} {100 * statistics.median(v):.1f} % (95th percentile {100 * _percentile(v, 0.95):.1f} %, "
        f"{len(v)} windows)"
        for phase, v in apart(data).items()
        if v
    ]
    if not shown:
        return "No window kept its fastest times (results kept before they were recorded)."
    return (
        "Noise the threshold must clear: in windows where nothing slowed either rank (the clean runs "
        "without busy processes, the slowed runs before their throttle), the ranks' fastest times per phase "
        "differed by (median over the windows) " + "; ".join(shown) + "."
    )


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
