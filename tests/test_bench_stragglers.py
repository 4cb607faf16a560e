"""bench.stragglers' own arithmetic: the slowdown a throttle caused, and the page's target count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import stragglers
from bench.cluster.stragglers import applied_slowdown, peer_slowdown, pin_threads, step_slowdown


def windows(ratios_before: list[float], ratios_after: list[float], every: int = 5) -> list[dict]:
    """rank_times records at each window's last step: rank 0 takes 10 ms, rank 1 `ratio` times that."""
    ratios = [*ratios_before, *ratios_after]
    return [
        {"step": every * (i + 1), "rank0_optimizer_s": 0.010, "rank1_optimizer_s": 0.010 * r}
        for i, r in enumerate(ratios)
    ]


def page(*trials: dict) -> str:
    """The section rendered from results holding `trials` (and a measured cost)."""
    data = {
        "date": "d", "cpu": "c", "cores": 2, "load": "l", "steps": 120, "throttle_at": 30,
        "cost": {"steps": 1, "cost_per_step_s": 1e-4, "mean_step_s": 0.1, "cost_share": 0.001},
        "trials": list(trials),
    }  # fmt: skip
    return stragglers.render(data, "bench/results/stragglers.json")


def test_the_slowdown_caused_takes_the_ranks_own_difference_out():
    # rank 1 is 10 % slower than rank 0 before the throttle, 1.32x after: the throttle caused 1.2x
    records = windows([1.1] * 6, [9.9] + [1.32] * 10)  # the window the throttle landed in is left out
    assert applied_slowdown(records, throttled_at=30) == pytest.approx(1.2)
    assert applied_slowdown(records[:6], throttled_at=30) is None  # nothing after it


def test_the_target_counts_only_runs_slowed_by_at_least_a_fifth():
    trial = {"rank": 1, "node": "n2", "throttled_at": 30, "error": "", "factor": 1.5, "hog": False}
    named = {"step": 60, "rank": 1, "node": "n2", "slower": 0.3, "phase": "optimizer"}
    text = page(
        {**trial, "applied": 1.25, "named": [named]},
        {**trial, "applied": 1.4, "named": []},
        {**trial, "applied": 1.05, "named": []},
    )
    assert "1 of 2 slowed runs whose throttle caused a slowdown of 1.2x or more" in text
    assert "0 of 1 whose throttle caused less" in text
    assert "| 1.5x | 1.25x | – | – | rank 1 on n2 | 30 | 60 | 30 |" in text


def test_the_target_counts_runs_by_how_much_slower_than_its_peer_the_rank_ran():
    # rank 1 was the faster rank before the throttle: it caused 1.36x, but rank 1 ran only 1.15x as long
    # as its peer after it, and a rank 20 % slower than its peers is what the target names
    trial = {"rank": 1, "node": "n2", "throttled_at": 30, "error": "", "factor": 1.25, "hog": 0}
    named = {"step": 60, "rank": 1, "node": "n2", "slower": 0.3, "phase": "optimizer"}
    text = page(
        {**trial, "applied": 1.36, "against_peer": 1.15, "named": []},
        {**trial, "applied": 1.28, "against_peer": 1.23, "named": [named]},
    )
    assert "1 of 1 slowed runs whose throttled rank ran 1.2x as long as its peer or more" in text
    assert "1 of 2 whose throttle caused a slowdown of 1.2x or more, 0 of 0 whose" in text
    assert "| 1.25x | 1.36x | 1.15x | – | rank 1 on n2 | 30 | – |" in text
    records = windows([0.86] * 6, [9.9] + [1.15] * 10)
    assert peer_slowdown(records, throttled_at=30) == pytest.approx(1.15)
    assert applied_slowdown(records, throttled_at=30) == pytest.approx(1.15 / 0.86)


def test_pinned_runs_count_for_the_target_by_the_quota_asked():
    # on a core of its own a rank is slowed by the quota asked: a pinned 1.2x trial counts for the target
    # even where the noisy optimizer phase measured less; an unpinned one only by what was measured
    trial = {"rank": 1, "node": "n2", "throttled_at": 30, "error": "", "hog": 0, "applied": 1.12}
    named = {"step": 60, "rank": 1, "node": "n2", "slower": 0.26, "phase": "optimizer"}
    text = page(
        {
            **trial,
            "name": "slow1_2",
            "factor": 1.2,
            "pinned": True,
            "against_peer": 1.16,
            "step_slowdown": 1.21,
            "named": [named],
        },
        {**trial, "name": "slow1_2_1", "factor": 1.2, "pinned": True, "against_peer": 1.1, "named": []},
        {**trial, "name": "slow1_5", "factor": 1.5, "pinned": False, "against_peer": 1.1, "named": []},
    )
    assert (
        "1 of 2 slowed runs whose rank got a quota of 1.2x or more on a core of its own (the target" in text
    )
    assert "; 0 of 0 whose throttled rank ran 1.2x as long as its peer or more" in text
    assert "| 1.2x | 1.12x | 1.16x | 1.21x | rank 1 on n2 | 30 | 60 | 30 |" in text
    assert "Pinned (slow1_2, slow1_2_1): " in text


def test_the_job_slowdown_is_its_step_time_after_the_throttle_against_before():
    records = [{"step": 5 * (i + 1), "rank1_step_s": s} for i, s in enumerate([0.2] * 6 + [9.9] + [0.25] * 6)]
    assert step_slowdown(records, throttled_at=30) == pytest.approx(1.25)  # the window it landed in left out
    assert step_slowdown(records[:6], throttled_at=30) is None


def test_the_false_reports_are_told_apart_by_the_busy_processes_beside_the_run():
    trials = [("clean0", 0, 0), ("hog0", True, 1), ("load0", 2, 0), ("load1", 2, 0)]  # name, busy, reports
    clean = [{"name": n, "factor": 1.0, "hog": h, "named": [{}] * k, "state": "COMPLETED", "error": ""}
             for n, h, k in trials]  # fmt: skip
    assert [stragglers._busy(t["hog"], 2) for t in clean] == ["none", "1", "one per core", "one per core"]
    assert stragglers._false_reports(clean, cores=2) == (
        "1 over 4 runs (0 over 1 without busy processes; 1 over 1 beside one; 0 over 2 beside one per core)"
    )


def test_pinning_moves_every_thread_of_a_running_process_and_reads_it_back():
    # a process with a second thread, started on every CPU: after pinning, each thread is on the one asked
    code = (
        "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); "
        "print(1, flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "1"  # both threads started
        cpu = (os.cpu_count() or 1) - 1
        assert pin_threads(proc.pid, cpu) == {cpu}
        tasks = [int(t.name) for t in Path(f"/proc/{proc.pid}/task").iterdir()]
        assert len(tasks) >= 2 and all(os.sched_getaffinity(t) == {cpu} for t in tasks)
    finally:
        proc.kill()
        proc.wait()


def test_a_rank_named_at_or_before_its_throttle_is_a_false_report_not_a_detection():
    trial = {
        "rank": 1,
        "node": "n2",
        "throttled_at": 30,
        "error": "",
        "factor": 1.3,
        "hog": 0,
        "applied": 1.3,
    }
    early = {"step": 30, "rank": 1, "node": "n2", "slower": 0.36, "phase": "forward"}
    late = {"step": 70, "rank": 1, "node": "n2", "slower": 0.28, "phase": "forward"}
    text = page({**trial, "named": [early]}, {**trial, "named": [late]})
    assert "1 of 2 slowed runs whose throttle caused a slowdown of 1.2x or more" in text
    assert "the throttled rank named at or before its throttle's step (a false report): 1 of 2" in text


def test_the_page_says_the_niceness_and_each_clean_trials_load():
    """The conditions a run was measured under: the bench's niceness (its busy processes inherit it), the
    ranks' as read back, and the machine's load at each clean trial's start and end."""
    clean = {"name": "clean0", "factor": 1.0, "hog": 0, "named": [], "state": "COMPLETED", "error": "",
             "nice": {"0": 0, "1": 0}, "load": [3.04, 12.5]}  # fmt: skip
    data = {"date": "d", "cpu": "c", "cores": 2, "steps": 120, "throttle_at": 30, "nice": 10,
            "load_start": [3.0, 2.0, 1.0], "load_end": [12.5, 9.0, 5.0],
            "cost": {"steps": 1, "cost_per_step_s": 1e-4, "mean_step_s": 0.1, "cost_share": 0.001},
            "trials": [clean]}  # fmt: skip
    text = stragglers.render(data, "bench/results/stragglers.json")
    assert (
        "at the end: above the core count, other processes held the cores; the bench and its busy processes "
        "at nice 10, the ranks (started by Slurm) at nice 0)" in text
    )
    assert "| clean0 | none | 3.0 → 12.5 | COMPLETED | 0 |" in text
    assert "| clean0 | none | – |" in page({**clean, "load": []})  # results kept before: no load
