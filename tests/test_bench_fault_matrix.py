"""bench.fault_matrix (bench/cluster/fault_matrix_*.py): how a fault trial's records become its decision,
cost and verdict, and how the section is written, on synthetic records (fast, no Slurm)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from bench import fault_matrix
from bench.cluster.fault_matrix_judge import (
    CONTINUED,
    KINDS,
    REFUSED,
    REQUEUE,
    RESTART,
    STOP,
    MatrixTrial,
    decisions_of,
    judge,
    steps_lost,
    summary,
)
from bench.cluster.fault_matrix_kinds import landed_from_log
from bench.cluster.fault_matrix_page import render_section
from bench.cluster.harness import RunFiles
from bench.report import REPO

T0 = 1_795_760_000.0
SHAPE = "the same error twice after step 5: RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x64)"


def crash(action: str, at: float, why: str = "the run failed (error)") -> dict:
    return {"action": action, "time": T0 + at, "why": why, "job_id": "7"}


def stop(reason: str, at: float) -> dict:
    return {"kind": "event", "event": "stop", "reason": reason, "time": T0 + at}


FINISHED = {"status": "finished", "reason": "max_steps", "unix_time": T0 + 60}


def failed(reason: str, message: str = "", **extra) -> dict:
    return {"status": "failed", "reason": reason, "message": message, "unix_time": T0 + 50, **extra}


def judged(kind: str, crashes=(), events=(), steps=range(1, 31), state=FINISHED, landed=1.0, requeues=0):
    trial = MatrixTrial(kind, landed="it landed", landed_at=None if landed is None else T0 + landed)
    return judge(trial, list(crashes), list(events), list(steps), state, requeues)


def test_a_machine_fault_restarted_in_place_with_one_step_replayed_is_right():
    steps = [*range(1, 9), 8, *range(9, 31)]
    trial = judged("rank_killed", [crash("restart", 3)], steps=steps)
    assert (trial.decision, trial.restarts, trial.requeues, trial.steps_lost) == (RESTART, 1, 0, 1)
    assert trial.seconds_to_decision == 2.0 and trial.right, trial.why


@pytest.mark.parametrize(
    "kind, crashes, events, state, steps, requeues, words",
    [
        (
            "hang",
            [crash("restart", 3), crash("fail", 9)],
            [],
            failed("crash_loop"),
            range(1, 9),
            0,
            "false stop",
        ),
        ("rank_killed", [crash("restart", 3)], [], FINISHED, [*range(1, 31), 5, 6], 0, "2 steps lost"),
        ("preemption", [], [stop("preemption", 2)], failed("error"), range(1, 20), 0, "false stop"),
        ("node_lost", [], [], {"status": "running"}, range(1, 9), 0, "not recovered"),
    ],
    ids=["stopped", "two steps lost", "preemption ended failed", "never finished"],
)
def test_a_machine_fault_that_cost_the_job_or_more_than_a_step_is_wrong(
    kind, crashes, events, state, steps, requeues, words
):
    trial = judged(kind, crashes, events, list(steps), state, requeues=requeues)
    assert not trial.right and words in trial.why, trial.why


def test_a_preemption_and_the_time_limit_are_the_stop_path_s_requeue_and_a_full_snapshot_dir_goes_on():
    assert judged("preemption", events=[stop("preemption", 2)]).decision == REQUEUE
    assert judged("time_limit", events=[stop("time_limit_signal", 2)]).right
    full = judged("disk_full")
    assert (full.decision, full.decisions, full.right) == (CONTINUED, [], True)
    # Slurm's own requeue (a node failure) leaves no record of ours: it still counts, as a requeue
    lost = judged("node_lost", requeues=1)
    assert (lost.decision, lost.requeues, lost.right) == (REQUEUE, 1, True)


def test_a_user_fault_stopped_after_one_reproduction_with_its_cause_named_is_right():
    state = failed("repeated_error", SHAPE)
    trial = judged(
        "shape_error", [crash("restart", 2), crash("fail", 20, SHAPE)], state=state, steps=range(1, 6)
    )
    assert (trial.decision, trial.decisions, trial.reproductions) == (STOP, [RESTART, STOP], 1)
    assert trial.seconds_to_decision == 19.0 and trial.cause_named and trial.right, trial.why


def test_the_old_way_a_deterministic_crash_restarted_and_requeued_into_a_crash_loop_is_wrong():
    """What the end-of-step decision did before the repeat rule (and does with it disabled)."""
    loop = [crash("restart", 2 + i) for i in range(3)] + [crash("requeue", 10 + i) for i in range(3)]
    loop.append(crash("fail", 30, "crash 4 of job 7: resilience.max_crash_requeues=3 reached"))
    state = failed(
        "crash_loop", "crash 4 of job 7: ... RuntimeError('mat1 and mat2 shapes cannot be multiplied')"
    )
    trial = judged("shape_error", loop, state=state, requeues=3)
    assert trial.reproductions == 6 and not trial.right and "6 reproductions" in trial.why


@pytest.mark.parametrize(
    "kind, state, events, words",
    [
        ("nan", failed("error", "RuntimeError('boom')"), [], "does not name the cause"),
        ("shape_error", FINISHED, [], "not stopped"),
        (
            "damaged_checkpoint",
            {"status": "stopped", "reason": "preemption"},
            [stop("preemption", 3)],
            "not stopped",
        ),
    ],
)
def test_a_user_fault_not_stopped_or_stopped_without_its_cause_is_wrong(kind, state, events, words):
    trial = judged(kind, events=events, state=state)
    assert not trial.right and words in trial.why, trial.why


def test_a_stop_the_run_recorded_without_a_crash_line_is_the_decision_and_a_planned_stop_is_none():
    state = failed("damaged_checkpoint", "every checkpoint of this run in x is damaged: step_10")
    events = [stop("stop_at_step", -30)]  # the first job's planned end, before the damage
    trial = judged("damaged_checkpoint", events=events, state=state, landed=0.0)
    assert (trial.decisions, trial.reproductions, trial.right) == ([STOP], 0, True), trial.why
    assert decisions_of([], [stop("stop_at_step", 1)], FINISHED) == []
    nan = decisions_of([], [stop("nan", 5)], failed("nan"))
    assert [d[1] for d in nan] == [STOP]  # the stop event and run_state.json: one decision


def test_no_landed_evidence_or_a_failed_trial_is_never_right():
    assert not judged("rank_killed", [crash("restart", 3)], landed=None).right
    trial = MatrixTrial("rank_killed", landed_at=T0, error="timed out waiting for step 8")
    assert not judge(trial, [crash("restart", 3)], [], list(range(1, 31)), FINISHED).right


def test_a_config_refused_at_submission_is_a_stop_before_any_reproduction():
    trial = MatrixTrial("impossible_config", landed_at=T0, final_status=REFUSED)
    trial.message = "relaytrain launch exited 2: plan refused (world size 2 is not divisible by ... tp=4 ...)"
    judge(trial, [], [], [], {})
    assert (trial.decision, trial.reproductions, trial.right) == (STOP, 0, True), trial.why


def test_steps_lost_and_the_landed_line_skip_what_is_no_fault(tmp_path):
    assert steps_lost([1, 2, 3, 3, 4]) == 1 and steps_lost([]) == 0
    run = RunFiles(tmp_path / "run")
    (run.dir.slurm).mkdir(parents=True)
    run.dir.job_log("7").write_text(
        "relaytrain-faults: landed: 0.3 s step delay after step 1 on rank 0 [t=100.5]\n"
        "relaytrain-faults: landed: shape error at step 6 on rank 1 [t=103.25]\n"
    )
    assert landed_from_log(run) == ("shape error at step 6 on rank 1", 103.25)


def test_the_section_is_written_from_the_kept_results_and_says_whether_the_targets_were_met(tmp_path):
    trials = [
        judged("rank_killed", [crash("restart", 3)]),
        judged(
            "shape_error",
            [crash("restart", 2), crash("fail", 20, SHAPE)],
            state=failed("repeated_error", SHAPE),
        ),
    ]
    data = {"command": "python -m bench.fault_matrix", "date": "2026-11-27", "cpu": "cpu", "cores": 2,
            "load": "1/1/1", "summary": summary(trials), "trials": [asdict(t) for t in trials]}  # fmt: skip
    kept = tmp_path / "fault-matrix-x.json"
    kept.write_text(json.dumps(data))
    section = render_section(str(kept))
    assert "`python -m bench.fault_matrix --page-from " in section
    assert "| `shape_error` | user |" in section and "restart → stop" in section
    assert "Verdicts right: **2/2**; false stops: **0**" in section and "**met**" in section
    trials[1].right, trials[1].why = False, "2 reproductions (at most 1)"
    data["trials"] = [asdict(t) for t in trials]
    kept.write_text(json.dumps(data))
    section = render_section(str(kept))
    assert "**wrong**: 2 reproductions" in section and "**missed**" in section
    assert str(REPO.resolve()) + "/" not in render_section(str(kept))


def test_the_command_line_names_the_kinds_and_refuses_unknown_ones(capsys):
    assert fault_matrix.parse_kinds("all") == list(KINDS)
    assert fault_matrix.parse_kinds("nan,hang") == ["nan", "hang"]
    with pytest.raises(SystemExit):
        fault_matrix.main(["--kinds", "nan,meteor"])
    assert "no fault kind meteor" in capsys.readouterr().err


def test_a_later_run_s_trial_of_a_kind_replaces_the_earlier_one_on_the_page(tmp_path):
    wrong = judged("disk_full", landed=None)  # no evidence: wrong
    right = judged("disk_full")
    files = []
    for name, trial in (("a", wrong), ("b", right)):
        data = {"command": f"python -m bench.fault_matrix --kinds disk_full # {name}", "date": "2026-11-27",
                "trials": [asdict(trial), asdict(judged("nan", state=failed("nan")))]}  # fmt: skip
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
        files.append(str(tmp_path / f"{name}.json"))
    section = render_section(files)
    assert section.count("| `disk_full` |") == 1 and "Verdicts right: **2/2**" in section
    assert "# a` on 2026-11-27" in section and "# b` on 2026-11-27" in section
    assert "Verdicts right: **1/2**" in render_section(files[::-1])
