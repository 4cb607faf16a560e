"""The decision side of hang detection (issue 37): the hang record the job's hang monitor leaves
(`hang/last.json`, hostile input), the end-of-step decision that names a hang and its culprits in
crashes.jsonl, run_state.json and the restart, leaves a node named culprit twice out of the restart in
place when the node range allows, and `relaytrain status RUN` showing the last crash and its culprit."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from relaytrain.cli import main
from relaytrain.config.schema import ResilienceConfig
from relaytrain.inspection.run_view import run_rows
from relaytrain.job import JobFacts, RunDir
from relaytrain.resilience.batch import step_end
from relaytrain.resilience.batch.crash import CrashLog, describe_crash
from relaytrain.resilience.batch.step_end import Action, Restartable, RunFacts, decide
from relaytrain.resilience.batch.step_restart import StepFacts
from relaytrain.resilience.hangs.record import MAX_RECORD_BYTES, HangRecord, HangRecordFile
from relaytrain.resilience.run_state import RunState, RunStateFile

JOB_ENV = {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "0", "RELAYTRAIN_STEP_RESTARTS": "1"}
JOB = JobFacts.from_env(JOB_ENV)
LINE = (
    "hang detected: rank 1 on n2 in forward/backward at step 12 (stopped, state T); 41 s without "
    "progress (limit 40 s: 10 x median 0.2 s, floor 40 s); rank 0 waits in all_reduce; report "
    "logs/hang-step12.md"
)
CULPRIT = {"rank": 1, "node": "n2", "phase": "forward/backward", "why": "stopped, state T"}
RECORD = HangRecord(
    job_id="41",
    step_restarts=1,
    step=12,
    detected_at=1_700_000_000.5,
    idle_s=41.0,
    limit_s=40.0,
    culprits=(CULPRIT,),
    line=LINE,
    report="logs/hang-step12.md",
)
TWICE = "implicated in 2 failures of this job (resilience.exclude_node_after=2)"
TWO_NODES = StepFacts(can_restart=True, seconds=300.0, nodes=("n1", "n2"), started=True)


@pytest.fixture
def run(tmp_path, monkeypatch) -> RunDir:
    """A run directory whose step 12 of job 41 (step restart 1) was running when its ranks were killed."""
    for key, value in JOB_ENV.items():
        monkeypatch.setenv(key, value)  # the metrics record's job identity
    run = RunDir(tmp_path / "run")
    RunStateFile(run).write(RunState.of("running", "", 12, **JOB.identity()))
    return run


def test_a_record_round_trips_atomically(run):
    records = HangRecordFile(run)
    assert records.read() is None  # no hang yet
    records.write(RECORD)
    assert records.read() == RECORD and records.for_step(JOB) == RECORD
    assert [p.name for p in run.hang.iterdir()] == ["last.json"]  # no temporary file left behind
    assert json.loads(run.hang_record.read_text())["culprits"] == [CULPRIT]
    assert RECORD.culprit_nodes == ("n2",)
    two = replace(RECORD, culprits=(CULPRIT, {**CULPRIT, "rank": 3}, {**CULPRIT, "node": "n1"}))
    assert two.culprit_nodes == ("n2", "n1")


GOOD = RECORD.as_json()


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{not json",
        b"\xff\xfe{}",  # not UTF-8
        b"[1, 2]",  # a list
        b'"a string"',
        json.dumps({**GOOD, "step": "12"}).encode(),
        json.dumps({**GOOD, "step_restarts": True}).encode(),  # a bool is not a count
        json.dumps({**GOOD, "job_id": 41}).encode(),
        json.dumps({**GOOD, "culprits": "n2"}).encode(),
        json.dumps({**GOOD, "culprits": [{**CULPRIT, "node": None}]}).encode(),
        json.dumps({**GOOD, "culprits": [{**CULPRIT, "rank": "1"}]}).encode(),
        json.dumps({**GOOD, "restart_count": "0"}).encode(),
        json.dumps({k: v for k, v in GOOD.items() if k != "line"}).encode(),
        json.dumps(GOOD).replace("41.0", "NaN").encode(),  # Python's json reads NaN; strict JSON does not
        json.dumps({**GOOD, "limit_s": 1e400}).encode(),  # Infinity
        json.dumps(GOOD).replace("40.0", "1e400").encode(),  # inf, from a number
        b"[" * 100_000,  # nested beyond the parser's recursion
        json.dumps({**GOOD, "pad": "x" * MAX_RECORD_BYTES}).encode(),  # huge
    ],
    ids=lambda c: c[:24].decode(errors="replace"),
)
def test_a_damaged_or_hostile_record_reads_as_none(run, content):
    run.hang.mkdir(parents=True, exist_ok=True)
    run.hang_record.write_bytes(content)
    assert HangRecordFile(run).read() is None
    assert HangRecordFile(run).for_step(JOB) is None


def test_a_directory_or_a_fifo_in_the_records_place_reads_as_none(run):
    run.hang_record.mkdir(parents=True)
    assert HangRecordFile(run).read() is None
    run.hang_record.rmdir()
    os.mkfifo(run.hang_record)  # no writer: a blocking open would wait for ever
    assert HangRecordFile(run).read() is None


def test_only_the_record_of_the_step_that_ended_counts(run):
    records = HangRecordFile(run)
    for other in ({"job_id": "40"}, {"step_restarts": 0}, {"restart_count": 1}):
        records.write(replace(RECORD, **other))
        assert records.read() is not None and records.for_step(JOB) is None, other
    records.write(replace(RECORD, restart_count=0))  # its requeue count, where recorded, must match too
    assert records.for_step(JOB) is not None


def after(run: RunDir, *, step: StepFacts = TWO_NODES, min_nodes: int = 1, **resilience):
    facts = RunFacts.read(run, JOB)
    restartable = Restartable(step, min_nodes, list(step.nodes))
    return decide(137, facts, ResilienceConfig(**resilience), JOB, restartable=restartable)


def test_a_hang_is_the_crashs_cause_in_the_crash_line_the_state_and_the_restart(run):
    HangRecordFile(run).write(RECORD)
    decision = after(run)
    assert decision.action is Action.RESTART and decision.restart.nodes == (), decision
    assert decision.crash["why"] == LINE and decision.reason.startswith(f"crash ({LINE}); restarting")
    assert decision.crash["hang"] == {
        "step": 12,
        "culprits": [CULPRIT],
        "line": LINE,
        "report": "logs/hang-step12.md",
        "idle_s": 41.0,
        "limit_s": 40.0,
    }
    step_end.perform(decision, JOB, run)
    (line,) = CrashLog(run).entries()
    assert (line["action"], line["hang"]["culprits"], line["why"]) == ("restart", [CULPRIT], LINE)
    state = RunStateFile(run).read()
    assert state.message.startswith("crash (hang detected: rank 1 on n2")
    assert state.facts["crash"]["hang"]["culprits"] == [CULPRIT]
    (event,) = [json.loads(x) for x in run.metrics.read_text().splitlines()]
    assert event["event"] == "step_restart" and event["hang_culprits"] == [CULPRIT]
    assert event["nodes_left_out"] == [] and "nodes_note" not in event  # named once: kept


def test_a_crash_requeued_after_a_hang_still_names_it(run):
    HangRecordFile(run).write(RECORD)
    decision = after(run, max_step_restarts=0)
    assert decision.action is Action.REQUEUE and decision.crash["hang"]["culprits"] == [CULPRIT]
    assert decision.record.message.startswith("crash 1 of this job (hang detected: rank 1 on n2")


def test_a_hang_record_of_another_job_or_step_is_ignored(run):
    for other in ({"job_id": "40"}, {"step_restarts": 0}):
        HangRecordFile(run).write(replace(RECORD, **other))
        decision = after(run)
        assert "hang" not in decision.crash and "hang detected" not in decision.reason, other
        assert decision.crash["why"].startswith("a rank died at step >= 12")


# A restarted step (step restart 1) that never got through its start-up: no run_state.json of its own
STARTING = replace(TWO_NODES, seconds=50.0, started=False)


def test_a_restarted_step_found_hung_in_its_start_up_is_restarted_in_place_again(run):
    """A restarted step that fails at start-up goes the requeue way (a crash loop's sign), except when the
    job's hang monitor found it hung and ended it: restarted in place, under max_step_restarts still."""
    CrashLog(run).append({"job_id": "41", "step": 12, "action": "restart", "why": "a rank died"})
    decision = after(run, step=STARTING)  # no hang record: a crash in the start-up
    assert decision.action is Action.REQUEUE, decision
    assert "failed again at start-up" in decision.crash["not_restarted_in_place"]
    HangRecordFile(run).write(replace(RECORD, culprits=({**CULPRIT, "phase": "rendezvous"},)))
    decision = after(run, step=STARTING)
    assert decision.action is Action.RESTART and "restart in place 2 of" in decision.reason, decision
    assert decision.crash["hang"]["culprits"][0]["phase"] == "rendezvous"
    decision = after(run, step=STARTING, max_step_restarts=1)  # the cap bounds a hang that comes back
    assert decision.action is Action.REQUEUE, decision
    assert "max_step_restarts=1 reached" in decision.crash["not_restarted_in_place"]


def earlier_hang(run: RunDir, node: str, job_id: str = "41") -> None:
    hang = {"step": 5, "culprits": [{**CULPRIT, "node": node}], "line": "hang detected: ...", "report": ""}
    CrashLog(run).append({"job_id": job_id, "step": 5, "action": "restart", "why": "hang", "hang": hang})


def test_a_node_named_culprit_twice_is_left_out_when_the_node_range_allows(run):
    earlier_hang(run, "n2")
    HangRecordFile(run).write(RECORD)
    decision = after(run, min_nodes=1)
    assert decision.action is Action.RESTART and decision.restart.nodes == ("n1",), decision
    assert decision.restart.left_out == ("n2",) and decision.crash["nodes_left_out"] == ["n2"]
    assert f"on the 1 node(s) left (n1); left out: n2, {TWICE}" in decision.reason
    step_end.perform(decision, JOB, run)
    (event,) = [json.loads(x) for x in run.metrics.read_text().splitlines()]
    assert (event["nodes"], event["nodes_left_out"]) == (["n1"], ["n2"])
    assert (
        event["nodes_note"]
        == "left out: n2, implicated in 2 failures of this job (resilience.exclude_node_after=2)"
    )
    rows = run_rows(run)
    assert (
        "without n2 (implicated in 2 failures of this job (resilience.exclude_node_after=2))"
        in dict(rows)["last crash"]
    )
    assert (
        "excluded node",
        "n2 from job 41: implicated in 2 failures of this job (resilience.exclude_node_after=2)",
    ) in rows


def test_a_node_named_culprit_twice_is_excluded_by_a_requeue_when_the_range_does_not_allow(run):
    """No spare, no node range: the node cannot be left out in place; the requeue's allocation excludes it."""
    earlier_hang(run, "n2")
    HangRecordFile(run).write(RECORD)
    decision = after(run, min_nodes=2)
    assert decision.action is Action.REQUEUE and decision.exclude == ("n2",), decision
    assert decision.crash["nodes_excluded"] == {
        "n2": "implicated in 2 failures of this job (resilience.exclude_node_after=2)"
    }
    assert "excluded node(s) cannot be left out: kept: n2" in decision.crash["not_restarted_in_place"]


def test_a_spare_takes_the_place_of_a_node_named_culprit_twice(run):
    earlier_hang(run, "n2")
    HangRecordFile(run).write(RECORD)
    restartable = Restartable(TWO_NODES, 2, ["n1", "n2", "n3"], ("n3",))
    decision = decide(137, RunFacts.read(run, JOB), ResilienceConfig(), JOB, restartable=restartable)
    assert decision.action is Action.RESTART and decision.restart.nodes == ("n1", "n3"), decision
    assert decision.crash["nodes_replaced"] == [["n2", "n3"]]
    assert "on 2 node(s) (n1,n3): spare n3 in place of n2" in decision.reason


def test_exclusion_after_zero_never_excludes(run):
    earlier_hang(run, "n2")
    HangRecordFile(run).write(RECORD)
    decision = after(run, min_nodes=1, exclude_node_after=0)
    assert decision.restart.nodes == () and decision.restart.left_out == (), decision


@pytest.mark.parametrize(
    "earlier",
    [(), ("n1",), ("n2@40",)],  # never named, another node named, n2 named in another job
)
def test_a_node_named_once_in_this_job_is_not_left_out(run, earlier):
    for named in earlier:
        node, _, job_id = named.partition("@")
        earlier_hang(run, node, job_id or "41")
    CrashLog(run).append({"job_id": "41", "hang": {"culprits": "n2"}})  # a damaged line counts nothing
    HangRecordFile(run).write(RECORD)
    decision = after(run)
    assert decision.restart.nodes == () and decision.restart.left_out == (), decision


def test_status_shows_the_last_crash_and_its_culprit(run, capsys):
    HangRecordFile(run).write(RECORD)
    step_end.perform(after(run), JOB, run)
    shown = (
        "hang at step 12: rank 1 on n2 in forward/backward (stopped, state T); report "
        "logs/hang-step12.md; restarted in place"
    )
    assert dict(run_rows(run))["last crash"] == shown
    assert main(["status", str(run.root)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "last crash" in out and "rank 1 on n2 in forward/backward (stopped, state T)" in out
    # a crash without a hang: its step and why
    CrashLog(run).append({"job_id": "41", "step": 14, "why": "a rank died", "action": "requeue"})
    assert dict(run_rows(run))["last crash"] == "at step 14: a rank died; requeued"


@pytest.mark.parametrize(
    "entry",
    [{}, {"hang": {"culprits": "n2"}}, {"hang": {"culprits": [1, {"rank": []}]}}, {"action": 3}, {"hang": 1}],
)
def test_a_damaged_crash_line_is_described_without_a_traceback(entry):
    assert describe_crash(entry)


def test_status_prints_a_recorded_error_with_brackets_as_it_is(tmp_path, capsys):
    """gloo's errors start with `[/__w/pytorch/...pair.cc:553]`, which rich would read as a closing tag."""
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    RunStateFile(run).write(RunState.of("failed", "crash", 3))
    why = "the run failed (error): RuntimeError('[/__w/pytorch/gloo/pair.cc:553] Connection closed')"
    CrashLog(run).append({"job_id": "7", "action": "restart", "step": 3, "why": why})
    assert main(["status", str(run.root)]) == 0
    assert "[/__w/pytorch/gloo/pair.cc:553]" in capsys.readouterr().out.replace("\n", "")
