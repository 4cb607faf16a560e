"""bench.spares' straggler trial read from synthetic records (fast, no Slurm): the step times before, during
and after the slowdown, who was named and who took its place, the restart, and when throughput is back
against the budget of one snapshot interval plus the restart; and the page's table of it."""

from __future__ import annotations

import json

import pytest

from bench import spares, spares_straggler
from bench.spares_straggler import analyse, first_back, landed_fields, passed

T0 = 1_000.0
THROTTLED = {"rank": 1, "node": "n2", "factor": 4.0, "quota_us": 500, "period_us": 2000, "weight": 25}


def train(step: int, at: float, seconds: float) -> dict:
    return {"kind": "train", "step": step, "time": at, "time_step_s": seconds, "job_id": "7"}


def event(name: str, step: int, at: float, **fields) -> dict:
    return {"kind": "event", "event": name, "step": step, "time": at, "job_id": "7", **fields}


def run(after: list[float], restart_s: float = 30.0, named_rank: int = 1, stop: bool = True):
    """Steps 1-20 at 0.1 s, throttled after 20, 0.3 s to the stop at 50 (named at 45), the restart, then
    `after`'s step times from step 51."""
    records, events, now = [], [event("start", 0, T0, world_size=2)], T0
    for step in range(1, 51):
        seconds = 0.1 if step <= 20 else 0.3
        now += seconds
        records.append(train(step, now, seconds))
        if step == 20:
            throttled = THROTTLED | {"step": 20, "time": now + 0.01}
        if step == 45:
            events.append(
                event("straggler", 45, now, rank=named_rank, node="n2", slower=1.4, phase="optimizer")
            )
    if not stop:
        return records, events, throttled
    events.append(event("stop", 50, now, reason="straggler", exit_code=89))
    events.append(event("step_restart", 50, now + 10, nodes=["n1", "n3"], nodes_replaced=[["n2", "n3"]]))
    now += restart_s
    events.append(event("resume", 50, now, world_size=2, restored_from="peer node"))
    for step, seconds in enumerate(after, start=51):
        now += seconds
        records.append(train(step, now, seconds))
    return records, events, throttled


SLOW_START = [0.9, 0.3, 0.3, 0.3, 0.1] + [0.1] * 30  # back from the 3rd step after the resume


def test_a_replaced_straggler_is_read_from_the_records():
    got = analyse(*run(SLOW_START), snapshot_every=10)
    assert got["step_s"] == {"healthy": 0.1, "slowed": 0.3, "after_first_interval": 0.1, "after_rest": 0.1}
    assert (got["named_at_step"], got["named_after_steps"], got["named_right"]) == (45, 25, True)
    assert (got["stopped_at_step"], got["named_to_stop_steps"], got["named_to_stop_s"]) == (50, 5, 1.5)
    assert (got["spare"], got["nodes_after"], got["world_sizes"], got["resized"]) == (
        "n3",
        ["n1", "n3"],
        [2],
        False,
    )
    assert (got["stop_to_decision_s"], got["stop_to_resume_s"], got["resumed_at_step"]) == (10.0, 30.0, 50)
    # the first 5 steps in a row with a median <= 0.1 / 0.95 start at the 3rd step after the resume, i.e.
    # once the 2nd one ended (0.9 + 0.3 s after the resume)
    assert (got["back_after_steps"], got["resume_to_back_s"]) == (2, 1.2)
    assert got["named_to_back_s"] == pytest.approx(1.5 + 30 + 1.2, abs=0.01)
    assert got["budget_s"] == pytest.approx(10 * 0.3 + 30, abs=0.01)
    assert got["back_within_budget"] is True
    assert got["throttled"] == THROTTLED


def test_the_stop_and_resume_are_those_after_the_straggler_line():
    records, events, throttled = run(SLOW_START)
    earlier = [event("stop", 5, T0 + 0.5, reason="signal"), event("resume", 5, T0 + 0.55, world_size=2)]
    got = analyse(records, events[:1] + earlier + events[1:], throttled, snapshot_every=10)
    assert (got["stopped_at_step"], got["stop_reason"], got["stop_to_resume_s"]) == (50, "straggler", 30.0)
    assert got["step_s"]["after_first_interval"] == 0.1 and got["back_after_steps"] == 2


def test_throughput_back_too_late_or_never_misses_the_budget():
    late = analyse(*run([0.3] * 12 + [0.1] * 10), snapshot_every=10)  # 12 slow steps cost 3.6 s > 3 s
    assert late["back_after_steps"] == 10 and late["back_within_budget"] is False
    assert late["step_s"]["after_first_interval"] == 0.3
    never = analyse(*run([0.2] * 20), snapshot_every=10)
    assert never["back_after_steps"] is None and never["resume_to_back_s"] is None
    assert never["back_within_budget"] is False


def test_first_back_needs_a_whole_window_at_the_healthy_throughput():
    steps = [train(i, T0 + i, s) for i, s in enumerate([0.5, 0.5, 0.1, 0.5, 0.1, 0.1, 0.1, 0.1])]
    assert first_back(steps, healthy=0.1, window=5) == 1  # 0.5 0.1 0.5 0.1 0.1: median 0.1 (0.5 before)
    assert first_back(steps, healthy=0.1, window=9) is None  # fewer steps than a window
    slow_every_other = [train(i, T0 + i, s) for i, s in enumerate([0.5, 0.1, 0.5, 0.1, 0.5])]
    assert first_back(slow_every_other, healthy=0.1, window=3) == 1  # 0.1 0.5 0.1
    assert first_back(slow_every_other, healthy=0.1, window=4) is None  # median 0.3 in every window
    assert first_back(steps, healthy=0.094, window=5) is None  # 0.1 > 0.094 / 0.95
    # back at 95 % of the healthy throughput, not 100 %: 0.104 s is within 0.1 / 0.95, 0.106 s is not
    assert first_back([train(i, T0 + i, 0.104) for i in range(5)], healthy=0.1, window=5) == 0
    assert first_back([train(i, T0 + i, 0.106) for i in range(5)], healthy=0.1, window=5) is None


def test_a_wrong_rank_named_or_a_run_that_never_stopped_fails_the_trial():
    wrong = analyse(*run(SLOW_START, named_rank=0), snapshot_every=10)
    assert wrong["named_right"] is False and wrong["spare"] == "n3"  # the node was right, the rank not
    unstopped = analyse(*run([], stop=False), snapshot_every=10)
    assert unstopped["named_at_step"] == 45 and unstopped["stopped_at_step"] is None
    assert unstopped["spare"] is None and unstopped["stop_to_resume_s"] is None
    assert unstopped["budget_s"] is None and unstopped["back_within_budget"] is False
    assert unstopped["step_s"]["slowed"] == 0.3 and unstopped["step_s"]["after_rest"] is None


def trial(**changes) -> dict:
    return {"job": "7", "state": "COMPLETED", "requeues": 0, "job_ids": ["7"], "log_says_spare": True,
            **analyse(*run(SLOW_START), snapshot_every=10),
            "ledger_s": {"productive": 20.0, "startup": 5.0, "restore": 0.2, "stop": 14.0, "restart": 16.0},
            "setup": {"steps": 85, "throttle_at": 20, "factor": 4.0, "snapshot_every": 10, "window": 5,
                      "back": 0.95}} | changes  # fmt: skip


@pytest.mark.parametrize(
    "changes",
    [{"requeues": 1}, {"job_ids": ["7", "8"]}, {"world_sizes": [1, 2]}, {"resized": True}, {"spare": None},
     {"named_after_steps": 51}, {"named_right": False}, {"back_within_budget": False}],
)  # fmt: skip
def test_the_targets_of_a_trial(changes):
    assert passed(trial())
    assert not passed(trial(**changes))


def test_the_landed_line_gives_the_throttle_without_its_cgroup_path():
    line = (
        "throttle rank=1 node=n2 pid=42 factor=4.0 cpus=1 quota_us=500 period_us=2000 weight=25 cgroup=/x/y"
    )
    fields = landed_fields(line)
    assert {k: fields[k] for k in THROTTLED} == THROTTLED
    assert "cgroup" not in analyse(*run(SLOW_START), snapshot_every=10)["throttled"]
    got = analyse(*run(SLOW_START)[:2], fields | {"step": 20, "time": T0 + 2.01}, snapshot_every=10)
    assert set(got["throttled"]) == set(THROTTLED)


def test_the_section_shows_a_straggler_table_after_the_kill_table(tmp_path, monkeypatch):
    kept = tmp_path / "spares.json"
    kept.write_text(json.dumps({"command": "python -m bench.spares", "date": "2026-11-27", "trials": [],
                                "straggler_trials": [trial()]}))  # fmt: skip
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\n<!-- bench:spares -->\nold\n<!-- /bench:spares -->\n")
    monkeypatch.setenv("BENCH_PAGE", str(page))
    assert spares.main(["--page-from", str(kept)]) == 0
    text = page.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 1 and rows[0].count(" | ") == len(spares_straggler.HEADER) - 1
    cells = "| rank 1 on n2 ×4 after step 20 | 45 (+25) | yes | n3 | 2 | 0.100 | 0.300 | 0.100 | 0.100 |"
    assert cells in rows[0]
    assert rows[0].endswith("| 30.0 | 1.20 | 32.7 | 33.0 | yes | 14.0 | 16.0 |")
    assert "## Spare nodes: a killed node replaced in place" not in text  # no kill trial kept


def test_kinds_are_checked():
    assert spares.kinds_arg("straggler,kill") == ["kill", "straggler"]
    with pytest.raises(SystemExit):
        spares.main(["--kinds", "kill,slow", "--page-from", "x"])
