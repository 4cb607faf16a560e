"""`resilience.preflight = "exclude"`, the fast side: the nodes the checks before the first step named are
recorded by rank 0 and the step stops (preflight/exclude.py); the driver's decision puts a spare in their
place, else restarts on fewer nodes where the range allows, else requeues with them in ExcNodeList (the
one requeue path, counted as a crash requeue), else stops with a clear message
(resilience/batch/preflight_exclude.py); the alerts tell the exclusion (a restart's step_restart event, a
requeue's record) and `relaytrain status` shows the alerts' counts."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from relaytrain.config import load_config
from relaytrain.config.schema import ResilienceConfig
from relaytrain.errors import ConfigError
from relaytrain.inspection.run_view import run_json, run_rows
from relaytrain.job import JobFacts, RunDir
from relaytrain.job.jsonl import append_job_record
from relaytrain.preflight.exclude import named_nodes, stop_for
from relaytrain.resilience import requeue
from relaytrain.resilience.batch import step_end
from relaytrain.resilience.batch.crash import CrashLog, describe_crash
from relaytrain.resilience.batch.notify import Watcher, at_job_end
from relaytrain.resilience.batch.step_decision import Action, Restartable, RunFacts, decide
from relaytrain.resilience.batch.step_restart import StepFacts
from relaytrain.resilience.codes import EXIT_PREFLIGHT
from relaytrain.resilience.run_state import RunState, RunStateFile

JOB_ENV = {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "0", "RELAYTRAIN_SPARE_NODES": "n3"}
JOB = JobFacts.from_env(JOB_ENV)
TWO = StepFacts(can_restart=True, seconds=8.0, nodes=("n1", "n2"), started=True)
LINE = "preflight: n2 compute 60 % below the median (40.0 vs 100.0 GFLOP/s)"
PROBLEMS = {"n1": [], "n2": ["compute 60 % below the median (40.0 vs 100.0 GFLOP/s)"]}
RANK0 = SimpleNamespace(is_main=True, distributed=False)


@pytest.fixture
def run(tmp_path, monkeypatch) -> RunDir:
    for key, value in JOB_ENV.items():
        monkeypatch.setenv(key, value)
    return RunDir(tmp_path / "run")


def named(run: RunDir) -> None:
    """What rank 0 of a step whose preflight named n2 leaves behind."""
    assert stop_for(PROBLEMS, [LINE], "preflight/41.json", RANK0, run) == EXIT_PREFLIGHT


def decision(run, usable=("n1", "n2", "n3"), spares=("n3",), min_nodes=2, earlier=None, **r):
    facts = RunFacts.read(run, JOB)
    if earlier is not None:
        facts = RunFacts(facts.state, earlier, "", earlier_implicated=facts.earlier_implicated)
    restartable = Restartable(TWO, min_nodes, list(usable), spares)
    return decide(EXIT_PREFLIGHT, facts, ResilienceConfig(**r), JOB, restartable=restartable)


def test_only_nodes_worse_than_others_are_left_out_and_rank0_records_them(run, capsys):
    assert named_nodes(PROBLEMS) == ["n2"]
    assert named_nodes({"n1": ["storage"], "n2": ["storage"]}) == []  # a shared cause: none left out
    assert stop_for({"n1": ["x"], "n2": ["x"]}, ["a", "b"], "", RANK0, run) == 0
    assert "none left out" in capsys.readouterr().out and not run.run_state.exists()
    assert stop_for({"n1": [], "n2": []}, [], "", RANK0, run) == 0
    other = SimpleNamespace(is_main=False, distributed=False)
    assert stop_for(PROBLEMS, [LINE], "", other, run) == EXIT_PREFLIGHT and not run.run_state.exists()
    named(run)
    record = RunStateFile(run).read()
    assert (record.status.value, record.reason, record.written_by(JOB)) == ("stopped", "preflight", True)
    assert record.fact("preflight") == {"nodes": ["n2"], "lines": [LINE], "results": "preflight/41.json"}


def test_a_spare_takes_the_named_nodes_place_in_a_restart_in_place(run):
    named(run)
    d = decision(run)
    assert d.action is Action.RESTART and d.restart.nodes == ("n1", "n3"), d
    assert d.restart.replaced == (("n2", "n3"),) and "spare n3 in place of n2" in d.reason
    step_end.perform(d, JOB, run)
    (entry,) = CrashLog(run).entries()
    assert (entry["kind"], entry["action"], entry["nodes_implicated"]) == ("preflight", "restart", ["n2"])
    assert entry["nodes_excluded"] == {"n2": f"named by preflight ({LINE.removeprefix('preflight: n2 ')})"}
    assert describe_crash(entry).startswith("at step 0: preflight named n2 below threshold; restarted")
    # the step_restart event the driver's alerts follow: node_excluded, with why, and no crash_restart (no
    # crash happened)
    (event,) = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    assert event["reason"] == "preflight"
    alerts = Watcher(0).feed(event, 0.0)
    assert [a.event for a in alerts] == ["node_excluded"]
    assert alerts[0].fields == {"nodes": ["n2"], "why": "left out: n2, named by preflight"}
    assert ("excluded node", f"n2 from job 41: {entry['nodes_excluded']['n2']}") in run_rows(run)


def test_without_a_spare_the_node_range_lets_the_step_restart_on_fewer_nodes(run):
    named(run)
    d = decision(run, spares=(), min_nodes=1)
    assert d.action is Action.RESTART and d.restart.nodes == ("n1",) and d.restart.left_out == ("n2",)


def test_without_spare_or_range_the_job_is_requeued_with_the_node_excluded_once(run, monkeypatch):
    named(run)
    d = decision(run, spares=(), min_nodes=2)
    assert d.action is Action.REQUEUE and d.exclude == ("n2",), d
    assert "requeuing with n2 excluded" in d.reason
    asked = []
    monkeypatch.setattr(
        requeue, "scontrol_requeue", lambda job_id, exclude=(): asked.append(exclude) or (True, "")
    )
    step_end.perform(d, JOB, run)
    assert asked == [("n2",)] and CrashLog(run).count("41") == 1  # a crash requeue: capped
    record = RunStateFile(run).read()
    assert record.requeued and record.fact("requeue_excluded") == ["n2"]
    # the job's end tells the requeue and the exclusion
    alerts = at_job_end(run, JOB)
    assert [(a.event, a.fields.get("nodes")) for a in alerts] == [
        ("requeued", None),
        ("node_excluded", ["n2"]),
    ]
    assert "ExcNodeList" in alerts[1].fields["why"]


@pytest.mark.parametrize(
    ("settings", "earlier", "says"),
    [
        ({"requeue": False}, 0, "resilience.requeue is off or not in SLURM"),
        ({"max_crash_requeues": 2}, 2, "resilience.max_crash_requeues=2 reached"),
    ],
)
def test_with_no_way_to_leave_it_out_the_job_stops_and_says_how_to(run, settings, earlier, says):
    named(run)
    d = decision(run, spares=(), earlier=earlier, **settings)
    assert d.action is Action.FAIL and says in d.reason and "sbatch --exclude=n2" in d.reason, d.reason
    assert d.record.status.value == "failed" and d.record.reason == "preflight"


def test_a_preflight_record_of_another_step_or_shape_is_not_a_preflight_stop(run):
    other = {**JOB.identity(), "step_restarts": 1}
    RunStateFile(run).write(RunState.of("stopped", "preflight", 0, **other, preflight={"nodes": ["n2"]}))
    crash = decision(run)  # not this step's record: a crash before the step wrote its own
    assert crash.reason.startswith("crash (") and crash.restart.left_out == () and not crash.exclude
    RunStateFile(run).write(
        RunState.of("stopped", "preflight", 0, **JOB.identity(), preflight={"nodes": [3]})
    )
    assert decision(run).action is Action.FINISHED  # a stop this step recorded, not one to act on


def test_the_setting_takes_exclude_and_refuses_others():
    assert load_config(None, ["--resilience.preflight=exclude"]).resilience.preflight == "exclude"
    with pytest.raises(ConfigError):
        load_config(None, ["--resilience.preflight=drop"])


def test_status_shows_the_alerts_counts_of_the_runs_jobs(run):
    run.root.mkdir(parents=True)
    append_job_record(run, "start")
    assert "alerts" not in dict(run_rows(run)) and run_json(run)["alerts"] is None
    append_job_record(run, "notify", sent=3, failed=1, dropped=0, unsent=0, retries=2)
    append_job_record(run, "notify", sent=2, failed=0, dropped=1, unsent=1, retries=0)
    assert dict(run_rows(run))["alerts"] == "5 sent, 1 failed, 1 dropped, 1 unsent, 2 retries (2 jobs)"
    assert run_json(run)["alerts"] == {
        "sent": 5,
        "failed": 1,
        "dropped": 1,
        "unsent": 1,
        "retries": 2,
        "jobs": 2,
    }


@pytest.mark.parametrize(("mode", "code"), [("report", 0), ("exclude", EXIT_PREFLIGHT), ("off", 0)])
def test_the_checks_before_the_first_step_stop_the_step_only_with_exclude(run, monkeypatch, mode, code):
    """check_in_job (the trainer calls it before Trainer.run and returns its code): every rank's results
    judged; `exclude` records the node and returns the code to stop with, `report` only names it."""
    import torch

    from relaytrain.preflight import run as preflight_run

    ranks = [{"rank": 0, "node": "n1", "figures": {"gflops": 100.0}},
             {"rank": 1, "node": "n2", "figures": {"gflops": 40.0}}]  # fmt: skip
    monkeypatch.setattr(preflight_run, "measure_rank", lambda cfg, env, budget: {})
    monkeypatch.setattr(preflight_run, "gather", lambda result, env: ranks)
    cfg = load_config(
        None, [f"--run.dir={run.root.parent}", "--run.name=run", f"--resilience.preflight={mode}"]
    )
    env = SimpleNamespace(is_main=True, distributed=False, local_world_size=1, device=torch.device("cpu"),
                          num_nodes=2, rank=0, local_rank=0)  # fmt: skip
    assert preflight_run.check_in_job(cfg, env, run) == code
    record = RunStateFile(run).read()
    if mode == "exclude":
        assert record.reason == "preflight" and record.fact("preflight")["nodes"] == ["n2"]
        assert record.fact("preflight")["results"].endswith("preflight/41.json")
    else:
        assert record is None
    assert (run.preflight("41").exists()) == (mode != "off")
