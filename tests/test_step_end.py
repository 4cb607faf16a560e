"""The end of a job step (relaytrain.resilience.batch.step_end): every exit code and run_state.json the batch
script can meet gives one action and its reason; performing it writes the records and requeues once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import test_slurm_script
from relaytrain.config.schema import ResilienceConfig
from relaytrain.job import JobFacts, RunDir
from relaytrain.resilience import requeue
from relaytrain.resilience.batch import step_end
from relaytrain.resilience.batch.crash import CrashLog
from relaytrain.resilience.batch.step_end import Action, RunFacts, decide
from relaytrain.resilience.run_state import RunState, RunStateFile
from test_slurm_script import dry, run_script

from conftest import child_env, fake_tool

work = test_slurm_script.work  # the fixture: fake srun/scontrol/sbatch on PATH, cwd in tmp_path

JOB = JobFacts.from_env({"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "2"})
NOT_SLURM = JobFacts.from_env({})
USER_ERR = "UserError('checkpoint save of step 20 failed: no space')"
BUSY = "relaytrain: error: the run directory runs/x is in use by job 7 (...): wait for it to end\n"


def st(status: str, reason: str = "", job_id: str = "41", restart: int = 2, **extra) -> RunState:
    return RunState.from_json(
        {
            "status": status,
            "reason": reason,
            "step": 12,
            "job_id": job_id,
            "restart_count": restart,
            **extra,
        }
    )


FIN, REQ, FAIL = Action.FINISHED, Action.REQUEUE, Action.FAIL
CRASH, LOOP = ("failed", "crash"), ("failed", "crash_loop")
PENDING = {"requeue_pending": True}
# case: (program, exit code, run_state.json, this job's earlier crashes, job log tail, [resilience] keys,
#        job) -> (action, words of the reason, (status, reason) the record writes (None: left as it is))
CASES = {
    "trainer exit 0": (False, 0, st("finished", "max_steps"), 0, "", {}, JOB, FIN, "exited 0", None),
    "killed, under the cap": (False, 137, st("running"), 2, "", {}, JOB, REQ, "crash 3 of this job", CRASH),
    "killed, at the cap": (False, 137, st("running"), 3, "", {}, JOB, FAIL, "max_crash_requeues=3", LOOP),
    "exception": (False, 1, st("failed", "error"), 0, "", {}, JOB, REQ, "(error)", CRASH),
    "hang": (False, 86, st("failed", "hang"), 0, "", {}, JOB, REQ, "(hang)", CRASH),
    "requeue off": (False, 1, st("running"), 0, "", {"requeue": False}, JOB, FAIL, "not requeued", CRASH),
    "outside Slurm": (False, 1, st("running", job_id=""), 0, "", {}, NOT_SLURM, FAIL, "not in SLURM", CRASH),
    "died before writing": (False, 1, st("stopped", job_id="40"), 0, "", {}, JOB, REQ, "start-up", CRASH),
    "config error": (False, 2, None, 0, "", {}, JOB, FAIL, "config or usage error", None),
    "nan": (False, 1, st("failed", "nan"), 0, "", {}, JOB, FAIL, "same data", None),
    "damaged": (False, 1, st("failed", "damaged_checkpoint"), 0, "", {}, JOB, FAIL, "checkpoint files", None),
    "user error": (False, 1, st("failed", "error", message=USER_ERR), 0, "", {}, JOB, FAIL, "no space", None),
    "stopped, requeued": (False, 143, st("stopped", "preemption"), 0, "", {}, JOB, FIN, "stop path", None),
    "stop not requeued": (
        False, 143, st("stopped", "time_budget", **PENDING), 0, "", {}, JOB, REQ, "could not do",
        ("stopped", "time_budget"),
    ),
    "refused run dir": (False, 2, st("running", job_id="7"), 0, BUSY, {}, JOB, FAIL, "in use", None),
    "program exit 0": (True, 0, None, 0, "", {}, JOB, FIN, "exited 0", None),
    "program fails": (True, 1, None, 0, "", {}, JOB, FAIL, "exited 1", None),
    "program killed after its end": (
        True, 140, st("finished", "max_steps"), 0, "", {}, JOB, FIN, "recorded its end", None
    ),
    "program exit 75": (True, 75, None, 0, "", {}, JOB, REQ, "continue it", ("stopped", "program_exit")),
    "program 75, cap": (
        True, 75, None, 0, "", {"max_requeues": 2}, JOB, FAIL, "max_requeues=2", ("stopped", "program_exit")
    ),
    "program's own stop": (True, 75, st("stopped", "cancelled"), 0, "", {}, JOB, FIN, "recorded its", None),
    "program's stop not requeued": (
        True, 75, st("stopped", "time_limit_signal", **PENDING), 0, "", {}, JOB, REQ, "could not do",
        ("stopped", "time_limit_signal"),
    ),
    # the requeue that the run before this one (restart 1) called pending happened after all: Slurm's SIGTERM
    # to the requeued job killed scontrol before it reported it; not requeued again
    "pending, then requeued after all": (
        True, 0, st("stopped", "program_exit", restart=1, **PENDING), 0, "", {}, JOB, FIN, "exited 0", None,
    ),
    "trainer's pending, requeued after all": (
        False, 0, st("stopped", "time_budget", restart=1, **PENDING), 0, "", {}, JOB, FIN, "exited 0", None,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_the_decision_table(case):
    is_program, code, marker, earlier, tail, overrides, job, action, words, record = CASES[case]
    decision = decide(
        code, RunFacts(marker, earlier, tail), ResilienceConfig(**overrides), job, program=is_program
    )
    assert decision.action is action and words in decision.reason, decision
    written = (decision.record.status, decision.record.reason) if decision.record else None
    assert written == record
    assert (decision.crash is not None) == (written is not None and written[1].startswith("crash"))


def test_performing_a_pending_requeue_keeps_the_record_and_says_requeued(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_requeue(requeue_id: str) -> tuple[bool, str]:
        calls.append(requeue_id)
        return True, f"scontrol requeue {requeue_id}"

    monkeypatch.setattr(requeue, "scontrol_requeue", fake_requeue)
    marker = st("stopped", "time_budget", requeue_requested=True, requeue_pending=True, saved=True)
    RunStateFile(RunDir(tmp_path)).write(marker)
    before = RunStateFile(RunDir(tmp_path)).read().as_json()
    env = {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "2"}
    decision = step_end.end_step(RunDir(tmp_path), 143, ResilienceConfig(), env=env)
    assert decision.action is Action.REQUEUE and calls == ["41"]
    after = RunStateFile(RunDir(tmp_path)).read().as_json()
    assert after["requeued"] and not after["requeue_pending"] and after["saved"]
    assert {k: after[k] for k in ("time", "host", "step", "reason")} == {
        k: before[k] for k in ("time", "host", "step", "reason")
    }
    assert (
        "relaytrain: the run asked for a requeue it could not do: scontrol requeue 41"
        in capsys.readouterr().out
    )
    assert not CrashLog(RunDir(tmp_path)).entries()


def test_program_after_step_is_the_same_decision(tmp_path):
    """`python -m relaytrain.program after-step RC`, which batch scripts of earlier versions run."""
    env = {k: v for k, v in child_env().items() if not k.startswith("SLURM_")}
    command = [sys.executable, "-m", "relaytrain.program", "after-step", "75", "--run-dir", str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "relaytrain: exit 75: requeue refused" in done.stdout, done.stderr
    assert RunStateFile(RunDir(tmp_path)).read().reason == "program_exit"
    (event,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert (event["event"], event["reason"], event["requeue_requested"]) == ("stop", "program_exit", False)


def test_the_batch_script_requeues_a_crashed_step_through_the_one_call(work):
    """The rendered script's tail, run with a step that fails: the decision's lines, one requeue."""
    dry("debug", slurm={"gpus_per_node": 0, "tasks_per_node": 1})
    script = Path(work) / "runs/debug/slurm/job.sh"
    text = script.read_text()
    assert "-m relaytrain.resilience.batch.driver --run-dir" in text and "step_end" not in text
    fake_tool(work / "bin", "srun", "exit 3\n")
    fake_tool(
        work / "bin", "scontrol", '[[ $1 == requeue ]] && echo "requeue $2" >> "$FAKE_LOG.requeue"; exit 0\n'
    )
    result = run_script(script, {}, timeout=300)  # pip freeze and two python starts on a busy machine
    assert result.returncode == 3, result.stderr
    assert "crash 1 of this job (the step died before its run wrote run_state.json" in result.stdout
    assert "relaytrain: requeued (scontrol requeue 123)" in result.stdout
    assert "the run asked for a requeue it could not do" not in result.stdout  # requeued once
    assert (work / "fake.requeue").read_text().splitlines() == ["requeue 123"]
    assert RunStateFile(RunDir(work / "runs/debug")).read().requeued is True
