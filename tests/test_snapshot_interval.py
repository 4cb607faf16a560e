"""The automatic snapshot interval (`checkpoint.snapshot_every = "auto"`): the chooser (pure), the pacing
that times steps and picks snapshot steps, the config key, and one short run that chooses and takes them."""

from __future__ import annotations

import json

import pytest

from relaytrain.checkpoint.snapshot import interval as iv
from relaytrain.checkpoint.snapshot.interval import Costs, IntervalChooser, fits, overhead, shortest_interval
from relaytrain.checkpoint.snapshot.pacing import CLEAN_STEPS, FIRST_AUTO_STEP, SnapshotPacing, StepTimes
from relaytrain.config import load_config
from relaytrain.errors import ConfigError

import faults
from conftest import run_cli

CASES = [
    Costs(blocking_s=0.16, background_s=9.0, slowdown_s=0.0, step_s=10.0),  # 7B-like: the fit decides
    Costs(blocking_s=0.16, background_s=2.0, slowdown_s=1.5, step_s=16.0),  # the budget decides
    Costs(blocking_s=0.013, background_s=0.05, slowdown_s=0.0, step_s=0.63),
    Costs(blocking_s=0.2, background_s=0.0, slowdown_s=0.0, step_s=10.0),  # exactly 2 %: every step
    Costs(blocking_s=0.0, background_s=0.0, slowdown_s=0.0, step_s=0.0),
]


@pytest.mark.parametrize("costs", CASES)
@pytest.mark.parametrize("budget", [0.01, 0.02, 0.1])
def test_the_interval_is_the_shortest_within_the_budget_whose_background_work_fits(costs, budget):
    every = shortest_interval(costs, budget)
    assert every >= 1
    assert overhead(costs, every) <= budget + 1e-12 and fits(costs, every)
    if every > 1:  # one step shorter breaks the budget or lets a snapshot wait for the previous one
        assert overhead(costs, every - 1) > budget or not fits(costs, every - 1)


def test_figures_at_the_limits():
    assert shortest_interval(CASES[3], 0.02) == 1  # 0.2 / (0.02 * 10) is 1, not 2 by rounding
    assert shortest_interval(CASES[0], 0.02) == 2  # 9 s of work * 1.25 > one 10 s step
    assert shortest_interval(CASES[1], 0.02) == 6  # (0.16 + 1.5) / (0.02 * 16) = 5.2
    # background work never outlasts the interval, whatever the budget allows
    slow_write = Costs(blocking_s=0.0, background_s=30.0, slowdown_s=0.0, step_s=1.0)
    assert shortest_interval(slow_write, 1.0) == 38 and fits(slow_write, 38) and not fits(slow_write, 37)


def test_the_interval_is_chosen_again_only_when_a_figure_moves_or_a_snapshot_waited():
    chooser = IntervalChooser(0.02)
    base = Costs(blocking_s=0.16, background_s=2.0, slowdown_s=1.5, step_s=16.0)
    assert chooser.update(base) and chooser.every == 7  # 1.66 / (0.8 * 0.02 * 16) = 6.5: HEADROOM
    noisy = Costs(blocking_s=0.17, background_s=2.1, slowdown_s=1.6, step_s=15.0)  # within HYSTERESIS
    assert not chooser.update(noisy) and chooser.every == 7
    waited = Costs(blocking_s=0.16, background_s=2.0, slowdown_s=1.5, step_s=16.0, waited_s=0.5)
    assert chooser.update(waited)  # a snapshot waited for the previous one: chosen again at once
    faster = Costs(blocking_s=0.16, background_s=2.0, slowdown_s=1.5, step_s=4.0)
    for _ in range(iv.RECENT // 2):  # one faster step time among the recent medians does not move them
        assert not chooser.update(faster) or chooser.every == 7
    assert chooser.update(faster) and chooser.every == shortest_interval(faster, iv.HEADROOM * 0.02) == 26
    assert "every 26 steps (blocking 0.160 s, background 2.000 s, step 4.000 s, overhead 1.60%" in (
        chooser.describe()
    )
    assert chooser.describe().endswith("<= budget 2.00%)")


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_step_times_split_clean_steps_from_those_background_work_slowed():
    clock = Clock()
    times = StepTimes(clock)
    times.step_ended()  # the job's first step is not timed
    for took, overlapping in [(1.0, False), (1.0, False), (1.5, True), (1.25, True), (1.0, False)]:
        times.resumed(overlapping)
        clock.now += took
        times.step_ended()
    assert list(times.clean) == [1.0, 1.0, 1.0] and times.figures() == {"step_s": 1.0, "slowdown_s": 0.75}
    times.snapshot_taken()
    assert times.figures()["slowdown_s"] == 0.0
    every_step = StepTimes(clock)  # no clean step yet: the slowdown is unknown, not 0
    every_step.resumed(True)
    clock.now += 2.0
    every_step.step_ended()
    assert every_step.figures() == {"step_s": 2.0, "slowdown_s": -1.0}


def _cfg(every, budget=0.02):
    return load_config(
        None, [f"--checkpoint.snapshot_every={every}", f"--checkpoint.snapshot_max_overhead={budget}"]
    )


def _settled(step, **figures):
    base = {"step": float(step), "blocking_s": 0.1, "waited_s": 0.0, "background_s": 0.5, "replicate_s": 0.2}
    return base | {"write_s": 0.3, "overran_s": 0.0, "step_s": 1.0, "slowdown_s": 0.2} | figures


def test_a_fixed_interval_keeps_its_steps_and_records_each_snapshots_cost():
    events = []
    pacing = SnapshotPacing(_cfg(3).checkpoint, 0, lambda event, step, **f: events.append((event, step, f)))
    assert pacing.chooser is None
    assert [s for s in range(1, 13) if pacing.due(s)] == [3, 6, 9, 12]
    pacing.taken(6, _settled(3, background_s=50.0, overran_s=40.0))  # however slow: still every 3
    assert [s for s in range(7, 13) if pacing.due(s)] == [9, 12]
    assert events == [("snapshot", 3, {"blocking_s": 0.1, "waited_s": 0.0, "background_s": 50.0,
                                       "replicate_s": 0.2, "write_s": 0.3, "slowdown_s": 0.2})]  # fmt: skip


def test_a_fixed_interval_waits_for_its_snapshots_work_until_steps_ran_clean():
    """With a snapshot every step, every step would overlap the previous snapshot's work: the first
    snapshots wait for theirs until CLEAN_STEPS steps were timed clean; a longer interval never waits."""
    clock = Clock()
    every_step = SnapshotPacing(_cfg(1).checkpoint, 0)
    every_step.times = StepTimes(clock)
    waited = []
    for _ in range(6):
        every_step.step_ended()
        waited.append(every_step.measuring)
        every_step.resumed(background_running=not every_step.measuring)
        clock.now += 1.0 if every_step.measuring else 1.5
    assert waited == [True] * CLEAN_STEPS + [False] * (6 - CLEAN_STEPS)
    assert every_step.times.figures()["slowdown_s"] > 0  # measured against the clean steps, not unknown
    every_fourth = SnapshotPacing(_cfg(4).checkpoint, 0)
    every_fourth.times = StepTimes(clock)
    for _ in range(4):  # steps 2-4 timed clean before the first snapshot
        every_fourth.step_ended()
        every_fourth.resumed(False)
        clock.now += 1.0
    assert every_fourth.due(4) and not every_fourth.measuring


def test_a_run_with_a_snapshot_every_step_measures_what_each_one_slowed(tmp_path, tiny_args):
    """Every snapshot of a `snapshot_every = 1` run records a measured slowdown (not null), and the job's
    first two snapshots include the wait for their own background work."""
    shm = tmp_path / "shm"
    args = ["train", *tiny_args, "--run.name=every", "--train.max_steps=8", "--checkpoint.interval=0"]
    args += ["--checkpoint.snapshot_every=1", f"--checkpoint.snapshot_dir={shm}"]
    done = run_cli(args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (tmp_path / "runs/every/metrics.jsonl").read_text().splitlines()
    snaps = [r for r in map(json.loads, lines) if r.get("event") == "snapshot"]
    assert [r["step"] for r in snaps] == list(range(1, 8)), snaps
    assert all(r["slowdown_s"] is not None for r in snaps), snaps


def test_a_stopped_run_records_the_cost_of_the_snapshot_its_stop_settled(tmp_path, tiny_args):
    """A stop (here at step 5) waits for the newest snapshot's work (step 4's): its event is written too,
    not only those a next snapshot settled."""
    shm = tmp_path / "shm"
    args = ["train", *tiny_args, "--run.name=stop", "--train.max_steps=10", "--train.stop_at_step=5"]
    args += ["--checkpoint.interval=0", "--checkpoint.snapshot_every=2", f"--checkpoint.snapshot_dir={shm}"]
    done = run_cli(args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "runs/stop/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("event") == "stop"] == [5], records
    assert [r["step"] for r in records if r.get("event") == "snapshot"] == [2, 4], records


def test_auto_measures_at_its_first_snapshot_then_takes_one_at_the_chosen_interval():
    events = []
    pacing = SnapshotPacing(
        _cfg("auto").checkpoint, 0, lambda event, step, **f: events.append((event, step, f))
    )
    due = []
    for step in range(11, 11 + FIRST_AUTO_STEP):  # counted in this job's steps: a resumed run measures too
        pacing.step_ended()
        due.append(pacing.due(step))
    assert due == [False] * (FIRST_AUTO_STEP - 1) + [True] and pacing.measuring
    first = 10 + FIRST_AUTO_STEP
    pacing.taken(first, _settled(first, overran_s=0.5), measured=True)  # its own work, waited for
    (snap, snap_step, record), (chose, chose_step, fields) = events
    assert (snap, snap_step, record["blocking_s"], record["waited_s"]) == ("snapshot", first, 0.6, 0.5)
    # no step overlapped its work: its slowdown is taken as all of it (0.5 s), so 0.1 + 0.5 s every 38
    # steps (0.6 / (0.8 * 0.02) = 37.5 with the headroom)
    assert (chose, chose_step, fields["every"], fields["previous"]) == ("snapshot_interval", first, 38, None)
    assert fields["slowdown_s"] == 0.5 and fields["overhead"] == pytest.approx(0.6 / 38)
    assert fields["budget"] == 0.02
    assert not pacing.measuring and pacing.next_step == first + 38
    assert not pacing.due(first + 37) and pacing.due(first + 38)
    pacing.taken(first + 38, None)  # the next snapshot settles nothing (the first was settled at once)
    assert pacing.next_step == first + 76 and len(events) == 2
    pacing.taken(first + 76, _settled(first + 38, slowdown_s=0.2))  # measured: 0.1 + 0.2 s
    assert events[-1][0] == "snapshot_interval" and events[-1][2]["every"] == 19
    assert pacing.next_step == first + 95


def test_the_first_snapshots_provisional_figures_give_way_to_the_next_measured_ones():
    """The upper bound the first interval was chosen on leaves the median at once, not after RECENT more
    snapshots (with it, the median slowdown of 0.5 and 0.2 s would keep the interval at 29)."""
    chooser = IntervalChooser(0.02)
    assert chooser.update(Costs(0.1, 0.5, 0.5, 1.0), provisional=True) and chooser.every == 38
    assert chooser.update(Costs(0.1, 0.5, 0.2, 1.0)) and chooser.every == 19
    assert not chooser.update(Costs(0.1, 0.5, 0.2, 1.0)) and chooser.every == 19


def test_the_headroom_absorbs_growing_figures_and_an_interval_over_the_budget_is_chosen_again_at_once():
    """Chosen for 80 % of the budget, the interval holds while the figures grow by less than 25 %; figures
    that each moved less than HYSTERESIS but together put it over the budget make it be chosen again."""
    chooser = IntervalChooser(0.02)
    assert chooser.update(Costs(0.1, 1.0, 0.5, 1.0)) and chooser.every == 38  # 0.6 / 0.016 = 37.5
    for _ in range(iv.RECENT):  # the cost 18 % up: 0.71 / 38 = 1.87 %, still within the budget
        assert not chooser.update(Costs(0.1, 1.0, 0.61, 1.0)) and chooser.every == 38
    chooser = IntervalChooser(0.02)
    assert chooser.update(Costs(0.1, 1.0, 0.5, 1.0)) and chooser.every == 38
    worse = Costs(0.1, 1.0, 0.6, 0.85)  # cost +17 %, step -15 %: 0.7 / (38 * 0.85) = 2.17 % > 2 %
    assert not chooser.update(worse)  # the medians halfway: 0.65 / (38 * 0.925) = 1.85 %
    assert chooser.update(worse) and chooser.every == 52  # 0.7 / (0.016 * 0.85) = 51.5
    assert overhead(worse, chooser.every) <= iv.HEADROOM * 0.02


def test_the_config_takes_auto_beside_intervals_and_refuses_other_words():
    assert _cfg("auto").checkpoint.snapshot_every == "auto" and _cfg(4).checkpoint.snapshot_every == 4
    assert load_config(None, []).checkpoint.snapshot_max_overhead == 0.02
    with pytest.raises(ConfigError, match="expects int or one of 'auto', got 'often'"):
        _cfg("often")
    with pytest.raises(ConfigError, match="snapshot_every=-1 is not allowed: must be >= 0 or 'auto'"):
        _cfg(-1)
    with pytest.raises(ConfigError, match="snapshot_max_overhead=0.0 is not allowed"):
        _cfg("auto", 0)


def test_a_run_with_auto_chooses_an_interval_and_takes_its_snapshots_there(tmp_path, tiny_args):
    """A short run (each step lengthened to 0.2 s): the start-up snapshot at the job's 3rd step, the
    interval chosen from its figures, the snapshots after it at that interval, each one's cost recorded."""
    shm = tmp_path / "shm"
    args = ["train", *tiny_args, "--run.name=auto", "--train.max_steps=10", "--checkpoint.interval=0"]
    args += ["--checkpoint.snapshot_every=auto", "--checkpoint.snapshot_max_overhead=0.5"]
    done = run_cli([*args, f"--checkpoint.snapshot_dir={shm}"], tmp_path, **faults.env(step_delay_s=0.2))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (tmp_path / "runs/auto/metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    chosen = [r for r in records if r.get("event") == "snapshot_interval"]
    taken = [r["step"] for r in records if r.get("event") == "snapshot"]
    assert chosen and chosen[0]["step"] == FIRST_AUTO_STEP and taken[0] == FIRST_AUTO_STEP, records
    assert all(c["overhead"] <= c["budget"] == 0.5 for c in chosen), chosen
    every = {c["step"]: c["every"] for c in chosen}
    # each snapshot at the interval in force after the one before
    for before, after in zip(taken, taken[1:], strict=False):
        assert after == before + every[max(s for s in every if s <= before)], (taken, every)
    assert len(taken) >= 2 and taken[-1] + every[max(every)] >= 10  # the last one's cost recorded too
    assert "snapshot interval: every " in done.stdout + done.stderr
    assert all(r["background_s"] > 0 and r["blocking_s"] > 0 for r in records if r.get("event") == "snapshot")


def test_a_load_spike_in_a_step_beside_a_snapshots_work_is_charged_at_most_the_overlap():
    """A step is charged what it took beyond a clean step, but at most the time the snapshot's background
    work ran during it: a 12 s step (a load spike, forced here by the clock) whose snapshot work ended
    0.5 s into it is charged 0.5 s, the rest is not the snapshot's; a step the work ran through is
    charged its whole excess."""
    clock = Clock()
    times = StepTimes(clock)
    times.step_ended()  # the job's first step is not timed
    for _ in range(3):
        times.resumed(False)
        clock.now += 1.0
        times.step_ended()
    times.resumed(True)
    began = clock.now
    clock.now += 12.0  # the spike
    times.step_ended(background_ended=began + 0.5)
    assert times.figures() == {"step_s": 1.0, "slowdown_s": 0.5} and times.slowdown_total_s == 0.5
    assert times.uncharged_s == 10.5
    times.resumed(True)
    clock.now += 1.5  # the work still runs at the step's end: all of the 0.5 s beyond a clean step
    times.step_ended(background_ended=None)
    assert times.figures()["slowdown_s"] == 1.0 and times.uncharged_s == 10.5


def test_an_automatic_interval_is_not_lengthened_by_a_load_spike():
    """The pacing's figures, which the ranks agree on and the chooser reads, carry the capped slowdown: a
    spike of 10 s in the step beside a 0.5 s background job leaves the interval where 0.5 s puts it."""
    clock = Clock()
    pacing = SnapshotPacing(_cfg("auto").checkpoint, 0)
    pacing.times = StepTimes(clock)
    pacing.step_ended()
    for _ in range(FIRST_AUTO_STEP):
        pacing.resumed(False)
        clock.now += 1.0
        pacing.step_ended()
    pacing.resumed(True)
    began = clock.now
    clock.now += 11.0
    pacing.step_ended(background_ended=began + 0.5)
    figures = pacing.times.figures()
    assert figures["slowdown_s"] == 0.5
    pacing.next_step = 10
    pacing.taken(10, _settled(5, blocking_s=0.1, waited_s=0.0, background_s=0.5, **figures))
    assert pacing.chooser.every == 38  # (0.1 + 0.5) / (0.8 * 0.02 * 1.0) = 37.5; 10.1 s would give 632


def test_the_front_passes_the_tiers_end_of_background_work_to_the_pacing():
    """`Persistence.after_step` ends the step's timing with when the snapshot's background work ended,
    which caps the step's charge (None: none running, or no snapshots)."""
    from types import SimpleNamespace

    from relaytrain.checkpoint.front import Persistence

    ended = []
    pacing = SimpleNamespace(step_ended=ended.append, due=lambda step: False, resumed=lambda running: None)
    checkpoints = SimpleNamespace(poll=lambda: None, should_save=lambda step, last: False)
    tier = SimpleNamespace(background_ended_at=12.5, background_running=False)
    front = SimpleNamespace(pacing=pacing, checkpoints=checkpoints, enabled=False, snapshots=tier)
    Persistence.after_step(front, 7, False)
    Persistence.after_step(SimpleNamespace(**{**vars(front), "snapshots": None}), 8, False)
    assert ended == [12.5, None]
