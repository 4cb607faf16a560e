"""The repeat rule (relaytrain.resilience.batch.repeat) through the end-of-step decision: a crash that
reproduces the previous crash of the job (same exception and message at the same step, or the same error at
start-up)
stops it with the cause named, after one reproduction, never requeued; a fault of the machines (a signal,
a lost node, a hang, a broken connection, a full disk) is restarted or requeued however often it comes."""

from __future__ import annotations

import pytest

from relaytrain.config.schema import ResilienceConfig
from relaytrain.job import JobFacts
from relaytrain.resilience.batch import repeat
from relaytrain.resilience.batch.step_end import Action, Restartable, RunFacts, decide
from relaytrain.resilience.batch.step_restart import StepFacts
from relaytrain.resilience.hangs.record import HangRecord
from relaytrain.resilience.run_state import RunState

JOB_ENV = {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "0"}
SHAPE = "RuntimeError('mat1 and mat2 shapes cannot be multiplied (4x64 and 32x64)')"
GLOO = (
    "RuntimeError('[../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
    "Connection closed by peer [10.0.0.2]:51234')"
)
ENOSPC = "OSError(28, 'No space left on device')"
IMPORT_LOG = (
    'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
    "ModuleNotFoundError: No module named 'relaytrain_plugin'\n"
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    "srun: error: n1: task 0: Exited with exit code 1\n"
)
EXITED = "srun: error: n2: task 1: Exited with exit code 1\n"


def job(restart_count: int = 0, step_restarts: int = 0) -> JobFacts:
    return JobFacts.from_env(
        {**JOB_ENV, "SLURM_RESTART_COUNT": str(restart_count), "RELAYTRAIN_STEP_RESTARTS": str(step_restarts)}
    )


def state(j: JobFacts, status: str = "failed", reason: str = "error", step: int = 7, **extra) -> dict:
    return {"status": status, "reason": reason, "step": step, **j.identity(), **extra}


def attempts(fault, n: int = 4, can_restart: bool = True, **resilience) -> list:
    """The decisions after the same fault `n` times in a row in one job: each restart in place runs the
    next step, each requeue the next run; stops at the first decision that ends the job."""
    crashes: list[dict] = []
    decisions = []
    restart_count = step_restarts = 0
    for _ in range(n):
        j = job(restart_count, step_restarts)
        code, recorded, tail, hang = fault(j)
        facts = RunFacts(
            None if recorded is None else RunState.from_json(recorded),
            sum(c["action"] != "restart" for c in crashes),
            tail,
            sum(c["action"] == "restart" for c in crashes),
            hang,
            previous_crash=crashes[-1] if crashes else None,
        )
        step = StepFacts(
            can_restart=can_restart, seconds=120.0, nodes=("n1", "n2"), started=recorded is not None
        )
        decision = decide(code, facts, ResilienceConfig(**resilience), j, restartable=Restartable(step, 2))
        decisions.append(decision)
        if decision.crash is not None:
            crashes.append(dict(decision.crash))
        if decision.action is Action.RESTART:
            step_restarts += 1
        elif decision.action is Action.REQUEUE:
            restart_count, step_restarts = restart_count + 1, 0
        else:
            break
    return decisions


def shape_error(j):
    return 1, state(j, message=SHAPE), EXITED, None


def import_error(j):
    return 1, None, IMPORT_LOG, None


USER_FAULTS = {"shape error at step k": shape_error, "import error at start-up": import_error}


@pytest.mark.parametrize("name", USER_FAULTS)
@pytest.mark.parametrize("can_restart", [True, False])
def test_a_deterministic_crash_stops_after_one_reproduction_with_its_cause_named(name, can_restart):
    decisions = attempts(USER_FAULTS[name], can_restart=can_restart)
    assert len(decisions) == 2, [d.reason for d in decisions]  # the fault, then its one reproduction
    first, last = decisions
    assert first.action is (Action.RESTART if can_restart else Action.REQUEUE)
    assert last.action is Action.FAIL
    assert last.record.reason == repeat.REASON and last.crash["action"] == "fail" and last.crash["repeated"]
    where = "after step 7" if name.startswith("shape") else "at start-up"
    named = (
        "shapes cannot be multiplied" if name.startswith("shape") else "No module named 'relaytrain_plugin'"
    )
    assert f"the same error twice {where}: " in last.reason and named in last.reason
    assert "not restarted: a deterministic fault in the program, data or config" in last.say[0]


@pytest.mark.parametrize(
    "recorded",
    [
        {"reason": "nan"},
        {"reason": "damaged_checkpoint"},
        {"reason": "error", "user_error": "no valid layout for 2 rank(s) on 2 node(s): tp=4"},
    ],
    ids=["nan at step k", "damaged only checkpoint", "impossible config"],
)
def test_user_faults_the_run_records_stop_at_once(recorded):
    decisions = attempts(lambda j: (1, state(j, **recorded), EXITED, None))
    assert [d.action for d in decisions] == [Action.FAIL]


def test_a_config_error_exit_2_stops_at_once():
    assert [d.action for d in attempts(lambda j: (2, None, "", None))] == [Action.FAIL]


def hang(j: JobFacts) -> HangRecord:
    culprit = {"rank": 1, "node": "n2", "phase": "data_fetch", "why": "no heartbeat"}
    line = "hang detected: rank 1 on n2 in data_fetch"
    return HangRecord(j.job_id, j.step_restarts, 7, 0.0, 20.0, 15.0, (culprit,), line, "", j.restart_count)


def died(j: JobFacts, code: int, tail: str):
    """A rank died without a record (run_state.json still says running), `tail` the job log's."""
    return code, state(j, status="running", reason=""), tail, None


INFRA_FAULTS = {
    "rank killed": lambda j: (
        137,
        state(j, status="running", reason=""),
        "srun: error: n2: task 1: Killed\n",
        None,
    ),
    "peer's gloo error": lambda j: (1, state(j, message=GLOO), EXITED, None),
    "node lost": lambda j: (
        1,
        state(j, status="running", reason=""),
        "srun: error: Node failure on n2\n",
        None,
    ),
    "slurmd killed": lambda j: died(j, 143, ""),
    "hang (monitor)": lambda j: (137, state(j, status="running", reason=""), EXITED, hang(j)),
    "hang (watchdog)": lambda j: (86, state(j, reason="hang", message="no step within 15 s"), EXITED, None),
    "disk full on the snapshot dir": lambda j: (1, state(j, message=ENOSPC), EXITED, None),
    "oom-kill": lambda j: (
        1,
        state(j, status="running", reason=""),
        "srun: error: n1: task 0: Out Of Memory\n",
        None,
    ),
    "start-up killed": lambda j: (137, None, "", None),
}


@pytest.mark.parametrize("name", INFRA_FAULTS)
def test_faults_of_the_machines_are_restarted_or_requeued_every_time(name):
    decisions = attempts(INFRA_FAULTS[name], n=5, max_step_restarts=3, max_crash_requeues=3)
    assert len(decisions) == 5, [d.reason for d in decisions]
    assert all(d.action in (Action.RESTART, Action.REQUEUE) for d in decisions), [d.reason for d in decisions]
    assert all(repeat.SIGNATURE_FIELD not in d.crash for d in decisions)


@pytest.mark.parametrize("reason", ["preemption", "time_limit_signal", "time_budget"])
def test_a_preemption_or_the_time_limit_is_the_stop_path_s_requeue_not_a_crash(reason):
    decisions = attempts(
        lambda j: (143, state(j, status="stopped", reason=reason, requeue_requested=True), "", None)
    )
    assert [d.action for d in decisions] == [Action.FINISHED]  # the run requeued itself before it exited
    assert decisions[0].crash is None


def test_a_different_error_or_another_step_is_not_a_repetition():
    seen = iter([(SHAPE, 7), (SHAPE, 9), ("ValueError('bad batch')", 9), ("ValueError('bad batch')", 9)])

    def changing(j):
        message, step = next(seen)
        return 1, state(j, message=message, step=step), EXITED, None

    decisions = attempts(changing, n=4)
    assert [d.action for d in decisions] == [Action.RESTART, Action.RESTART, Action.RESTART, Action.FAIL]


@pytest.mark.parametrize(
    "text, expected",
    [
        (SHAPE, "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x64 and 32x64)"),
        ("KeyError('x')", "KeyError: x"),
        ("StopIteration()", "StopIteration"),
        ("<object at 0xdeadbeef>  broke\n here", "<object at 0x?> broke here"),
    ],
)
def test_an_error_s_signature_text(text, expected):
    assert repeat.from_repr(text) == expected


def test_a_crash_line_of_any_shape_is_no_signature():
    assert not repeat.repeated(repeat.Signature("step", "E: x", 7), {"signature": "garbage"})
    assert repeat.repeated(
        repeat.Signature("step", "E: x", 7), {"signature": {"where": "step", "error": "E: x", "step": 7}}
    )
