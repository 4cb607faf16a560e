"""The rank's one step clock (job/clock.py): one timing per section, read by the progress board, the
metrics' phase times, the straggler windows and the time ledger; nothing else times a step's phases."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from relaytrain.job.clock import StepClock
from relaytrain.job.progress import Phase, ProgressBoard
from relaytrain.job.progress_read import read_record
from relaytrain.monitor import timer as timer_mod
from relaytrain.monitor.timer import StepTimer

SRC = Path(__file__).resolve().parents[1] / "src" / "relaytrain"
# the clock, the board it publishes on, and the start-up's phases before the clock exists (launch, rendezvous)
OWNERS = {"job/clock.py", "job/progress.py", "job/startup.py"}


def _offences(tree: ast.AST, rel: str) -> list[str]:
    """Calls that time or publish a step's phase beside the clock: a board's ``phase(...)``, a CUDA timing
    event, a forward hook."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name = node.func.attr
        if name == "phase" and node.args:
            found.append(f"{rel}:{node.lineno}: publishes a phase (enter a section of the step clock)")
        elif name == "Event" and any(k.arg == "enable_timing" for k in node.keywords):
            found.append(f"{rel}:{node.lineno}: a timing event (the step clock times sections)")
        elif name in ("register_forward_pre_hook", "register_forward_hook"):
            found.append(f"{rel}:{node.lineno}: a forward hook (the step clock's time_alone)")
    return found


def test_nothing_else_times_or_publishes_a_steps_phases():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        if rel not in OWNERS:
            offenders += _offences(ast.parse(path.read_text()), rel)
    assert not offenders, "time a step's phases with relaytrain.job.clock:\n" + "\n".join(offenders)


def test_the_straggler_watch_reads_no_clock_of_its_own():
    """Its phase times and step lengths are the step clock's (the window's gather excluded there)."""
    source = (SRC / "resilience" / "rank" / "straggler_watch.py").read_text()
    tree = ast.parse(source)
    calls = {getattr(n.func, "attr", None) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert not {"perf_counter", "monotonic", "time", "Event"} & calls


@pytest.mark.parametrize(
    "source",
    [
        "board.phase(Phase.DATA)\n",
        "self.progress.phase(phase, budget_s=1.0)\n",
        "e = torch.cuda.Event(enable_timing=True)\n",
        "m.register_forward_pre_hook(f)\n",
    ],
)
def test_the_scan_sees_a_second_clock(source):
    assert _offences(ast.parse(source), "monitor/new.py")


class Alone:
    def __init__(self):
        self.spans, self.steps = [], []

    def alone(self, span):
        self.spans.append((span.phase, span.host_s))

    def step_done(self, step, seconds):
        self.steps.append((step, seconds))


def test_one_section_is_timed_once_and_read_by_every_reader(tmp_path, monkeypatch):
    now = [10.0]
    monkeypatch.setattr(timer_mod.time, "perf_counter", lambda: now[0])
    board = ProgressBoard(tmp_path, rank=0, local_rank=0)
    clock, timer, alone = StepClock(board), StepTimer(), Alone()
    clock.add_reader(timer)
    clock.add_reader(alone)
    for step in (1, 2):
        with clock.section(Phase.DATA, alone=True):
            now[0] += 1.0
            # the first step is one phase on the board (issue 53), later ones show their sections
            expected = Phase.FIRST_STEP if step == 1 else Phase.DATA
            assert read_record(tmp_path / "rank0").phase is expected
        with clock.section(Phase.OPTIMIZER):
            now[0] += 2.0
            with clock.alone():
                now[0] += 0.5
        clock.step_done(step)
        assert read_record(tmp_path / "rank0").phase is Phase.AFTER_STEP
    with clock.section(Phase.CHECKPOINT_SAVE, budget_s=9.0):
        record = read_record(tmp_path / "rank0")
        assert (record.phase, record.budget_s) == (Phase.CHECKPOINT_SAVE, 9.0)
        now[0] += 4.0
    window = timer.window()
    assert (window["data"], window["optimizer"], window["checkpoint"]) == (1.0, 2.5, 2.0)
    assert alone.spans == [(Phase.DATA, 1.0), (Phase.OPTIMIZER, 0.5)] * 2
    assert alone.steps == [(1, None), (2, 3.5)]  # the step's wall time, from the previous step's end
    # the ledger's reading: host seconds per phase so far
    assert clock.seconds() == {Phase.DATA: 2.0, Phase.OPTIMIZER: 5.0, Phase.CHECKPOINT_SAVE: 4.0}
    board.close()


def test_a_section_inside_start_up_or_a_stop_goes_back_to_it(tmp_path):
    board = ProgressBoard(tmp_path, rank=0, local_rank=0)
    clock = StepClock(board)
    with clock.section(Phase.CHECKPOINT_LOAD):
        assert board.phase_now is Phase.CHECKPOINT_LOAD
    assert board.phase_now is Phase.STARTUP
    clock.enter(Phase.STOP)
    with clock.section(Phase.CHECKPOINT_SAVE):
        pass
    assert board.phase_now is Phase.STOP
    board.close()


def test_the_loop_enters_each_section_of_a_step_once(tmp_path, monkeypatch):
    """A real run of three steps, evaluating and saving at step 2: per step one data, one forward/backward
    and one optimizer section, in that order, and the evaluation and the save as their own sections."""
    from relaytrain.config.loader import load_config
    from relaytrain.parallel.distributed import init_distributed
    from relaytrain.trainer import Trainer, prepare_run_dir

    from conftest import TINY

    entered: list[Phase] = []
    section = StepClock.section

    def recording(self, phase, *args, **kwargs):
        entered.append(phase)
        return section(self, phase, *args, **kwargs)

    monkeypatch.setattr(StepClock, "section", recording)
    cfg = load_config(None, [*TINY, f"--run.dir={tmp_path}", "--train.max_steps=3", "--train.eval_every=2",
                             "--checkpoint.interval=2", "--metrics.peak_flops=1e12"])  # fmt: skip
    env = init_distributed(cfg)
    prepare_run_dir(cfg, env.is_main)
    assert Trainer(cfg, env).run() == 0
    step = [Phase.DATA, Phase.FORWARD_BACKWARD, Phase.OPTIMIZER]
    assert entered == [
        Phase.CHECKPOINT_LOAD,  # the restore (nothing to load)
        *step,
        *step,
        Phase.EVALUATION,
        Phase.CHECKPOINT_SAVE,
        *step,
        Phase.EVALUATION,  # the last step evaluates and saves
        Phase.CHECKPOINT_SAVE,
    ]
