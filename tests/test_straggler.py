"""Straggler detection without a cluster: the statistic, the sustained-window verdict, the action rules,
the rank's watch (timing, gathering, stopping), the stop record and its exit, the status row, the report
plot and the throttle fault's arithmetic."""

from __future__ import annotations

import dataclasses
import json
import random
import time
import types

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from relaytrain.config import load_config
from relaytrain.config.schema import ResilienceConfig
from relaytrain.job import JobFacts, RunDir
from relaytrain.job.clock import StepClock
from relaytrain.job.progress import Phase, ProgressBoard
from relaytrain.monitor.history import build_history
from relaytrain.monitor.rank_plot import plot_rank_times, straggler_lines, work_by_rank
from relaytrain.parallel import parallelize
from relaytrain.parallel.sim_comm import CollectiveCounter
from relaytrain.resilience.batch.step_decision import Action, Restartable, RunFacts, decide
from relaytrain.resilience.batch.step_restart import StepFacts
from relaytrain.resilience.codes import EXIT_STRAGGLER, StopReason
from relaytrain.resilience.rank.straggler import (
    MIN_HOST_PHASE_S,
    MIN_PHASE_S,
    PHASES,
    Straggler,
    StragglerJudge,
    choose_action,
    describe_stragglers,
    phase_floor,
    slower_by,
)
from relaytrain.resilience.rank.straggler_watch import PHASE_NAMES, StragglerWatch
from relaytrain.resilience.requeue import exit_code_for, handle_stop
from relaytrain.resilience.run_state import RunStateFile, RunStatus
from relaytrain.torch_private import fake_store

import faults.throttle as throttle
from conftest import TINY


# phases: data 5 ms, forward 40 ms, optimizer 20 ms (the slow rank's optimizer `factor` times as long)
def window(slow_rank: int | None = None, factor: float = 1.0, ranks: int = 2) -> list[list[float]]:
    return [[0.005, 0.040, 0.020 * (factor if r == slow_rank else 1.0)] for r in range(ranks)]


def feed(judge: StragglerJudge, windows: list[list[list[float]]], every: int = 10, typical=None):
    """Each window's times as its fastest and, unless `typical` gives them apart, its median times."""
    out = []
    for i, times in enumerate(windows):
        out.append(judge.feed(1 + i * every, times, times if typical is None else typical[i]))
    return out


# -- the statistic ----------------------------------------------------------------------------------


def test_each_rank_is_compared_with_the_median_of_the_others():
    times = [[0.005, 0.04, 0.020], [0.005, 0.04, 0.020], [0.005, 0.04, 0.030], [0.005, 0.04, 0.021]]
    slower = slower_by(times)
    assert slower[(2, "optimizer")] == pytest.approx(0.5)  # 30 ms against the others' median of 20
    assert slower[(0, "optimizer")] == pytest.approx(-0.0476, abs=1e-3)  # 20 against 21: faster
    assert abs(slower[(1, "data")]) < 1e-9


def test_a_phase_shorter_than_the_floor_is_not_compared_however_short_the_step():
    short = MIN_PHASE_S / 2
    slower = slower_by([[short, 0.002, 0.002], [3 * short, 0.002, 0.002]])
    assert (1, "data") not in slower and slower[(1, "optimizer")] == 0.0


def test_timed_by_the_host_a_phase_of_a_few_scheduler_slices_is_not_compared():
    """A 6 ms phase 22 % slower in every window (a slice of its core lost to a busy neighbour each time) is
    named from the device's floor and left out from the host's, where a longer phase carries the verdict."""
    times = [[0.0003, 0.030, 0.006], [0.0003, 0.030, 0.006 * 1.22]]
    device = StragglerJudge(0.10, 7, 6, min_phase_s=phase_floor("cuda"))
    host = StragglerJudge(0.10, 7, 6, min_phase_s=phase_floor("cpu"))
    assert (phase_floor("cuda"), phase_floor("cpu")) == (MIN_PHASE_S, MIN_HOST_PHASE_S)
    assert any(named for named, _ in feed(device, [times] * 7))
    assert not any(named for named, _ in feed(host, [times] * 7))
    slow_forward = [[0.0003, 0.030, 0.006], [0.0003, 0.030 * 1.22, 0.006]]
    named = [
        n for n, _ in feed(StragglerJudge(0.10, 7, 6, min_phase_s=MIN_HOST_PHASE_S), [slow_forward] * 7) if n
    ]
    assert [(n.rank, n.phase) for n in named] == [(1, "forward")]


def test_with_pipeline_stages_a_rank_is_compared_with_its_own_stage_only():
    """Stage 0 holds the embedding too: its optimizer phase is 1.4x stage 1's by design, no straggler;
    rank 2, 1.3x slower than the other rank of its stage, is."""
    stages = [0, 0, 1, 1]
    times = [[0.005, 0.040, 0.028], [0.005, 0.040, 0.028], [0.005, 0.040, 0.026], [0.005, 0.040, 0.020]]
    slower = slower_by(times, peers=stages)
    assert slower[(0, "optimizer")] == pytest.approx(0.0) and slower[(2, "optimizer")] == pytest.approx(0.3)
    assert slower_by(times)[(0, "optimizer")] == pytest.approx(0.0769, abs=1e-3)  # one group: against 26 ms
    assert slower_by(times, peers=[0, 1, 2, 2]).keys() == {(r, p) for r in (2, 3) for p in PHASES}  # alone
    level = [[0.005, 0.040, 0.028]] * 2 + [[0.005, 0.040, 0.020]] * 2
    assert not any(n for n, _ in feed(StragglerJudge(0.10, 4, 3, peers=stages), [level] * 8))
    assert any(n for n, _ in feed(StragglerJudge(0.10, 4, 3), [level] * 8))  # as one group: a false report
    named = [n for n, _ in feed(StragglerJudge(0.10, 4, 3, peers=stages), [times] * 8) if n]
    assert [(n.rank, n.phase) for n in named] == [(2, "optimizer")]


def test_one_rank_has_nothing_to_compare_with():
    assert slower_by([[0.1, 0.1, 0.1]]) == {}


# -- the verdict --------------------------------------------------------------------------------------


def test_a_slow_rank_is_named_after_the_sustained_windows_with_its_phase_and_first_step():
    judge = StragglerJudge(threshold=0.15, windows=4, needed=3)
    verdicts = feed(judge, [window(), window(1, 1.3), window(1, 1.3), window(1, 1.3)])
    assert [v[0] for v in verdicts[:3]] == [None, None, None]
    named = verdicts[3][0]
    assert named == Straggler(rank=1, phase="optimizer", slower=pytest.approx(0.3), since_step=11)
    assert named.factor == pytest.approx(1.3)


def test_how_many_windows_must_be_over_can_be_set_apart_from_k():
    judge = StragglerJudge(threshold=0.15, windows=4, needed=2)
    verdicts = feed(judge, [window(), window(), window(1, 1.5), window(1, 1.5)])
    assert [v[0] is not None for v in verdicts] == [False, False, False, True]
    with pytest.raises(ValueError, match="needed must be 1..4 windows, not 5"):
        StragglerJudge(threshold=0.15, windows=4, needed=5)


def test_one_noisy_window_neither_names_nor_restarts_the_count():
    judge = StragglerJudge(threshold=0.15, windows=5, needed=4)
    slow, spike = window(1, 1.3), window(0, 2.0)  # the spike: rank 0 slow for one window, rank 1 not
    verdicts = feed(judge, [window(), slow, slow, spike, window(1, 1.9), slow, slow])
    named = [(i, n) for i, (n, _) in enumerate(verdicts) if n is not None]
    assert [(i, n.rank, n.since_step) for i, n in named] == [(5, 1, 11)]  # 4 of the last 5, not a new streak
    assert named[0][1].slower == pytest.approx(0.3)  # the median: neither the spike nor the 1.9x window


def test_with_the_defaults_a_20_percent_straggler_missed_in_one_window_is_named_within_50_steps():
    defaults = ResilienceConfig()
    judge = StragglerJudge(
        defaults.straggler_threshold, defaults.straggler_windows, defaults.straggler_windows_over
    )
    every = defaults.straggler_every
    windows = [window() if i == 2 else window(1, 1.2) for i in range(20)]  # one noisy window hides it
    named = next(
        (i + 1) * every
        for i, (n, _) in enumerate(feed(judge, windows, every))
        if n is not None and n.rank == 1
    )
    assert named <= 50 - every  # the slowdown began up to a window before the first slow one


@pytest.mark.parametrize("misses", [0, 1, 2, 3])
def test_with_the_defaults_a_20_percent_straggler_is_named_by_s_plus_28_plus_5_a_window_missed(misses):
    """docs/resilience.md's bound: slowed from step S = 32 (the worst place in a window: its window, steps
    31-35, not over), every later window over but `misses` of them, named by S + 28 + 5 per miss."""
    defaults = ResilienceConfig()
    judge, every = (
        StragglerJudge(
            defaults.straggler_threshold, defaults.straggler_windows, defaults.straggler_windows_over
        ),
        5,
    )
    slow = [window(1, 1.2)] * 12
    for i in range(misses):
        slow[1 + 2 * i] = window()
    verdicts = feed(judge, [window()] * 7 + slow, every)
    named = next((i + 1) * every for i, (n, _) in enumerate(verdicts) if n is not None)
    assert named - 32 == 28 + 5 * misses
    assert verdicts[next(i for i, (n, _) in enumerate(verdicts) if n)][0].rank == 1


def test_noise_that_does_not_last_is_never_named():
    judge = StragglerJudge(threshold=0.15, windows=5, needed=4)
    noisy = [window(0, 2.0), window(1, 2.0), window(), window(0, 1.5), window(0, 1.5), window(1, 3.0)]
    assert all(named is None for named, _ in feed(judge, noisy * 3))


def test_a_rank_below_the_threshold_is_not_named():
    judge = StragglerJudge(threshold=0.15, windows=3, needed=2)
    assert all(named is None for named, _ in feed(judge, [window(1, 1.1)] * 10))


@pytest.mark.parametrize("ranks", [2, 4])
def test_equal_ranks_under_seeded_noise_are_never_named_at_the_defaults(ranks):
    """Every rank's window medians vary by lognormal noise (5 %), none is slower: 1000 windows, no name."""
    rng = random.Random(ranks)
    defaults = ResilienceConfig()
    judge = StragglerJudge(
        defaults.straggler_threshold, defaults.straggler_windows, defaults.straggler_windows_over
    )
    for i in range(1000):
        times = [[base * rng.lognormvariate(0, 0.05) for base in (0.005, 0.040, 0.020)] for _ in range(ranks)]
        named, _ = judge.feed(1 + i * defaults.straggler_every, times, times)
        assert named is None, (i, named)


def test_a_rank_slower_only_at_its_fastest_step_is_not_named_its_typical_step_must_agree():
    """On shared cores one rank may catch an idle core now and then: its fastest step beats its peer's
    while their typical steps are alike. Named only when the typical step is slower too."""
    judge = StragglerJudge(threshold=0.15, windows=3, needed=2)
    fastest = [window(1, 1.25)] * 6
    alike = [window(1, 1.02)] * 6
    assert all(named is None for named, _ in feed(judge, fastest, typical=alike))
    judge = StragglerJudge(threshold=0.15, windows=3, needed=2)
    typical = [window(1, 1.0), window(1, 1.2), window(1, 1.3)]  # over in the median of the three, not two
    named = [n for n, _ in feed(judge, fastest[:3], typical=typical)]
    assert named[:2] == [None, None] and named[2] == Straggler(1, "optimizer", pytest.approx(0.25), 1)


def test_an_episode_is_named_once_and_clears_after_as_many_clean_windows():
    judge = StragglerJudge(threshold=0.15, windows=2, needed=2)
    verdicts = feed(judge, [window(1, 1.5)] * 5 + [window()] * 2 + [window(1, 1.5)] * 2)
    named = [i for i, (n, _) in enumerate(verdicts) if n is not None]
    cleared = [i for i, (_, c) in enumerate(verdicts) if c is not None]
    assert named == [1, 8] and cleared == [6]


def test_clearing_mirrors_naming_one_clean_window_keeps_the_episode_one_slow_window_does_not():
    judge = StragglerJudge(threshold=0.15, windows=5, needed=4)
    slow, clean = window(1, 1.5), window()
    verdicts = feed(judge, [slow] * 6 + [clean, slow] + [clean] * 3 + [slow, clean, clean, clean])
    named = [i for i, (n, _) in enumerate(verdicts) if n is not None]
    cleared = [i for i, (_, c) in enumerate(verdicts) if c is not None]
    # named at the 4th slow window; the lone clean window (6) clears nothing; at 10 the last five windows
    # hold one slow one: cleared; the lone slow window (11) names nothing again
    assert named == [3] and cleared == [10]


def test_every_rank_reaches_the_same_verdict_from_the_same_numbers():
    windows = [window(1, 1.4, ranks=4)] * 3
    verdicts = [next(n for n, _ in feed(StragglerJudge(0.15, 3, 2), windows) if n) for _ in range(4)]
    assert len(set(verdicts)) == 1 and verdicts[0].rank == 1


# -- the action ---------------------------------------------------------------------------------------


def straggler(slower: float) -> Straggler:
    return Straggler(rank=1, phase="optimizer", slower=slower, since_step=1)


@pytest.mark.parametrize(
    ("action", "spares", "nodes", "min_nodes", "slower", "expected"),
    [
        ("report", ("n3",), 4, 2, 3.0, "report"),
        ("replace", ("n3",), 2, 0, 0.2, "replace"),
        ("replace", (), 4, 2, 3.0, "report"),  # no spare: named only
        ("auto", ("n3",), 2, 0, 0.2, "replace"),
        ("auto", (), 2, 1, 0.2, "report"),  # 1 node < 2 nodes at 1/1.2 of the pace: kept
        ("auto", (), 2, 1, 1.5, "drop"),  # 1 node > 2 nodes at 1/2.5 of the pace
        ("auto", (), 2, 0, 1.5, "report"),  # a fixed node count never shrinks
        ("auto", (), 2, 2, 1.5, "report"),  # already at the range's bottom
        ("auto", (), 4, 2, 0.5, "drop"),  # 3 > 4 / 1.5
        ("auto", (), 4, 2, 0.3, "report"),  # 3 < 4 / 1.3
    ],
)
def test_the_action_pays_or_the_straggler_is_reported(action, spares, nodes, min_nodes, slower, expected):
    chosen, why = choose_action(action, straggler(slower), spares, nodes, min_nodes)
    assert chosen == expected and why


# -- the rank's watch --------------------------------------------------------------------------------


class FakeMetrics:
    def __init__(self):
        self.events: list[tuple[str, int, dict]] = []
        self.times: list[tuple[int, dict]] = []

    def log_event(self, event, step, **fields):
        self.events.append((event, step, fields))

    def log_rank_times(self, step, values):
        self.times.append((step, values))


def make_watch(monkeypatch, action="report", world=2, threshold=0.15, spares="", device="cpu", stages=None):
    monkeypatch.setenv("RELAYTRAIN_SPARE_NODES", spares)
    resilience = ResilienceConfig(
        straggler_threshold=threshold,
        straggler_every=10,
        straggler_windows=4,
        straggler_windows_over=3,
        straggler_action=action,
    )
    ranks = types.SimpleNamespace(
        rank=0, world_size=world, device=torch.device(device), node="n1", num_nodes=2
    )
    metrics = FakeMetrics()
    watch = StragglerWatch(resilience, ranks, ProgressBoard(None, 0, 0), metrics, 0, stages)
    watch.clock = StepClock(device=torch.device(device))  # the rank's one clock, the watch its reader
    if watch.enabled:
        watch.clock.add_reader(watch)
    return watch, metrics


def forward_s(watch) -> float:
    """The seconds of forward work the clock handed the watch in the step under way."""
    return sum(s.seconds() for s in watch._step_spans if PHASE_NAMES[s.phase] == "forward")


def run_steps(watch, steps, slow_from=None, columns=(2, 6), optimizer_s=1.2 * MIN_HOST_PHASE_S):
    """Gathers answered with this rank's numbers and rank 1's, 1.5x slower from `slow_from` in `columns`
    of the gathered vector (2: the optimizer's median, recorded; 6: its fastest time, judged); this rank's
    optimizer phase sleeps `optimizer_s` (by default above the host's floor: compared)."""
    step_box = [0]

    def gather(mine):
        other = list(mine)
        if slow_from is not None and step_box[0] > slow_from:
            for column in columns:
                other[column] *= 1.5
        return [mine, other]

    watch._gather = gather
    watch._all_node_names = lambda: ["n1", "n2"]
    for step in range(1, steps + 1):
        step_box[0] = step
        with watch.clock.section(Phase.DATA, alone=True):
            pass
        with watch.clock.section(Phase.OPTIMIZER), watch.clock.alone():
            time.sleep(optimizer_s)
        watch._steps.append(0.01)  # a whole step on both ranks: the window counts
        watch.clock.step_done(step)


def test_the_watch_names_the_rank_logs_the_event_and_records_the_times(monkeypatch, caplog):
    watch, metrics = make_watch(monkeypatch)
    with caplog.at_level("WARNING", logger="relaytrain"):
        run_steps(watch, 60, slow_from=10)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("straggler:")]
    assert len(lines) == 1 and lines[0].startswith("straggler: rank 1 on n2 ")
    assert "slower in optimizer since step 11" in lines[0]
    events = [e for e in metrics.events if e[0] == "straggler"]
    assert len(events) == 1
    fields = events[0][2]
    assert {k: fields[k] for k in ("rank", "node", "phase", "since_step", "action")} == {
        "rank": 1, "node": "n2", "phase": "optimizer", "since_step": 11, "action": "report"
    }  # fmt: skip
    assert events[0][1] == 40 and fields["slower"] == pytest.approx(0.5, abs=0.01)
    assert [s for s, _ in metrics.times] == [10, 20, 30, 40, 50, 60]
    assert set(metrics.times[0][1]) == {
        f"rank{r}_{p}_s"
        for r in (0, 1)
        for p in ("data", "forward", "optimizer", "step")
        + ("data_fastest", "forward_fastest", "optimizer_fastest")
    }
    last = metrics.times[-1][1]  # the fastest time is recorded as judged: rank 1's 1.5x rank 0's
    assert last["rank1_optimizer_fastest_s"] == pytest.approx(1.5 * last["rank0_optimizer_fastest_s"])
    assert last["rank0_optimizer_fastest_s"] <= last["rank0_optimizer_s"]
    assert watch.verdict is None  # report: no stop


def test_the_watch_judges_each_windows_fastest_time_not_its_median(monkeypatch):
    """A rank whose median is slow but whose fastest step is not (a shared CPU preempting some steps) is
    recorded slower and not named."""
    watch, metrics = make_watch(monkeypatch)
    run_steps(watch, 80, slow_from=0, columns=(2,))
    assert not [e for e in metrics.events if e[0] == "straggler"]
    last = metrics.times[-1][1]
    assert last["rank1_optimizer_s"] == pytest.approx(1.5 * last["rank0_optimizer_s"])


def test_the_watch_names_no_rank_whose_fastest_step_alone_is_slow(monkeypatch):
    """A rank whose fastest step is slow but whose median is not (its peer caught an idle core now and
    then) is not named either: the median is the typical step the judge asks to agree."""
    watch, metrics = make_watch(monkeypatch)
    run_steps(watch, 80, slow_from=0, columns=(6,))
    assert not [e for e in metrics.events if e[0] == "straggler"]


def test_a_watch_on_cpu_leaves_out_a_phase_under_the_hosts_floor_and_one_on_cuda_would_not(monkeypatch):
    watch, metrics = make_watch(monkeypatch)
    run_steps(watch, 60, slow_from=10, optimizer_s=MIN_HOST_PHASE_S / 3)  # rank 1 1.5x slower, but short
    assert not [e for e in metrics.events if e[0] == "straggler"]
    assert metrics.times[-1][1]["rank1_optimizer_fastest_s"] > MIN_PHASE_S  # compared from a device's floor
    assert make_watch(monkeypatch, device="cuda")[0].judge.min_phase_s == MIN_PHASE_S


def test_under_a_pipeline_the_record_keeps_each_ranks_stage_and_the_replay_judges_by_it(monkeypatch):
    """Stage 1's ranks take 1.4x stage 0's optimizer time by design: no straggler, and the records, which
    keep the stages, replay to none; without the stages they would name one."""
    from bench.straggler_rules import Rule, replay

    watch, metrics = make_watch(monkeypatch, world=4, stages=[0, 0, 1, 1])
    watch._gather = lambda mine: [mine, mine, [1.4 * v for v in mine], [1.4 * v for v in mine]]
    watch._all_node_names = lambda: ["n1", "n1", "n2", "n2"]
    for step in range(1, 81):
        with watch.clock.section(Phase.OPTIMIZER), watch.clock.alone():
            time.sleep(1.2 * MIN_HOST_PHASE_S)
        watch._steps.append(0.01)
        watch.clock.step_done(step)
    assert not [e for e in metrics.events if e[0] == "straggler"]
    records = [{**times, "step": step} for step, times in metrics.times]  # as metrics.jsonl keeps them
    assert all(r["stages"] == [0, 0, 1, 1] for r in records) and len(records) == 8
    rule = Rule(0.15, 4, 3)
    assert replay(rule, records, 10, ranks=4) == []
    assert replay(rule, [{k: v for k, v in r.items() if k != "stages"} for r in records], 10, ranks=4)


def test_a_replace_verdict_stops_after_the_next_snapshot(monkeypatch):
    watch, _ = make_watch(monkeypatch, "replace", spares="n3")
    run_steps(watch, 40, slow_from=10)
    assert watch.verdict is not None and watch.verdict["action"] == "replace"
    assert set(watch.verdict) == {"rank", "node", "phase", "slower", "since_step", "action"}


def test_the_supervision_front_stops_for_a_verdict_after_the_next_snapshot_or_at_once(monkeypatch, tmp_path):
    """The straggler's stop policy (the supervision front's, not the loop's): a replace/drop verdict stops
    every rank once a snapshot or checkpoint of the step is taken, at once when the run takes neither by
    itself, never at the last step; no verdict, no stop."""
    from relaytrain.config import Config
    from relaytrain.resilience.rank.supervision import Supervision

    cfg = load_config(None, [*TINY, "--train.max_steps=50", "--resilience.straggler_threshold=0.15"])
    assert isinstance(cfg, Config)
    env = types.SimpleNamespace(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"), node="n1",
                                num_nodes=2)  # fmt: skip
    front = Supervision(cfg, env, RunDir(tmp_path))
    front.watch(FakeMetrics())
    try:
        assert front.straggler.enabled

        def saving(by_itself, saved_step):
            return types.SimpleNamespace(saves_by_itself=by_itself, saved_step=saved_step,
                                         save_seconds_estimate=lambda: 0.0)  # fmt: skip

        none = StopReason.NONE
        assert front.agree_after(45, none, False, saving(True, 45)) == none  # no verdict
        front.straggler.verdict = {"rank": 1, "action": "replace"}
        assert front.agree_after(40, none, False, saving(True, 35)) == none  # waits for the snapshot
        assert front.agree_after(45, none, False, saving(True, 45)) == StopReason.STRAGGLER
        assert front.agree_after(41, none, False, saving(False, -1)) == StopReason.STRAGGLER  # stop saves
        assert front.agree_after(50, none, False, saving(False, -1)) == none  # the last step: finished
    finally:
        front.leave()


def test_replace_without_a_spare_only_reports(monkeypatch):
    watch, metrics = make_watch(monkeypatch, "replace")
    run_steps(watch, 40, slow_from=10)
    assert watch.verdict is None
    assert [e[2]["action"] for e in metrics.events if e[0] == "straggler"] == ["report"]


@pytest.mark.parametrize(
    ("world", "threshold", "stages"), [(1, 0.15, None), (2, 0.0, None), (2, 0.15, [0, 1])]
)
def test_the_watch_is_off_for_one_rank_threshold_zero_or_no_peer(monkeypatch, world, threshold, stages):
    """[0, 1]: a pipeline of two stages of one rank each: no rank has a peer doing its work."""
    watch, metrics = make_watch(monkeypatch, world=world, threshold=threshold, stages=stages)
    watch._gather = lambda mine: pytest.fail("an off watch gathered")
    for step in range(1, 31):
        with watch.clock.section(Phase.OPTIMIZER), watch.clock.alone():
            pass
        watch.clock.step_done(step)
        watch.step_done(step)
    assert not watch.enabled and metrics.times == [] and watch._pending == []


class FakeEvent:
    def __init__(self, enable_timing=False):
        self.t = None
        self.done = True

    def record(self, stream=None):
        self.t = FakeEvent.now

    def query(self):
        return self.done

    def elapsed_time(self, end):
        return (end.t - self.t) * 1000.0


def test_on_cuda_the_watch_reads_only_completed_events_and_never_waits(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("the watch waited for the device"))
    watch, _ = make_watch(monkeypatch, device="cuda")
    clock = watch.clock
    FakeEvent.now = 0.0
    with clock.section(Phase.OPTIMIZER), clock.alone():
        FakeEvent.now += 0.25
    clock.step_done(1)
    with clock.section(Phase.FORWARD_BACKWARD), clock.alone():
        FakeEvent.now += 0.5
    with clock.section(Phase.OPTIMIZER), clock.alone():
        FakeEvent.now += 0.5
    clock.step_done(2)
    watch._pending[-1][0].end.done = False  # step 2's first event still queued on the device: all of it waits
    watch._resolve_events()
    assert watch._times["optimizer"] == [0.25] and watch._times["forward"] == []
    assert len(watch._pending) == 1


def test_a_phase_timed_in_parts_is_one_time_per_step_without_the_forwards_of_an_evaluation(monkeypatch):
    """The forward phase is every timed module's forward in the step, summed; a forward without gradients
    (an evaluation between steps) is no training step's work."""
    clock = iter(float(i) for i in range(1000))  # each reading of the clock one second later
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    watch, _ = make_watch(monkeypatch)
    layers = [torch.nn.Linear(4, 4) for _ in range(3)]
    watch.clock.time_alone(layers)
    x = torch.ones(1, 4)
    for _ in range(2):  # two micro batches
        for layer in layers:
            layer(x)
    with torch.no_grad():
        for layer in layers:
            layer(x)
    watch.clock.step_done(1)
    watch._resolve_events()
    assert watch._times["forward"] == [6.0]  # six forwards of one second each, one time for the step


def test_the_modules_timed_as_forward_are_the_layers_compute_and_none_where_a_clock_would_mislead():
    """Each layer's attention and feed-forward and the output projection: no collective inside them
    without tensor or context parallelism (with them, and under compile: the next tests)."""
    cfg = load_config(None, TINY)
    model = parallelize(cfg.parallel, cfg.model, cfg.train, torch.device("cpu"), 1, 0, 1, seed=0)
    timed = model.work_modules()
    assert sorted(type(m).__name__ for m in timed) == sorted(
        ["Attention", "FeedForward"] * cfg.model.n_layers + ["Linear"]
    )
    (part,) = model.model_parts
    assert part.output in timed


@pytest.mark.parametrize("ac", ["none", "full"])
def test_under_compile_each_compiled_layer_is_timed_and_still_runs_compiled(monkeypatch, ac):
    """A clock in a hook inside a compiled block would be traced, not run: the watch times each compiled
    layer as a whole from hooks Dynamo runs eagerly, and the layers still run their one compiled graph
    (fullgraph: a hook that broke the graph would be an error). None with TP under compile."""
    from test_compile_blocks import CountingBackend

    backend = CountingBackend()
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *a, **k: compile_(*a, **{**k, "backend": backend}))
    torch._dynamo.reset()
    try:
        cfg = load_config(
            None, [*TINY, "--parallel.compile=true", f"--parallel.activation_checkpointing={ac}"]
        )
        model = parallelize(cfg.parallel, cfg.model, cfg.train, torch.device("cpu"), 1, 0, 1, seed=0)
        (part,) = model.model_parts
        timed = model.work_modules()
        assert timed == [*part.layers.values(), part.output]
        watch, _ = make_watch(monkeypatch)
        watch.clock.time_alone(timed, compiled=True)
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len + 1))
        for _ in range(2):
            before, watch._step_spans = backend.calls, []
            model.train_step(tokens[:, :-1], tokens[:, 1:])
            assert backend.calls - before >= cfg.model.n_layers, "a layer ran eagerly"
            assert forward_s(watch) > 0
        assert backend.graphs <= 2
    finally:
        torch._dynamo.reset()
    model.dims = dataclasses.replace(model.dims, tp=2)
    assert model.work_modules() == []


class CollectivesWhileTimed(CollectiveCounter):
    """Counts the collectives, and names those that run while the watch's forward clock runs."""

    def __init__(self, watch: StragglerWatch):
        super().__init__()
        self.watch, self.while_timed = watch, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        plain = not any(t == DTensor for t in types)
        if plain and func.namespace in ("c10d", "_c10d_functional") and self.watch.clock._forward_begun:
            self.while_timed.append(func.__name__)
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.parametrize(
    "layout, world",
    [
        (["--parallel.tp=2"], 2),
        (["--parallel.tp=2", "--parallel.loss_parallel=false"], 2),
    ],
)
def test_under_tensor_and_context_parallelism_no_collective_runs_while_the_forward_is_timed(
    monkeypatch, layout, world
):
    """Under TP the timed modules are the layers' linear layers and the output projection, their clock
    stopped before TP's output redistribution: a rank waiting there for a slower peer would look as slow
    as it. One rank of a fake process group runs a training step; the collectives the layout needs run,
    none of them on the clock, and the forward is timed. (Context parallelism, which needs CUDA, times
    the same modules: the next test.)"""
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world)
    try:
        cfg = load_config(None, [*TINY, *layout])
        model = parallelize(cfg.parallel, cfg.model, cfg.train, torch.device("cpu"), world, 0, world, seed=0)
        watch, _ = make_watch(monkeypatch, world=world)
        timed = model.work_modules()  # each layer's 7 linear layers and the output projection
        assert len(timed) == 7 * cfg.model.n_layers + 1 and all(isinstance(m, torch.nn.Linear) for m in timed)
        watch.clock.time_alone(timed)
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len + 1))
        with CollectivesWhileTimed(watch) as counter:
            model.train_step(tokens[:, :-1], tokens[:, 1:])
    finally:
        dist.destroy_process_group()
    assert counter.calls, "the layout ran no collective: nothing was checked"
    assert counter.while_timed == []
    assert forward_s(watch) > 0


def test_under_context_parallelism_the_linear_layers_are_timed_not_the_attention():
    """Context parallelism (CUDA only) exchanges keys and values inside each layer's attention: its
    dimensions set on a CPU model, the same modules as under TP are timed."""
    cfg = load_config(None, TINY)
    model = parallelize(cfg.parallel, cfg.model, cfg.train, torch.device("cpu"), 1, 0, 1, seed=0)
    model.dims = dataclasses.replace(model.dims, cp=2)
    timed = model.work_modules()
    assert len(timed) == 7 * cfg.model.n_layers + 1 and all(isinstance(m, torch.nn.Linear) for m in timed)


# -- the stop record, its exit, and the decision after the step -------------------------------------------


SLURM_ENV = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0"}


def test_a_straggler_stop_records_its_fields_and_exits_89(tmp_path):
    run = RunDir(tmp_path)
    fields = {
        "rank": 1,
        "node": "n2",
        "phase": "optimizer",
        "slower": 0.5,
        "since_step": 11,
        "action": "replace",
    }
    code = handle_stop(
        ResilienceConfig(), run, StopReason.STRAGGLER, 40, 0, env=SLURM_ENV, facts={"straggler": fields}
    )
    assert code == EXIT_STRAGGLER == exit_code_for(StopReason.STRAGGLER) == 89
    raw = json.loads(run.run_state.read_text())
    assert raw["status"] == "stopped" and raw["reason"] == "straggler" and raw["straggler"] == fields
    assert raw["requeue_requested"] is False  # the batch job's driver acts, not a requeue
    state = RunStateFile(run).read()
    assert state.status is RunStatus.STOPPED
    # The step's end reads the record (not the exit code, which torchrun may rewrite): a spare takes the
    # straggler's node's place in a restart in place, recorded as a straggler, not a crash.
    step = StepFacts(can_restart=True, seconds=60.0, nodes=("n1", "n2"))
    restartable = Restartable(step, min_nodes=2, usable_nodes=["n1", "n2"], spares=("n3",))
    job = JobFacts.from_env(SLURM_ENV)
    decision = decide(1, RunFacts(state, 0, ""), ResilienceConfig(), job, restartable=restartable)
    assert decision.action is Action.RESTART and decision.restart.replaced == (("n2", "n3"),)
    assert decision.crash["kind"] == "straggler"


# -- what the user sees ------------------------------------------------------------------------------


def records_with_a_straggler() -> list[dict]:
    base = {"time": 1.0, "job_id": None, "restart": 0}
    out = [{"kind": "event", "step": 0, "event": "start", **base}]
    for step in (10, 20, 30, 40):
        slow = 1.5 if step > 10 else 1.0
        times = {"rank0_data_s": 0.001, "rank0_optimizer_s": 0.01, "rank0_step_s": 0.1}
        times |= {"rank1_data_s": 0.001, "rank1_optimizer_s": 0.01 * slow, "rank1_step_s": 0.1}
        times |= {f"rank{r}_optimizer_fastest_s": 0.009 for r in (0, 1)}  # the plot sums medians only
        out.append({"kind": "rank_times", "step": step, **base, **times})
        out.append({"kind": "train", "step": step, "loss": 1.0, **base})
    fields = {
        "rank": 1,
        "node": "n2",
        "phase": "optimizer",
        "slower": 0.5,
        "since_step": 11,
        "action": "report",
    }
    out.append({"kind": "event", "step": 40, "event": "straggler", **fields, **base})
    return out


def test_status_shows_each_named_rank_and_when_it_cleared():
    records = records_with_a_straggler()
    (text,) = describe_stragglers(records)
    assert text == "rank 1 on n2 50% slower in optimizer since step 11 (named at step 40, action report)"
    cleared = {"kind": "event", "step": 70, "event": "straggler_cleared", "rank": 1}
    assert describe_stragglers([*records, cleared])[0].endswith("; cleared at step 70")
    assert describe_stragglers(records[:-1]) == []
    # a second rank named later (a loaded node) is listed beside the first, and clearing one rank does
    # not clear the other
    other = {**records[-1], "rank": 0, "node": "n1", "step": 60, "phase": "forward"}
    other_cleared = {**cleared, "rank": 0, "step": 80}
    both = describe_stragglers([*records, other, other_cleared])
    assert [line.split(" (")[0] for line in both] == [
        "rank 1 on n2 50% slower in optimizer since step 11",
        "rank 0 on n1 50% slower in forward since step 11",
    ]
    assert "cleared" not in both[0] and both[1].endswith("; cleared at step 80")


def test_the_report_plots_each_rank_and_lists_the_straggler(tmp_path):
    history = build_history(records_with_a_straggler())
    series = work_by_rank(history)
    assert series[1][0] == [10, 20, 30, 40] and series[1][1][-1] == pytest.approx(16.0)
    assert plot_rank_times(history, "run", tmp_path / "rank_times.png").stat().st_size > 0
    lines = straggler_lines(history)
    assert "## Stragglers" in lines and any(
        "| 40 | 1 | n2 | optimizer | 50 % | 11 | report |" in x for x in lines
    )


# -- the throttle fault's arithmetic ---------------------------------------------------------------------


def test_the_throttle_quota_makes_the_compute_threads_factor_times_slower():
    assert throttle.quota_us(2.0, 1, 2000) == (1000, 2000)
    assert throttle.quota_us(1.25, 2, 2000) == (3200, 2000)
    # a quarter of a CPU is 500 us of 2 ms, under the kernel's 1 ms minimum: the period widens instead
    assert throttle.quota_us(4.0, 1, 2000) == (1000, 4000)
    with pytest.raises(ValueError):
        throttle.quota_us(0.5, 1)


def test_the_throttle_weight_gives_the_rank_a_factor_smaller_share_of_a_busy_cpu():
    assert throttle.weight(4.0, throttle.V1_SHARES) == 256
    assert throttle.weight(2.0, throttle.V2_WEIGHT) == 50
    assert throttle.weight(1000.0, throttle.V1_SHARES) == 2  # the kernel's smallest


def test_the_throttle_finds_a_jobs_rank_from_proc(tmp_path):
    def proc(pid, env, cmd):
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "environ").write_bytes(b"\0".join(e.encode() for e in env))
        (d / "cmdline").write_bytes(b"\0".join(c.encode() for c in cmd))

    train = ["python", "-m", "relaytrain.cli", "train", "cfg.toml"]
    proc(10, ["SLURM_JOB_ID=5", "RANK=1"], ["python", "-m", "relaytrain.job.torchrun", *train])
    proc(11, ["SLURM_JOB_ID=5", "RANK=0"], train)
    proc(12, ["SLURM_JOB_ID=6", "RANK=1"], train)
    proc(13, ["SLURM_JOB_ID=5", "RANK=1"], train)
    assert throttle.rank_pid("5", 1, tmp_path) == 13
    assert throttle.rank_pid("5", 2, tmp_path) is None


# -- the trainer acts on a verdict ---------------------------------------------------------------------


@pytest.mark.parametrize(("interval", "stop_step"), [(4, 4), (0, 1)])
def test_the_trainer_stops_after_the_next_checkpoint_for_a_verdict_and_exits_89(
    tmp_path, interval, stop_step
):
    """A replace verdict (as every rank reaches it from the gathered times) stops the loop at the first
    step a checkpoint is saved (at once when the run saves none by itself), records it and exits 89."""
    from relaytrain.config.loader import load_config
    from relaytrain.parallel.distributed import init_distributed
    from relaytrain.trainer import Trainer, prepare_run_dir

    from conftest import TINY

    cfg = load_config(None, [*TINY, f"--run.dir={tmp_path}", "--run.name=acts", "--train.max_steps=12",
                             f"--checkpoint.interval={interval}", "--metrics.peak_flops=1e12"])  # fmt: skip
    env = init_distributed(cfg)
    prepare_run_dir(cfg, env.is_main)
    trainer = Trainer(cfg, env)
    verdict = {"rank": 1, "node": "n2", "phase": "optimizer", "slower": 0.5, "since_step": 1}
    trainer.supervision.straggler.verdict = {**verdict, "action": "replace"}
    assert trainer.run() == EXIT_STRAGGLER
    run = RunDir(tmp_path / "acts")
    raw = json.loads(run.run_state.read_text())
    assert (raw["status"], raw["reason"], raw["step"]) == ("stopped", "straggler", stop_step)
    assert raw["straggler"] == {**verdict, "action": "replace"}
    saved = sorted(p.name for p in run.checkpoints.glob("step_*"))
    assert saved == [f"step_{stop_step}"]  # the checkpoint the stop waited for, once
