"""Spare nodes and bad nodes, the fast side: the restart plan puts an idle spare in a failed, excluded or
straggling node's position; the straggler verdict's decision; which nodes a failure implicates and when
one is excluded; the job script's sbatch/srun options and the driver's placement; launch's refusals."""

from __future__ import annotations

import re

import pytest

from relaytrain.config import load_config
from relaytrain.config.schema import ResilienceConfig
from relaytrain.errors import UserError
from relaytrain.inspection.run_view import run_rows
from relaytrain.job import JobFacts, RunDir
from relaytrain.resilience import requeue
from relaytrain.resilience.batch import bad_nodes, step_end
from relaytrain.resilience.batch.crash import CrashLog, describe_crash
from relaytrain.resilience.batch.driver import StepLaunch
from relaytrain.resilience.batch.step_decision import Action, Restartable, RunFacts, decide
from relaytrain.resilience.batch.step_restart import StepFacts, plan_restart
from relaytrain.resilience.run_state import RunState, RunStateFile
from relaytrain.slurm.script import JobSpec, render_script, sbatch_options

from conftest import REPO

JOB_ENV = {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "0", "RELAYTRAIN_SPARE_NODES": "n3"}
JOB = JobFacts.from_env(JOB_ENV)
TWO = StepFacts(can_restart=True, seconds=300.0, nodes=("n1", "n2"), started=True)
R = ResilienceConfig()


def plan(step=TWO, usable=("n1", "n2", "n3"), spares=("n3",), min_nodes=2, excluded=()):
    return plan_restart(step, 0, R, JOB, min_nodes=min_nodes, usable_nodes=list(usable), excluded=excluded,
                        excluded_why="why", spares=spares)  # fmt: skip


def test_a_spare_takes_a_lost_nodes_position_same_count():
    restart, why = plan(usable=("n1", "n3"))
    assert restart is not None and restart.nodes == ("n1", "n3") and restart.lost == ("n2",), why
    assert restart.replaced == (("n2", "n3"),)
    assert restart.describe() == "on 2 node(s) (n1,n3): spare n3 in place of n2; lost: n2"
    first, _ = plan(usable=("n2", "n3"))  # the first node lost: the spare is rank 0's node now
    assert first.nodes == ("n3", "n2")


def test_without_a_spare_today_s_behaviour():
    assert plan(usable=("n1",), spares=())[0] is None  # fixed count: requeue
    assert "no idle spare left" in plan(usable=("n1",), spares=("n2",))[1]  # the spare is the lost one
    restart, _ = plan(usable=("n1",), spares=(), min_nodes=1)
    assert restart.nodes == ("n1",) and restart.replaced == ()
    assert plan(usable=("n1", "n2"), spares=("n3",))[0].nodes == ()  # nothing lost: the same nodes


def test_an_excluded_node_goes_to_a_spare_and_an_excluded_spare_is_never_used():
    restart, _ = plan(excluded={"n1"})
    assert restart.nodes == ("n3", "n2") and restart.left_out == ("n1",) and restart.lost == ()
    kept, _ = plan(excluded={"n1", "n3"})  # the only spare is excluded too: n1 kept, the plan says so
    assert kept.nodes == () and kept.kept.startswith("kept: n1, why")


def test_two_lost_nodes_one_spare_shrinks_only_where_the_range_allows():
    three = StepFacts(can_restart=True, seconds=300.0, nodes=("n1", "n2", "n4"), started=True)
    assert plan(three, usable=("n1", "n3"), min_nodes=3)[0] is None
    restart, _ = plan(three, usable=("n1", "n3"), min_nodes=2)
    assert restart.nodes == ("n1", "n3") and restart.replaced == (("n2", "n3"),)


def test_implicated_nodes_hang_culprits_else_lost_else_the_first_dead_task():
    hang = {"hang": {"culprits": [{"node": "n2"}, {"node": "n2"}, {"node": 3}]}}
    assert bad_nodes.implicated_nodes(hang, ("n1",)) == ("n2",)
    tasks = {
        "failed_tasks": [{"node": "n1", "what": "Exited with exit code 1"}, {"node": "n2", "what": "Killed"}]
    }
    assert bad_nodes.implicated_nodes(tasks, ("n2",)) == ("n2",)
    assert bad_nodes.implicated_nodes(tasks) == ("n1",)
    assert bad_nodes.implicated_nodes({"failed_tasks": "x"}) == ()


def test_a_step_slurm_cancelled_implicates_no_node():
    """A cancellation (Slurm's, or one it delivered late to the next step of the same id after a requeue)
    kills every task: the first node srun lists did not fail on its own (the elastic Slurm test's run of
    2026-12-07 left a healthy node out for it, as its second failure). A rank killed alone still
    implicates its node, though srun reports the others killed after it."""
    from relaytrain.resilience.batch.crash import cause_of

    log = (
        "slurmstepd-nsnode4: error: *** STEP 2.0 ON nsnode4 CANCELLED AT 2026-12-07T05:18:01 ***\n"
        "srun: error: nsnode5: tasks 2-3: Killed\nsrun: error: nsnode4: tasks 0-1: Killed\n"
    )
    cancelled = cause_of(137, "start-up", None, log)
    assert cancelled["step_cancelled"] and bad_nodes.implicated_nodes(cancelled) == ()
    killed = cause_of(137, "start-up", None, log.split("\n", 1)[1])  # the same deaths, no cancellation
    assert not killed["step_cancelled"] and bad_nodes.implicated_nodes(killed) == ("nsnode5",)
    assert bad_nodes.implicated_nodes(cancelled, ("nsnode5",)) == ("nsnode5",)  # a lost node still is


def test_a_node_implicated_twice_in_one_job_is_excluded():
    entries = [
        {"job_id": "41", "nodes_implicated": ["n2"]},
        {"job_id": "40", "nodes_implicated": ["n1"]},
        {"job_id": "41", "hang": {"culprits": [{"node": "n1"}]}},  # a line of an earlier version
        {"job_id": "41", "nodes_implicated": "n1"},  # damaged: counts nothing
    ]
    assert bad_nodes.job_implicated(entries, "41") == ("n2", "n1")
    assert bad_nodes.exclusions(["n2", "n1"], 2) == {}
    excluded = bad_nodes.exclusions(["n2", "n1", "n2"], 2)
    assert list(excluded) == ["n2"] and excluded["n2"].count == 2
    assert bad_nodes.exclusions(["n2"] * 5, 0) == {}  # 0: never


@pytest.fixture
def run(tmp_path, monkeypatch) -> RunDir:
    for key, value in JOB_ENV.items():
        monkeypatch.setenv(key, value)
    return RunDir(tmp_path / "run")


def stopped_for_straggler(run: RunDir, action: str, node: str = "n2") -> None:
    verdict = {"rank": 1, "node": node, "phase": "forward/backward", "slower": 2.5, "since_step": 30,
               "action": action}  # fmt: skip
    RunStateFile(run).write(RunState.of("stopped", "straggler", 40, **JOB.identity(), straggler=verdict))


def straggler_decision(run, usable=("n1", "n2", "n3"), spares=("n3",), min_nodes=2, exit_code=89, **r):
    restartable = Restartable(TWO, min_nodes, list(usable), spares)
    return decide(exit_code, RunFacts.read(run, JOB), ResilienceConfig(**r), JOB, restartable=restartable)


def test_a_straggler_to_replace_restarts_in_place_with_the_spare_and_is_no_crash(run):
    stopped_for_straggler(run, "replace")
    decision = straggler_decision(run, exit_code=1)  # torchrun rewrote the exit code: the record decides
    assert decision.action is Action.RESTART and decision.restart.nodes == ("n1", "n3"), decision
    assert "a straggler (rank 1 on n2 2.5x slower in forward/backward)" in decision.reason
    assert "spare n3 in place of n2" in decision.reason
    step_end.perform(decision, JOB, run)
    (entry,) = CrashLog(run).entries()
    assert (entry["kind"], entry["action"], entry["nodes_replaced"]) == (
        "straggler",
        "restart",
        [["n2", "n3"]],
    )
    assert CrashLog(run).count("41") == 0 and CrashLog(run).count("41", restarts=True) == 1
    assert RunStateFile(run).read().reason == "straggler"
    assert describe_crash(entry).startswith("straggler at step 40: rank 1 on n2 2.5x slower")


def test_a_straggler_to_drop_restarts_on_the_nodes_left_where_the_range_allows(run):
    stopped_for_straggler(run, "drop")
    assert straggler_decision(run, min_nodes=1).restart.nodes == ("n1",)
    kept = straggler_decision(run, min_nodes=2)  # the range does not allow: the same nodes, said why
    assert kept.action is Action.RESTART and kept.restart.nodes == () and "kept: n2" in kept.reason


def test_a_second_straggler_verdict_without_a_spare_requeues_excluding_the_node_instead_of_looping(
    run, monkeypatch
):
    stopped_for_straggler(run, "replace")
    first = straggler_decision(run, spares=())
    assert first.action is Action.RESTART and "no idle spare to replace n2" in first.reason
    step_end.perform(first, JOB, run)
    again = straggler_decision(run, spares=())
    assert again.action is Action.REQUEUE and again.exclude == ("n2",), again
    asked = []
    monkeypatch.setattr(
        requeue, "scontrol_requeue", lambda job_id, exclude=(): asked.append(exclude) or (True, "")
    )
    step_end.perform(again, JOB, run)
    assert asked == [("n2",)] and CrashLog(run).entries()[-1]["action"] == "requeue"
    assert CrashLog(run).count("41") == 0  # not a crash requeue: max_crash_requeues is untouched


def test_a_verdict_of_another_step_or_shape_is_not_a_straggler_stop(run):
    RunStateFile(run).write(RunState.of("stopped", "straggler", 40, **JOB.identity(), straggler={"node": 3}))
    assert straggler_decision(run, exit_code=0).action is Action.FINISHED


def test_the_status_lists_an_excluded_node_and_why(run):
    CrashLog(run).append(
        {"job_id": "41", "step": 3, "why": "x", "nodes_excluded": {"n2": "implicated twice"}}
    )
    assert ("excluded node", "n2 from job 41: implicated twice") in run_rows(run)


def spec(tmp_path, *overrides: str, jobid: str = "") -> JobSpec:
    cfg = load_config(None, ["--slurm.gpus_per_node=0", "--slurm.tasks_per_node=2", *overrides])
    return JobSpec(cfg, tmp_path, tmp_path / "c.toml", tmp_path / "job.sh", tmp_path, attach_jobid=jobid)


def test_spares_allocate_n_plus_k_nodes_keep_the_job_on_a_node_failure_and_the_step_on_n(tmp_path):
    job = spec(tmp_path, "--slurm.nodes=2", "--slurm.spare_nodes=1")
    assert "--nodes=3" in sbatch_options(job) and "--no-kill" in sbatch_options(job)
    # The driver splits the nodes (tests/test_job_setup.py): the script only allocates N + K.
    assert "--nodes=2" in sbatch_options(spec(tmp_path, "--slurm.nodes=2"))


@pytest.mark.parametrize(
    ("overrides", "jobid", "says"),
    [
        (["--slurm.nodes=2", "--slurm.min_nodes=1"], "", "node range"),
        (["--slurm.nodes=2"], "77", "--jobid 77"),
        (["--slurm.nodes=1", "--slurm.spare_nodes=3"], "", "at most 2 spare"),
        (["--slurm.nodes=2", "--slurm.no_kill=false"], "", "slurm.no_kill=false"),
    ],
)
def test_spares_the_job_cannot_use_are_refused_in_one_line(tmp_path, overrides, jobid, says):
    extra = [] if any("spare_nodes" in o for o in overrides) else ["--slurm.spare_nodes=1"]
    with pytest.raises(UserError, match=says):
        render_script(spec(tmp_path, *overrides, *extra, jobid=jobid))


def test_the_driver_runs_on_the_training_nodes_and_places_a_spare_in_the_nodes_position(tmp_path):
    launch = StepLaunch(
        ["--nodes=2"], ["python", "t.py"], ["n1", "n2"], 2, spares=["n3"], order=["n1", "n2", "n3"]
    )
    launch.hostfile = tmp_path / "hosts"
    env = {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_NUM_NODES": "3", "SLURM_NTASKS": "6"}
    launch.place(launch.nodes, env)
    assert (env["SLURM_JOB_NUM_NODES"], env["MASTER_ADDR"]) == ("2", "n1") and "SLURM_NTASKS" not in env
    assert "--nodelist=n1,n2" in launch.argv() and "SLURM_HOSTFILE" not in env
    launch.restart(("n3", "n2"), "41", env)  # n1 lost: the spare takes rank 0's position
    assert launch.spares == [] and env["MASTER_ADDR"] == "n3"
    assert launch.argv()[-4:-2] == ["--ntasks=4", "--distribution=arbitrary"]
    assert launch.hostfile.read_text().split() == ["n3", "n3", "n2", "n2"]
    assert env["SLURM_HOSTFILE"] == str(launch.hostfile)


def test_the_launch_flag_sets_the_spares(tmp_path, monkeypatch, capsys):
    from relaytrain.cli import main

    monkeypatch.chdir(tmp_path)
    config = str(REPO / "configs" / "debug.toml")
    args = ["launch", config, "--nodes", "2", "--spare-nodes", "1", "--gpus-per-node", "0",
            "--tasks-per-node", "1", "--dry-run", f"--run.dir={tmp_path}/runs"]  # fmt: skip
    assert main(args) == 0
    assert "#SBATCH --nodes=3" in capsys.readouterr().out
    assert "spare_nodes = 1" in (tmp_path / "runs" / "debug" / "slurm" / "config.toml").read_text()


def test_plan_shows_the_spares_and_their_cost():
    from relaytrain.plan.spares import spare_cost, spare_rows

    cfg = load_config(None, ["--slurm.nodes=2", "--slurm.spare_nodes=1", "--slurm.time=24:00:00"])
    assert spare_cost(cfg.slurm) == {"spare_nodes": 1, "allocated_nodes": 3, "idle_node_hours": 24.0,
                                     "share": 0.3333}  # fmt: skip
    (row,) = spare_rows(cfg.slurm)
    assert (
        row[1]
        == "1 idle beside 2 training (sbatch --nodes=3): 24 idle node-hours per job, 33.3 % of the allocation"
    )
    assert spare_rows(load_config(None, ["--slurm.nodes=2"]).slurm) == []


def test_a_requeue_excluding_nodes_holds_updates_and_releases_the_job(monkeypatch):
    """A running job's ExcNodeList cannot be changed (`Job is no longer pending execution`): requeued held,
    its ExcNodeList (what it had, and the nodes) updated, then released."""
    calls = []
    monkeypatch.setattr(requeue, "_scontrol", lambda *args: calls.append(args) or (True, " ".join(args)))
    monkeypatch.setattr(requeue, "scontrol_job_field", lambda job, field: "n9")
    monkeypatch.setattr(requeue, "expand_nodelist", lambda text: text.split(",") if text else [])
    assert requeue.scontrol_requeue("41", ("n2",))[0]
    assert calls == [("requeuehold", "41"), ("update", "JobId=41", "ExcNodeList=n9,n2"), ("release", "41")]


def test_the_batch_program_asks_one_owner_about_spares():
    """resilience/batch/spares.py alone names the idle spares to a step (RELAYTRAIN_SPARE_NODES, read back
    by JobFacts) and computes which spare takes whose place; the driver, the decision and its restart
    plan call it."""
    from relaytrain.resilience.batch import spares

    src = REPO / "src" / "relaytrain"
    writers = sorted(
        str(p.relative_to(src))
        for p in src.rglob("*.py")
        if re.search("SPARE_NODES_ENV|RELAYTRAIN_SPARE_NODES", p.read_text())
    )
    assert writers == ["job/facts.py", "resilience/batch/spares.py"]
    for caller in ("driver.py", "step_end.py", "step_restart.py", "job_setup.py"):
        text = (src / "resilience" / "batch" / caller).read_text()
        asks = r"from relaytrain\.resilience\.batch import .*\bspares\b|batch\.spares import"
        assert re.search(asks, text), caller
    assert spares.swap_in(["n1", "n2"], {"n2"}, ["n2", "n3", "n4"], excluded=()) == (("n2", "n3"),)
    assert spares.left_out(["n1", "n2", "n3"], ["n1", "n3"], []) == ["n2"]
    assert spares.out_of_order(["n3", "n2"], ["n1", "n2", "n3"])
    assert not spares.out_of_order(["n2", "n3"], ["n1", "n2", "n3"])
