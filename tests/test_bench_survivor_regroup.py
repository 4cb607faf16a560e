"""bench/survivor_regroup.py: the survivors of a SIGKILLed rank regroup on the same store, a warm spare takes
the lost rank and receives the state, and every rank ends with an uninterrupted run's state (one short
trial; the timings are the benchmark's, not asserted here)."""

from __future__ import annotations

from bench import survivor_regroup


def test_the_survivors_and_the_spare_end_with_an_uninterrupted_run_s_state():
    result = survivor_regroup.trial(ranks=3, kill_at=3, steps=6)
    assert result["bit_exact"], result
    assert result["processes_exited"] == 1, result  # the killed rank only
    assert 0 < result["detect_s"] < result["kill_to_next_s"], result
