"""bench/snapshot_budget.py's figures and section from metrics.jsonl records (the measurement itself trains
a 1.2 GB state for minutes; docs/benchmarks.md, "Snapshots within a budget", has its figures)."""

from __future__ import annotations

import pytest

from bench import snapshot_budget as budget


def _records(step_s: dict[int, float], snaps: list[tuple[int, float, float | None]], chosen=()) -> list[dict]:
    records = [
        {"kind": "train", "step": s, "time_step_s": t, "snapshot_bytes": 1.2e9} for s, t in step_s.items()
    ]
    records += [{"kind": "event", "event": "snapshot", "step": s, "blocking_s": b, "waited_s": 0.0,
                 "background_s": 2.0, "slowdown_s": d} for s, b, d in snaps]  # fmt: skip
    records += [{"kind": "event", "event": "snapshot_interval", "step": s, "every": k, "overhead": 0.015}
                for s, k in chosen]  # fmt: skip
    return records


def test_the_overhead_is_measured_over_the_steady_steps_and_the_ledger_sums_the_snapshot_events():
    steps = range(1, 11)
    off = budget.summarize(_records({s: 10.0 for s in steps}, []))
    every = budget.summarize(_records({s: 12.0 for s in steps}, [(s, 0.5, None) for s in range(1, 10)]))
    auto_steps = {s: 10.0 for s in steps} | {4: 13.0, 9: 10.1}  # step 4 pays for the start-up snapshot
    auto = budget.summarize(_records(auto_steps, [(3, 3.0, 0.0), (8, 0.1, 0.05)], [(3, 5)]))
    runs = {"off": off, "every step": every, "auto": auto}
    assert off["steady_steps"] == 10 - budget.STEADY_FROM + 1 == 6 and off["steady_s"] == 60.0
    assert auto["steady_s"] == pytest.approx(60.1) and auto["total_s"] == pytest.approx(93.1)
    assert budget.overhead(runs, "auto") == pytest.approx(0.1 / 60)  # within 2 %
    assert budget.overhead(runs, "every step") == pytest.approx(0.2)
    assert auto["ledger_steady_s"] == pytest.approx(0.15)  # step 8's snapshot; step 3's is start-up
    assert every["ledger_steady_s"] == pytest.approx(
        0.5 * 6
    )  # steps 4-9, the slowdown unknown: blocking only
    one, every_row, auto_row = budget.part_rows("one process", runs, 0.02)
    assert one == "| one process: without snapshots | 10.000 s | | | |"
    assert every_row.startswith(
        "| one process: `snapshot_every = 1` | 12.000 s | 9 | +20.0% (whole run +20.0%)"
    )
    assert auto_row.startswith(
        '| one process: `snapshot_every = "auto"` | 10.017 s | 2 | +0.2% (within the budget)'
    )
    assert budget._chosen(auto) == "every 5 from step 3"


def test_the_section_names_its_command_and_its_kept_results():
    runs = {name: budget.summarize(_records({s: 10.0 for s in range(1, 9)}, [])) for name in budget.EVERY}
    data = {"command": "python -m bench.snapshot_budget", "date": "2026-11-27 07:00 UTC", "cpu": "x",
            "commit": "abc", "load": "[1.0] -> [1.0]", "args": {"budget": 0.02, "state_gb": 1.2, "steps": 8},
            "parts": {"one": runs}, "kept": "snapshot-budget-x.json"}  # fmt: skip
    section = budget.render(data)
    assert section.startswith("## Snapshots within a budget: the automatic interval\n")
    assert "with `python -m bench.snapshot_budget`, one invocation" in section
    assert section.endswith(
        "Rewritten from the kept results by "
        "`python -m bench.snapshot_budget --page-from bench/results/snapshot-budget-x.json`."
    )


def test_two_nodes_sum_each_settings_jobs_run_in_mirrored_order():
    """On 2 nodes each setting runs twice, in the order off, every step, auto, auto, every step, off: a load
    that rises steadily adds the same to each setting's sum."""
    assert budget.MIRRORED == ["off", "every step", "auto", "auto", "every step", "off"]
    drift = {name: [] for name in budget.EVERY}
    for position, name in enumerate(budget.MIRRORED):  # every step 1 s slower per job than the one before
        drift[name].append(budget.summarize(_records({s: 10.0 + position for s in range(1, 11)}, [])))
    runs = {name: budget.combined(jobs) for name, jobs in drift.items()}
    assert runs["off"]["jobs"] == 2 and runs["off"]["steady_steps"] == 12
    assert budget.overhead(runs, "auto") == pytest.approx(0) and budget.overhead(runs, "every step") == 0
    data = {"parts": {"nodes": runs}}
    assert "mirrored order, off, every step, auto, auto, every step, off" in budget._order(data["parts"])
    # each setting's two jobs apart (steps 5-10: 6 steps of 10 + position s): the noise floor
    spread = budget._spread(runs)
    assert spread.startswith("2 nodes, each job's steady steps: off 60.0 / 90.0 s (50.0% apart);")


def test_the_chooser_is_judged_on_runs_kept_as_its_test_with_enough_intervals():
    """Runs kept with --test judge the chooser (within the budget, with a 95 % lower bound) only in parts
    whose automatic run chose 3 intervals or more; the others are named, not judged; under two such runs
    the test is still open."""

    def run(test: bool, auto_step: float, chosen: int, name: str) -> dict:
        steps = range(1, 31)
        off = budget.summarize(_records({s: 10.0 for s in steps}, []))
        every = budget.summarize(_records({s: 12.0 for s in steps}, []))
        picks = [(3 + 8 * i, 8) for i in range(chosen)]
        auto = budget.summarize(_records({s: auto_step for s in steps}, [], picks))
        return {"args": {"budget": 0.02, "steps": 30, "test": test}, "commit": "c", "kept": name,
                "parts": {"one": {"off": off, "every step": every, "auto": auto}}}  # fmt: skip

    old = run(False, 10.0, 3, "snapshot-budget-a.json")
    one = run(True, 10.1, 3, "snapshot-budget-b.json")
    assert budget.chooser_test([old, one]).startswith("Still open: the chooser judged out of sample, on 2")
    assert "kept so far: 1 such run(s) (bench/results/snapshot-budget-b.json (one): +1.0% measured" in (
        budget.chooser_test([old, one])
    )
    over, short = run(True, 10.5, 4, "snapshot-budget-c.json"), run(True, 10.0, 2, "snapshot-budget-d.json")
    text = budget.chooser_test([old, one, over, short])
    assert text.startswith("The chooser's test (3 runs kept as its test")
    assert "within the budget in 1 of 2 (95 % lower bound 3 %) parts" in text
    assert "snapshot-budget-c.json (one): +5.0% measured" in text
    assert text.endswith(
        "Not judged (too few intervals): bench/results/snapshot-budget-d.json (one): 2 interval(s) chosen."
    )
