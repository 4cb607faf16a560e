"""Restart in place (relaytrain.resilience.batch.step_restart and the end-of-step decision): a crash starts
the job step again inside the allocation while the caps allow, on the nodes left after a node failure,
and falls back to the requeue otherwise; the batch script carries it out with a fresh port."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import test_slurm_script
from relaytrain import program
from relaytrain.config.schema import ResilienceConfig, SlurmConfig
from relaytrain.job import JobFacts, RunDir
from relaytrain.resilience.batch import step_end
from relaytrain.resilience.batch.crash import CrashLog
from relaytrain.resilience.batch.step_end import Action, Restartable, RunFacts, decide
from relaytrain.resilience.batch.step_restart import StepFacts
from relaytrain.resilience.run_state import RunState, RunStateFile
from relaytrain.slurm.script import keeps_job_on_node_failure
from test_slurm_script import dry, run_script

from conftest import fake_tool

work = test_slurm_script.work  # the fixture: fake srun/scontrol/sbatch on PATH, cwd in tmp_path

JOB_ENV = {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "2"}
JOB = JobFacts.from_env(JOB_ENV)
RESTARTED_JOB = JobFacts.from_env(
    {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "2", "RELAYTRAIN_STEP_RESTARTS": "1"}
)
TWO_NODES = ("n1", "n2")


def running(job: JobFacts = JOB) -> dict:
    return {"status": "running", "reason": "", "step": 12, **job.identity()}


def after(code, state, *, job=JOB, restarts=0, crashes=0, step=None, usable=None, min_nodes=1, program=False,
          **resilience):  # fmt: skip
    step = step or StepFacts(can_restart=True, seconds=120.0, nodes=("n1",), started=job.wrote(state))
    facts = RunFacts(None if state is None else RunState.from_json(state), crashes, "", restarts)
    return decide(code, facts, ResilienceConfig(**resilience), job, program=program,
                  restartable=Restartable(step, min_nodes, usable))  # fmt: skip


def test_a_crash_restarts_in_place_under_the_cap():
    decision = after(137, running())
    assert decision.action is Action.RESTART, decision
    assert "restart in place 1 of resilience.max_step_restarts=3" in decision.reason
    assert decision.crash["action"] == "restart" and decision.crash["step_restart"] == 1
    assert decision.restart.nodes == () and decision.restart.lost == ()
    assert (decision.record.status, decision.record.reason) == ("failed", "crash")


@pytest.mark.parametrize(
    "kwargs, action, words",
    [
        ({"restarts": 3}, Action.REQUEUE, "resilience.max_step_restarts=3 reached"),
        ({"restarts": 1, "max_step_restarts": 1, "crashes": 3}, Action.FAIL, "max_step_restarts=1 reached"),
        ({"step": StepFacts(can_restart=False)}, Action.REQUEUE, ""),  # a script of an earlier version
        ({"max_step_restarts": 0}, Action.REQUEUE, ""),
    ],
)
def test_at_the_cap_or_when_the_script_cannot_the_crash_requeues_as_before(kwargs, action, words):
    decision = after(137, running(), **kwargs)
    assert decision.action is action, decision
    assert decision.crash["action"] == action.value
    assert words in decision.crash.get("not_restarted_in_place", "")
    assert (decision.record.reason == "crash_loop") is (action is Action.FAIL)


def test_a_restarted_step_that_fails_again_at_start_up_is_not_restarted_again():
    soon = StepFacts(can_restart=True, seconds=4.0, nodes=("n1",), started=True)
    decision = after(1, running(RESTARTED_JOB), job=RESTARTED_JOB, restarts=1, step=soon)
    assert decision.action is Action.REQUEUE and "4 s after its launch" in decision.say[0], decision
    # died before it wrote run_state.json: the record is the previous step's
    decision = after(1, running(), job=RESTARTED_JOB, restarts=1)
    assert decision.action is Action.REQUEUE and "before it wrote run_state.json" in decision.say[0]
    # a restarted step that ran a while and crashed again is restarted again
    assert after(137, running(RESTARTED_JOB), job=RESTARTED_JOB, restarts=1).action is Action.RESTART


@pytest.mark.parametrize("code, state", [(2, None), (1, {"status": "failed", "reason": "nan"})])
def test_deterministic_failures_are_never_restarted(code, state):
    state = {**running(), **state} if state else None
    assert after(code, state).action is Action.FAIL


def test_a_lost_node_restarts_on_the_nodes_left_when_the_range_allows():
    step = StepFacts(can_restart=True, seconds=300.0, nodes=TWO_NODES, started=True)
    decision = after(137, running(), step=step, usable=["n1"], min_nodes=1)
    assert decision.action is Action.RESTART and decision.restart.nodes == ("n1",), decision
    assert decision.restart.lost == ("n2",) and decision.crash["nodes_lost"] == ["n2"]
    fixed = after(137, running(), step=step, usable=["n1"], min_nodes=2)
    assert fixed.action is Action.REQUEUE and "n2 lost and 1 left" in fixed.say[0], fixed
    # Slurm could not be asked: the same nodes
    assert after(137, running(), step=step, usable=None).restart.nodes == ()


def test_a_program_asks_for_a_restart_in_place_with_exit_76():
    decision = after(76, None, program=True)
    assert decision.action is Action.RESTART and "exited 76" in decision.reason
    assert after(76, None, program=True, max_step_restarts=0).action is Action.REQUEUE
    assert after(1, None, program=True).action is Action.FAIL  # any other failure: as before


def test_performing_a_restart_writes_the_file_the_event_and_the_crash_line(tmp_path, monkeypatch):
    env = JOB_ENV
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # the metrics record's job identity
    RunStateFile(RunDir(tmp_path)).write(RunState.of(**running()))
    restart_file = tmp_path / "restart.txt"
    step = StepFacts(can_restart=True, seconds=60.0, nodes=("n1",))
    decision = step_end.end_step(RunDir(tmp_path), 137, ResilienceConfig(), env=env, step=step,
                                 restart_file=str(restart_file))  # fmt: skip
    assert decision.action is Action.RESTART
    assert restart_file.read_text() == "\n"  # the same nodes
    (event,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert (event["event"], event["step_restart"], event["signal"], event["job_id"]) == (
        "step_restart",
        1,
        "SIGKILL",
        "41",
    )
    (line,) = CrashLog(RunDir(tmp_path)).entries()
    assert (line["action"], line["step_restart"]) == ("restart", 1)
    assert (
        CrashLog(RunDir(tmp_path)).count("41", restarts=True) == 1
        and CrashLog(RunDir(tmp_path)).count("41") == 0
    )


def test_no_kill_is_on_for_node_ranges_and_where_the_config_says():
    assert keeps_job_on_node_failure(SlurmConfig(nodes=4, min_nodes=2))
    assert not keeps_job_on_node_failure(SlurmConfig(nodes=4))
    assert keeps_job_on_node_failure(SlurmConfig(nodes=4, no_kill=True))
    assert not keeps_job_on_node_failure(SlurmConfig(nodes=4, min_nodes=2, no_kill=False))
    assert not keeps_job_on_node_failure(SlurmConfig(nodes=1, no_kill=True))


def test_the_batch_script_starts_a_crashed_step_again_with_a_fresh_port(work):
    text = dry("debug", slurm={"gpus_per_node": 0, "tasks_per_node": 2, "nodes": 2, "min_nodes": 1})
    assert "#SBATCH --no-kill" in text
    script = Path(work) / "runs/debug/slurm/job.sh"
    # The first step is killed before it writes anything, the second ends well.
    fake_tool(work / "bin", "srun",
         'echo "step $RELAYTRAIN_STEP_RESTARTS port $MASTER_PORT args $*" >> "$FAKE_LOG.steps"\n'
         '[[ $RELAYTRAIN_STEP_RESTARTS == 0 ]] && exit 137; exit 0\n')  # fmt: skip
    result = run_script(script, {"SLURM_JOB_NODELIST": "node1"}, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    first, second = (work / "fake.steps").read_text().splitlines()
    assert first.startswith("step 0 port ") and second.startswith("step 1 port ")
    assert first.split()[3] != second.split()[3]  # a fresh rendezvous port
    assert "--overlap" in second and "--overlap" not in first
    assert "restarting the job step in place" in result.stdout
    assert "job step of restart count 0, step restart 1: on node1" in result.stdout
    (line,) = CrashLog(RunDir(work / "runs/debug")).entries()
    assert line["action"] == "restart"


def test_a_program_exiting_76_gets_its_step_started_again(work):
    dry("debug", slurm={"gpus_per_node": 0, "tasks_per_node": 1}, command="python train.py", name="prog")
    script = Path(work) / "runs/prog/slurm/job.sh"
    fake_tool(work / "bin", "srun",
         'echo "step $RELAYTRAIN_STEP_RESTARTS" >> "$FAKE_LOG.steps"\n'
         '[[ $RELAYTRAIN_STEP_RESTARTS == 0 ]] && exit 76; exit 0\n')  # fmt: skip
    result = run_script(script, {"SLURM_JOB_NODELIST": "node1"}, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (work / "fake.steps").read_text().split() == ["step", "0", "step", "1"]
    assert "the program exited 76" in result.stdout
    assert program.EXIT_RESTART_STEP == 76
