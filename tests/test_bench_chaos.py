"""bench.chaos (bench/cluster/): how trials are drawn, checked and merged onto the page (fast), and
`--quick` on the real local Slurm cluster: 3 random interruptions, no work lost (`slurm`).

Like every `slurm` test the quick run goes under `flock /tmp/relaytrain-slurm.lock`, hence `--no-lock`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from relaytrain.job import RunDir
from relaytrain.resilience.run_state import RunState, RunStateFile

from bench.cluster import chaos
from bench.cluster.chaos_kinds import (
    SPECIAL_KINDS,
    SpecialTrial,
    SpecialTrials,
    first_job_stops,
    method_of,
    time_limit_checks,
)
from bench.cluster.chaos_page import (
    KINDS_SOURCE,
    load_results,
    merge_special,
    render,
    render_section,
    render_special,
    results_data,
    summary,
)
from bench.cluster.chaos_run import ALLOWED, EVENTS, PHASES, Bench, Trial, draw, fault_evidence, kill_pids
from bench.cluster.harness import RunFiles
from bench.report import REPO

KILL_OK = {"save in flight when killed": True, "resumed from the previous complete checkpoint": True}
CAP_LOG = "not requeuing: SLURM_RESTART_COUNT=1 reached resilience.max_requeues=1"


LANDED = ["crashes.jsonl: 1 (restart)"]


def special(kind: str, seed: str, detail: str = "", ok: bool = True, **checks: bool) -> SpecialTrial:
    return SpecialTrial(
        index=0, kind=kind, seed=seed, detail=detail, checks=checks, bit_exact=ok, latest_complete=ok,
        final_status="finished", evidence=LANDED,
    )  # fmt: skip


def test_trials_are_drawn_from_the_seed():
    assert [(t.phase, t.event) for t in draw(5, 11)] == [(t.phase, t.event) for t in draw(5, 11)]
    assert all(t.phase in PHASES and t.event in EVENTS for t in draw(40, 3))
    assert all(t.event == "sigkill_rank" for t in draw(40, 3) if t.phase == "resume_load")


def test_each_kind_runs_its_own_method():
    assert method_of("kill_save_async") == method_of("kill_save_sync") == "kill_save"
    assert method_of("time_limit_cap") == method_of("time_limit_cap_budget") == "time_limit_cap"
    assert method_of("disk_full") == "disk_full"
    assert all(callable(getattr(SpecialTrials, method_of(kind), None)) for kind in SPECIAL_KINDS)


def test_stops_of_the_first_job_only():
    events = [
        {"event": "start", "step": 0, "job_id": "7"},
        {"event": "stop", "step": 9, "job_id": "7", "reason": "time_limit_signal"},
        {"event": "resume", "step": 9, "job_id": "7"},
        {"event": "stop", "step": 14, "job_id": "7", "reason": "time_budget"},
        {"event": "stop", "step": 20, "job_id": "8", "reason": "time_limit_signal"},
    ]
    assert first_job_stops(events, "7") == [(9, "time_limit_signal"), (14, "time_budget")]


@pytest.mark.parametrize("reason", ["time_limit_signal", "time_budget"])
def test_either_time_limit_stop_counts_as_the_requeued_time_limit(reason):
    checks = time_limit_checks([(3, reason), (5, reason)], reason, 1, {"status": "stopped"}, CAP_LOG)
    assert all(checks.values()), checks


def test_the_variant_says_when_the_other_stop_came_first():
    checks = time_limit_checks([(1, "time_budget")], "time_limit_signal", 1, {"status": "stopped"}, CAP_LOG)
    assert checks["time limit requeued once"]
    assert not checks["first stop by Slurm's --signal"]


def test_a_preemption_or_no_requeue_is_not_a_time_limit_requeue():
    stopped = {"status": "stopped"}
    assert not time_limit_checks([(4, "preemption")], "time_limit_signal", 1, stopped, CAP_LOG)[
        "time limit requeued once"
    ]
    assert not time_limit_checks([(4, "time_limit_signal")], "time_limit_signal", 0, stopped, CAP_LOG)[
        "time limit requeued once"
    ]
    capped = time_limit_checks([(4, "time_budget")], "time_budget", 1, {"status": "finished"}, CAP_LOG)
    assert not capped["stopped at max_requeues, reason logged"]


def test_results_carry_their_runs_seed(tmp_path):
    for seed, rows in (("17", [Trial(0, "mid_step", "usr2")]), ("20", [SpecialTrial(0, "hang", job="5")])):
        data = results_data("python -m bench.chaos", "2026-11-25", seed, {"cpu": "CPU", "cores": 2}, "", rows)
        (tmp_path / f"chaos-seed{seed}.json").write_text(json.dumps(data))
    trials, targeted = load_results(sorted(str(p) for p in tmp_path.glob("*.json")))
    assert [t.phase for t in trials] == ["mid_step"]
    assert [(t.kind, t.seed) for t in targeted] == [("hang", "20")]


def test_a_targeted_trial_the_stopped_benchmark_never_started_is_named_and_not_counted(tmp_path):
    """A results file is saved after each trial with every trial drawn: one the benchmark was stopped
    before (no job, no error, no seconds) is no row of the table and not scored; the page says so."""
    ran = replace(special("straggler_replace", "73"), job="26", seconds=756.2, verify_exit=0)
    rows = [ran, SpecialTrial(1, "straggler_replace"), SpecialTrial(2, "straggler_replace")]
    data = results_data("python -m bench.chaos", "2026-12-07", "73", {"cpu": "CPU", "cores": 2}, "", rows)
    path = tmp_path / "chaos-seed73.json"
    path.write_text(json.dumps(data))
    assert [t.job for t in load_results([str(path)])[1]] == ["26"]
    page = render_section([str(path)], "chaos-ledger")
    assert "never started (the benchmark was stopped before them), not counted: seed 73: 2 " in page
    assert page.count("| straggler_replace |") == 1


def test_merge_adds_up_kills_under_their_real_mode_and_keeps_the_latest_run_of_other_kinds():
    rows = [
        special("kill_save_async", "18", "killed rank 0 in the sync save of step 30", **KILL_OK),
        special("kill_save_sync", "18", "killed rank 1 in the sync save of step 10", **KILL_OK),
        special("time_limit_cap", "18", ok=False),
        special("hang", "18"),
        special("disk_full", "18", **{"previous checkpoint intact": False}),
        special("kill_save_async", "20", "killed rank 0 in the async save of step 10", **KILL_OK),
        special("disk_full", "20", **{"previous checkpoint intact": True}),
        special("time_limit_cap", "21", **{"time limit requeued once": True}),
        special("time_limit_cap_budget", "21", **{"time limit requeued once": True}),
    ]
    merged = merge_special(rows)
    shown = [(t.index, t.seed, t.kind) for t in merged.trials]
    assert shown == [
        (0, "18", "kill_save_sync"),
        (1, "18", "kill_save_sync"),
        (2, "20", "kill_save_async"),
        (3, "21", "time_limit_cap"),
        (4, "21", "time_limit_cap_budget"),
        (5, "18", "hang"),
        (6, "20", "disk_full"),
    ]
    assert merged.relabelled == 1
    assert sorted((t.seed, t.kind) for t in merged.superseded) == [
        ("18", "disk_full"),
        ("18", "time_limit_cap"),
    ]
    page = render_special(merged.trials, merged)
    assert "**3 of 3** (1 async, 2 sync)" in page
    assert (
        "Not shown, because a later run of the same kind replaces them: seed 18: disk_full, time_limit_cap"
        in page
    )
    assert "**no**" not in page
    assert [line.split(" | ")[0] for line in page.splitlines() if line.startswith("| ")][2:] == [
        f"| {i}" for i in range(7)
    ]


def test_the_page_names_the_module_that_defines_the_targeted_kinds():
    assert KINDS_SOURCE == "bench/cluster/chaos_kinds.py"
    assert f"The kinds: `{KINDS_SOURCE}`." in render_special([special("hang", "1")])
    assert f"The kinds: `{KINDS_SOURCE}`." in (REPO / "docs" / "benchmarks.md").read_text()


DONE = {"bit_exact": True, "latest_complete": True, "final_status": "finished"}


def test_summary_scores_each_target_on_the_trials_run_against_it():
    randoms = [Trial(i, "mid_step", "usr2", evidence=LANDED, **DONE) for i in range(3)]
    rows = merge_special([
        special("kill_save_sync", "1", "in the sync save", **KILL_OK),
        special("kill_save_async", "1", "in the async save", ok=False, **KILL_OK),
        special("disk_full", "1", **{"previous checkpoint intact": True}),
        special("time_limit_cap", "1", **{"first stop by Slurm's --signal": False}),
    ]).trials  # fmt: skip
    text = summary(randoms, rows)
    assert "evidence that its fault landed: **not met**: 3 of 3 passed (3 bit-exact, 3 with evidence); " \
        "3 trials ran, not 20." in text  # fmt: skip
    assert "fall back: **not met**: 1 of 2." in text
    assert "**0 lost** in 1 trial(s)" in text
    assert "time_limit_cap (row 2): **fail** (first stop by Slurm's --signal)" in text
    assert "Hang" not in text  # not run: no line
    assert "Disk full" not in summary(randoms, []) and summary([], []) == ""
    twenty = [Trial(i, "mid_step", "usr2", evidence=LANDED, **DONE) for i in range(20)]
    assert "landed: **met**: 20 of 20 passed" in summary(twenty, [])
    twenty[5].evidence = []  # bit-exact, but nothing shows that its fault landed
    assert "landed: **not met**: 19 of 20 passed (20 bit-exact, 19 with evidence)." in summary(twenty, [])


def test_a_trial_without_evidence_that_its_fault_landed_does_not_count():
    trial = Trial(0, "mid_step", "sigkill_rank", **DONE)
    assert not trial.ok
    trial.evidence = LANDED
    assert trial.ok
    assert not SpecialTrial(0, "hang", **DONE).ok and SpecialTrial(0, "hang", evidence=LANDED, **DONE).ok
    page = render(
        [Trial(0, "startup", "sigkill_rank", **DONE), Trial(1, "mid_step", "usr2", evidence=LANDED, **DONE)]
    )
    assert "**1 of 2 trials passed**" in page and "1 without evidence of their fault do not count" in page
    assert "| 0 | startup | sigkill_rank | -1 | **none recorded** |" in page


def test_evidence_comes_from_the_run_files_and_what_the_fault_hit(tmp_path):
    run = RunFiles(tmp_path / "run")
    write_metrics(run.path, [{"kind": "event", "event": "start", "step": 0},
                             {"kind": "train", "step": 1, "loss": 3.0}])  # fmt: skip
    trial = Trial(0, "mid_step", "sigkill_rank")
    assert fault_evidence(trial, run) == []  # an uninterrupted run shows nothing
    trial.hit = ["SIGKILL pid 12 (rank 1): gone", "SIGKILL pid 13 (rank 1): still running 10 s later"]
    (run.path / "crashes.jsonl").write_text(json.dumps({"action": "restart", "step": 1}) + "\n")
    write_metrics(run.path, [{"kind": "event", "event": "start", "step": 0},
                             {"kind": "event", "event": "stop", "step": 3, "reason": "time_limit_signal"},
                             {"kind": "event", "event": "resume", "step": 3}])  # fmt: skip
    trial.restarts, trial.resubmits = 1, 2
    assert fault_evidence(trial, run) == [
        "SIGKILL pid 12 (rank 1): gone",
        "crashes.jsonl: 1 (restart)",
        "stop events: time_limit_signal",
        "resume events: 1",
        "requeued 1x (Slurm's Restarts)",
        "resubmitted 2x (not finished when its job ended)",
    ]


def test_a_kill_records_the_pids_it_hit_and_a_kill_that_hits_nothing_fails(tmp_path):
    import subprocess

    victim = subprocess.Popen(["sleep", "60"])
    try:
        assert kill_pids("7", [victim.pid], 1) == [f"SIGKILL pid {victim.pid} (rank 1): gone"]
    finally:
        victim.wait()
    with pytest.raises(RuntimeError, match="the fault did not land"):
        kill_pids("7", [victim.pid], 1)  # gone already: nothing was signalled
    bench = Bench(tmp_path, cluster=None)
    trial = Trial(0, "mid_step", "sigkill_rank", job="999999999")
    with pytest.raises(RuntimeError, match="no rank 1 process of job 999999999"):
        bench.fire(trial, "sigkill_rank")
    assert trial.hit == []


def write_metrics(run_dir, rows, torn: bool = False) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"time": 1.0, **row}) + "\n" for row in rows)
    (run_dir / "metrics.jsonl").write_text(text + ('{"kind": "train", "st' if torn else ""))


def test_run_files_read_nothing_yet_as_empty(tmp_path):
    run = RunFiles(tmp_path / "not-started")
    assert (run.records(), run.state(), run.crashes()) == ([], {}, [])
    assert run.job_log() == run.hang_stacks(0) == ""
    assert run.latest() is None and not run.latest_complete()


def test_run_files_read_each_file_through_its_owner(tmp_path):
    run = RunFiles(tmp_path / "run")
    write_metrics(run.path, [
        {"kind": "train", "step": 1, "loss": 3.0},
        {"kind": "event", "event": "stop", "step": 1},
        {"kind": "train", "step": 1, "loss": 2.5},  # replayed after a requeue: the later record counts
    ], torn=True)  # fmt: skip
    RunStateFile(RunDir(run.path)).write(RunState.of("finished", "max_steps", 1))
    run.dir.slurm.mkdir()
    run.dir.job_log("10").write_text("second job")
    run.dir.job_log("9").write_text("first job")
    step_10, step_20 = run.step_dir(10), run.step_dir(20)
    step_20.mkdir(parents=True)
    step_10.mkdir()
    (step_10 / "COMPLETE").write_text("{}")
    (run.path / "core.1234").write_text("")

    assert [r["loss"] for r in run.records("train")] == [3.0, 2.5]  # the torn last line is skipped
    assert [r["loss"] for r in run.history().train] == [2.5]
    assert [e["event"] for e in run.records("event")] == ["stop"]
    assert run.state()["status"] == "finished"
    assert run.job_log() == "first job\nsecond job"
    assert run.committed(step_10) and not run.committed(step_20)
    (run.checkpoints / "latest").symlink_to(step_20.name)
    assert run.latest() == step_20 and not run.latest_complete()
    (run.checkpoints / "latest").unlink()
    (run.checkpoints / "latest").symlink_to(step_10.name)
    assert run.latest_complete()
    assert run.leftovers(ALLOWED) == ["core.1234"]


def test_only_the_harness_reads_run_files_and_it_asks_run_dir_for_their_paths():
    from test_rundir import spellings

    cluster = Path(chaos.__file__).parent
    spelled = {p.name: spellings(p.read_text()) for p in sorted(cluster.glob("*.py"))}
    assert not {name: found for name, found in spelled.items() if found}


def test_a_finished_trial_is_checked_against_the_reference_run(tmp_path):
    bench = Bench(tmp_path, cluster=None)
    bench.reference, bench.reference_val = {1: 3.0, 2: 2.0}, {2: 2.5}
    run = bench.run_files("chaos-0")
    rows = [
        {"kind": "train", "step": 1, "loss": 3.0},
        {"kind": "train", "step": 2, "loss": 2.0},
        {"kind": "train", "step": 2, "loss": 2.0},
        {"kind": "eval", "step": 2, "val_loss": 2.5},
    ]
    write_metrics(run.path, rows)
    trial = Trial(0, "mid_step", "usr2")
    bench.check(trial, run)
    assert trial.bit_exact and trial.steps_replayed == 1

    # `relaytrain verify` ran on the run (no config.toml here: exit 2, its line kept) and its ledger was read
    assert trial.verify_exit == 2 and "has no config.toml" in trial.verify[-1], trial.verify
    assert trial.ledger["allocations"] == 1 and trial.ledger["sacct_s"] == 0

    rows[2] = {"kind": "train", "step": 2, "loss": 2.0000001}  # the replayed step came out different
    write_metrics(run.path, rows)
    bench.check(trial, run)
    assert not trial.bit_exact


def test_a_trial_counts_only_when_verify_passes_and_the_ledger_adds_up_to_sacct():
    within = {"vs_sacct": -0.004, "unaccounted_share": 0.002}
    trial = Trial(0, "mid_step", "usr2", evidence=LANDED, verify_exit=0, ledger=within, **DONE)
    assert trial.ok
    assert not replace(trial, verify_exit=1).ok
    assert not replace(trial, ledger={**within, "vs_sacct": 0.02}).ok  # 2 % off sacct's elapsed
    assert not replace(trial, ledger={**within, "unaccounted_share": 0.015}).ok
    assert not replace(trial, ledger={**within, "vs_sacct": None}).ok  # sacct did not answer
    assert not SpecialTrial(0, "hang", evidence=LANDED, verify_exit=1, ledger=within, **DONE).ok
    # kept before the benchmark ran verify: judged as it was then
    assert Trial(0, "mid_step", "usr2", evidence=LANDED, **DONE).ok
    page = render([trial, replace(trial, index=1, ledger={**within, "vs_sacct": 0.02})])
    assert "in **1 of 2** trials (column `verify exit; ledger − sacct; unaccounted`)" in page
    assert "| 0; -0.4%; 0.2% |" in page and "| **0; +2.0%; 0.2%** |" in page
    assert "ledger" not in render([Trial(0, "mid_step", "usr2", evidence=LANDED, **DONE)])
    # results that kept the ledger's inferred share show it, and the sentence sums it over the trials
    inferred = {**within, "allocated_s": 60.0, "inferred_s": 3.0, "inferred_share": 0.05}
    measured = {**inferred, "inferred_s": 0.0, "inferred_share": 0.0}
    page = render([replace(trial, ledger=inferred), replace(trial, index=1, ledger=measured)])
    assert "(column `verify exit; ledger − sacct; unaccounted; inferred`)" in page
    assert "| 0; -0.4%; 0.2%; 5.0% |" in page and "| 0; -0.4%; 0.2%; 0.0% |" in page
    assert (
        " The ledgers inferred by rule (no record measured it) 2.5% of 120 s allocated in all, at most 5.0% "
        in page
    )


@pytest.mark.slurm
def test_quick_chaos_run_loses_no_work(slurm_cluster, tmp_path, capsys):
    # Seed 2 draws a USR2 stop and a SIGKILLed rank, both mid-step: a graceful stop and a crash.
    code = chaos.main(["--quick", "--seed", "2", "--no-lock", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    results = json.loads(next(tmp_path.glob("seed2-*/results.json")).read_text())["trials"]
    assert [r["event"] for r in results] == ["usr2", "sigkill_rank"]
    failed = [r for r in results if not (r["bit_exact"] and r["latest_complete"] and not r["leftovers"])]
    assert code == 0 and not failed, out[-4000:]
    usr2, kill = results
    # each fault landed, and the trial says how it knows
    assert usr2["hit"] == [f"scancel --signal=USR2 {usr2['job']}: exit 0"], usr2
    assert any(e.startswith("stop events: ") for e in usr2["evidence"]), usr2
    assert kill["hit"] and all(h.endswith(": gone") for h in kill["hit"]), kill
    assert any(e.startswith("crashes.jsonl: ") for e in kill["evidence"]), kill
    for r in results:  # `relaytrain verify RUN` exits 0, and the ledger adds up to sacct's elapsed time
        ledger = r["ledger"]
        assert r["verify_exit"] == 0, r["verify"]
        assert abs(sum(ledger["buckets"].values()) - ledger["sacct_s"]) <= 0.01 * ledger["sacct_s"], ledger
        assert ledger["unaccounted_share"] <= 0.01, ledger


def test_the_peer_trials_kill_past_the_first_checkpoint_and_wipe_through_the_store(tmp_path, capsys):
    import random

    from relaytrain.checkpoint.snapshot import store
    from relaytrain.job import JobFacts

    from bench.cluster import snapshot_wipe
    from bench.cluster.chaos_run import INTERVAL
    from bench.cluster.chaos_snapshots import kill_step

    steps = {kill_step(random.Random(seed)) for seed in range(200)}
    assert all(s > INTERVAL and 2 <= s % INTERVAL <= 7 for s in steps)  # a checkpoint to fall back to
    root = store.job_root(tmp_path, tmp_path / "runs/a", JobFacts(job_id="9"))
    other = store.job_root(tmp_path, tmp_path / "runs/a", JobFacts(job_id="10"))
    for node in ("n1", "n2"):
        for rank in (0, 1):
            store.write_snapshot(store.step_dir(root / node, 4), rank, [b"x"], {"step": 4})
    store.write_snapshot(store.step_dir(other / "n1", 4), 1, [b"x"], {"step": 4})

    assert snapshot_wipe.main([str(tmp_path), "9", "--rank", "1"]) == 0
    assert len(capsys.readouterr().out.split()) == 4  # rank 1's file and entry on both node folders
    assert [sorted(store.holdings(root / n)[4]) for n in ("n1", "n2")] == [[0], [0]]
    assert snapshot_wipe.main([str(tmp_path), "9"]) == 0
    assert not root.exists() and store.holdings(other / "n1")  # another job's are not touched
