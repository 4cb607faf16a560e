"""bench.goodput's arithmetic on a synthetic preempted run (the benchmark itself needs the Slurm cluster)."""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import datetime

import pytest

from relaytrain.job.allocations import JobRun, SlurmRuns

from bench import kept
from bench.cluster import goodput
from bench.cluster.goodput_crash_extrapolation import SNAPSHOT_RUNS, CrashExtrapolation, render_extrapolation
from bench.cluster.goodput_extrapolation import (
    Extrapolation,
    cost_budget_s,
    sensitivity,
)
from bench.cluster.goodput_page import interruptions_cell, render
from bench.cluster.goodput_results import (
    ResultsFile,
    RunResult,
    analyse,
    load_results,
    merge_results,
    save_results,
    save_seconds,
)
from bench.cluster.harness import RunFiles
from bench.cluster.ledger_figures import adds_up


def log_line(t: float, message: str) -> str:
    stamp = datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")
    return f"{stamp} [rank 0 node1 local 0] INFO relaytrain.checkpoint: {message}"


def test_goodput_and_the_split_of_one_preemption(tmp_path, monkeypatch):
    t0 = 1_000_000.0
    first, second = {"job_id": "5", "restart": 0}, {"job_id": "5", "restart": 1}
    rows = [{"kind": "event", "event": "start", "step": 0, "time": t0, **first}]
    rows += [{"kind": "train", "step": s, "time": t0 + s, "time_step_s": 0.5, **first} for s in range(1, 7)]
    rows += [{"kind": "event", "event": "stop", "step": 6, "time": t0 + 6.6, **first}]  # after the save
    rows += [{"kind": "event", "event": "resume", "step": 4, "time": t0 + 30, **second}]
    rows += [{"kind": "train", "step": s, "time": t0 + 27 + s, "time_step_s": 0.5, **second}
             for s in range(5, 11)]  # fmt: skip
    # the trainer's ledger windows: 0.6 s a step (the step's time_step_s, 0.5 s, is not all of it)
    rows += [{"kind": "ledger", "step": r["step"], "time": r["time"], "job_id": "5", "restart": r["restart"],
              "window": {"from_step": r["step"], "since": r["time"] - 0.6}, "seconds": {}}
             for r in rows if r["kind"] == "train"]  # fmt: skip
    rows.sort(key=lambda r: r["time"])
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    log = "\n".join([
        log_line(t0 + 6.5, "checkpoint step 6 (preemption) committed: /x/s6 (write 0.50s, blocking 0.50s)"),
        log_line(t0 + 29, "resuming from /x/step_6 (step 6): latest"),
    ])  # fmt: skip
    runs = [(t0 - 1, t0 + 9), (t0 + 20, t0 + 40)]
    sacct = [JobRun("5", i, start, end, running=False) for i, (start, end) in enumerate(runs)]
    answer = SlurmRuns(sacct)  # what sacct answers
    monkeypatch.setattr("relaytrain.monitor.run_ledger.slurm_runs", lambda jobs: answer)
    result = RunResult("preempt-60s", "preempted")
    analyse(result, RunFiles(tmp_path), runs, log)

    assert (result.steps, result.replayed, result.interruptions) == (10, 2, 1)
    # from the ledger: steps 1-10 once at 0.6 s (steps 5 and 6 run twice: replayed), sacct's 30 s
    assert result.productive_s == pytest.approx(6.0) and result.allocated_s == pytest.approx(30.0)
    assert result.goodput == pytest.approx(6.0 / 30.0)
    ledger = result.ledger
    assert ledger["buckets"]["replayed"] == pytest.approx(1.2) and ledger["goodput"] == pytest.approx(0.2)
    assert (ledger["allocations"], ledger["sacct_s"], ledger["vs_sacct"]) == (2, 30.0, 0.0)
    assert sum(ledger["buckets"].values()) == pytest.approx(30.0)
    (s2e,) = result.signal_to_exit
    assert s2e == pytest.approx({"total": 3.0, "save": 0.6, "exit": 2.4, "write": 0.5})
    (r2s,) = result.requeue_to_step
    assert r2s == pytest.approx({"total": 22.5, "queue": 11.0, "startup": 9.0, "load": 1.0})


def test_a_run_that_recorded_nothing_is_an_error_not_a_crash_of_the_benchmark(tmp_path):
    result = RunResult("crash-in-place-30s", "kill")
    analyse(result, RunFiles(tmp_path / "never-started"), [], "")
    assert result.error.startswith("no time ledger: no metrics file at ") and result.ledger == {}


def test_the_7b_extrapolation_formula():
    x = Extrapolation(params=7e9, write_gbps=2.0, startup_s=60, exit_s=5, step_s=10, lost_steps=1)
    assert x.save_s == pytest.approx(42.0)  # 7e9 x 12 B / 2 GB/s
    assert x.cost_s() == pytest.approx(42 + 5 + 60 + 42 + 10)
    assert x.goodput(1800) == pytest.approx(1 - 159 / 1800 - x.async_block_s / x.ckpt_every_s)
    assert x.goodput(14400) > x.goodput(1800)
    assert "goodput(T) = 1 −" in render_extrapolation(x)


def run(name: str, **fields) -> RunResult:
    return RunResult(name, fields.pop("interruption", "none"), **fields)


def test_a_time_limit_stop_is_counted_with_its_reason_and_positive_signal_to_exit(tmp_path):
    t0 = 2_000_000.0
    rows = [{"kind": "train", "step": s, "time": t0 + s, "time_step_s": 0.5} for s in range(1, 5)]
    rows += [{"kind": "event", "event": "stop", "step": 4, "time": t0 + 4.4, "reason": "time_limit_signal"}]
    rows += [{"kind": "event", "event": "resume", "step": 4, "time": t0 + 25}]
    rows += [{"kind": "train", "step": s, "time": t0 + 21 + s, "time_step_s": 0.5} for s in range(5, 9)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    log = "\n".join([
        log_line(t0 + 2, "checkpoint step 2 (interval) committed: /x/s2 (write 0.10s, blocking 0.01s)"),
        log_line(t0 + 4, "checkpoint step 4 (time_limit_signal) committed: /x (write 0.30s, blocking 0.30s)"),
    ])  # fmt: skip
    result = RunResult("time-limit", "time limit")
    # the job requeues itself after the save: its End comes after the stop, not at the signal
    analyse(result, RunFiles(tmp_path), [(t0 - 1, t0 + 5), (t0 + 17, t0 + 30)], log)

    assert (result.interruptions, result.replayed, result.stop_reasons) == (1, 0, ["time_limit_signal"])
    (s2e,) = result.signal_to_exit
    assert s2e == pytest.approx({"total": 1.0, "save": 0.4, "exit": 0.6, "write": 0.3})
    assert interruptions_cell(result) == "1 (time_limit_signal)"
    result.interruptions, result.stop_reasons = 3, ["time_limit_signal", "time_budget", "time_limit_signal"]
    assert interruptions_cell(result) == "3 (2 time_limit_signal, 1 time_budget)"


def test_results_files_carry_their_command_and_load_and_the_old_list_format_still_reads(tmp_path):
    new = ResultsFile("python -m bench.goodput --only time-limit", "0.5/0.4/0.3", "2026-11-23",
                              [run("time-limit", job="7", steps=240)])  # fmt: skip
    save_results(tmp_path / "new.json", new)
    assert load_results(tmp_path / "new.json") == new

    (tmp_path / "old.json").write_text(json.dumps([asdict(run("uninterrupted", job="1"))]))
    old = load_results(tmp_path / "old.json")
    assert (old.command, old.load, [r.name for r in old.runs]) == ("", "", ["uninterrupted"])


def test_merging_keeps_each_run_once_from_the_file_that_measured_it_last():
    first = ResultsFile("cmd A", runs=[run("uninterrupted", job="1"), run("preempt-60s", job="2"),
                                               run("time-limit")])  # fmt: skip
    second = ResultsFile("cmd B", runs=[run("time-limit", job="3")])
    third = ResultsFile("cmd C", runs=[run("preempt-60s", error="timed out")])

    merged = merge_results([first, second, third])

    assert [(f.command, [(r.name, r.job) for r in runs]) for f, runs in merged] == [
        ("cmd A", [("uninterrupted", "1")]),
        ("cmd B", [("time-limit", "3")]),
        ("cmd C", [("preempt-60s", "")]),
    ]
    assert merge_results([ResultsFile("cmd D", runs=[run("time-limit")])]) == []


def test_the_section_names_each_measuring_command_once_and_keeps_notes_separate():
    preempt = ResultsFile(
        "python -m bench.goodput --intervals 60,120 --steps 240", "0.7/1.2/1.6", "2026-11-23",
        [run("uninterrupted", job="1", steps=240, allocated_s=10, productive_s=9, final="finished")],
    )  # fmt: skip
    limit = ResultsFile(runs=[run("time-limit", job="2", steps=240, error="the run did not finish")])
    notes = ["First note: **steps lost 0**.", "Second note."]

    section = render(merge_results([preempt, limit]), {"cpu": "CPU", "cores": 2}, notes)

    assert "- uninterrupted: `python -m bench.goodput --intervals 60,120 --steps 240` (2026-11-23; " \
        "load average 1/5/15 min start → end: 0.7/1.2/1.6)" in section  # fmt: skip
    assert "- time-limit: command not recorded (date not recorded; load not recorded)" in section
    assert "--page-from" not in section and "--note" not in section
    for note in notes:
        assert section.count(note) == 1 and f"\n\n{note}\n" in section
    assert section.index("| uninterrupted |") < section.index("| time-limit |") < section.index(notes[0])
    assert "| finished |" in section and "| the run did not finish |" in section
    assert "time ledger" not in section  # results kept before the benchmark read the ledger
    figures = {"allocated_s": 30.0, "goodput": 0.2, "vs_sacct": 0.0,
               "buckets": {"productive": 6.0, "startup": 20.0, "eval": 0.0, "unaccounted": 4.0}}  # fmt: skip
    preempt.runs[0].ledger = figures
    section = render(merge_results([preempt, limit]), {"cpu": "CPU", "cores": 2}, notes)
    assert "| run | allocated s | productive | startup | unaccounted | goodput | ledger − sacct |" in section
    assert "| uninterrupted | 30.0 | 6.0 | 20.0 | 4.0 | 20.0% | +0.0% |" in section


def test_page_from_merges_several_files_and_writes_only_the_goodput_section(tmp_path, monkeypatch):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    save_results(a, ResultsFile("cmd A", runs=[run("uninterrupted", job="1")]))
    save_results(b, ResultsFile("cmd B", runs=[run("time-limit", job="2")]))
    written = {}
    monkeypatch.setattr(goodput, "write_page", lambda sections, order=(): written.update(sections))

    assert goodput.main(["--page-from", str(a), str(b), "--note", "N."]) == 0

    assert list(written) == ["goodput", "goodput-extrapolation"]
    section = written["goodput"]
    assert "`cmd A`" in section and "`cmd B`" in section and "\nN.\n" in section
    assert written["goodput-extrapolation"].startswith("### 7B-class extrapolation")


def test_only_refuses_a_run_that_is_not_planned(capsys):
    with pytest.raises(SystemExit):
        goodput.main(["--only", "time-limit,preempt-90s", "--intervals", "60"])
    err = capsys.readouterr().err
    assert "--only: no run named preempt-90s; runs: uninterrupted, preempt-60s, time-limit" in err


def test_the_time_limit_run_is_stopped_by_the_signal_and_its_requeue_cap_covers_the_run():
    overrides = goodput.time_limit_overrides(240)
    assert "--resilience.time_budget_margin_s=0" in overrides  # else a 1-minute job stops after step 1
    # Slurm's early signal leaves as few as 5 steps a job: 240 steps may need 48 jobs, more than 20
    assert "--resilience.max_requeues=96" in overrides
    assert not any("max_requeues" in o for o in goodput.time_limit_overrides(100))  # 20 jobs: default
    (time_limit,) = [r for r in goodput.planned_runs([60.0], True, 240) if r.name == "time-limit"]
    assert "max_requeues=96" in time_limit.interruption


def test_the_sensitivity_grid_says_what_reaches_the_target():
    x = Extrapolation()
    assert cost_budget_s(x) == pytest.approx(0.02 * 1800 - 1)
    grid = sensitivity(x)
    assert grid[2.0, 60.0, 1.0].goodput(1800) == pytest.approx(x.goodput(1800))
    assert grid[50.0, 20.0, 0.0].goodput(1800) >= 0.98 > grid[50.0, 20.0, 1.0].goodput(1800)
    text = render_extrapolation(x)
    assert "not met with the default inputs" in text
    assert "only 50 GB/s, start-up 20 s, 0 lost steps reaches it" in text


def test_a_stop_at_an_interval_step_is_matched_with_that_checkpoint_and_not_the_next_emergency_save():
    text = "\n".join([
        log_line(0, "checkpoint step 30 (interval) committed: /x/step_30 (write 0.07s, blocking 0.02s)"),
        log_line(1, "step 30 is already checkpointed; nothing to save (time_limit_signal)"),
        log_line(9, "checkpoint step 38 (time_limit_signal) committed: /x (write 0.13s, blocking 0.03s)"),
    ])  # fmt: skip
    assert save_seconds(text) == {30: 0.07, 38: 0.13}


def test_a_capped_preemption_waits_for_the_run_to_train_in_its_current_allocation(tmp_path, monkeypatch):
    job = {"JobState": "RUNNING", "Restarts": "1"}
    monkeypatch.setattr(goodput, "scontrol_job", lambda job_id: job)
    run = RunFiles(tmp_path)
    assert not goodput.training("5", run)  # no metrics yet: starting up
    rows = [{"kind": "train", "step": 1, "time": 1.0, "restart": 0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert not goodput.training("5", run)  # trained, but in the allocation before the requeue
    rows.append({"kind": "train", "step": 2, "time": 2.0, "restart": 1})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert goodput.training("5", run)
    job["JobState"] = "PENDING"
    assert not goodput.training("5", run)


@pytest.mark.slurm
def test_quick_goodput_run_on_the_local_cluster(slurm_cluster, tmp_path, capsys):
    """`--quick`: the run preempted once, 40 s in, alone, 80 steps (under `flock`, hence --no-lock)."""
    code = goodput.main(["--quick", "--no-lock", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    saved = load_results(next(tmp_path.glob("run-*/results.json")))

    assert code == 0, [r.error for r in saved.runs] + [out[-3000:]]  # the run's own error first
    assert saved.command == f"python -m bench.goodput --quick --no-lock --out {tmp_path}" and saved.load
    (preempted,) = saved.runs
    assert preempted.name == "preempt-40s"
    assert preempted.final == f"finished (max_steps) at step {goodput.QUICK_STEPS}"
    assert preempted.interruptions == goodput.QUICK_PREEMPTIONS
    assert set(preempted.stop_reasons) == {"preemption"}
    assert preempted.replayed <= preempted.interruptions  # at most 1 step lost per interruption
    assert len(preempted.signal_to_exit) == preempted.interruptions
    assert 0 < preempted.goodput <= 1
    # the figures are the run's time ledger's, and it adds up to sacct's elapsed time of the job's runs
    ledger = preempted.ledger
    assert preempted.goodput == pytest.approx(ledger["goodput"], abs=1e-4), ledger
    assert ledger["allocations"] >= preempted.interruptions + 1 and adds_up(ledger), ledger


def test_a_crash_costs_a_restore_and_a_step_with_snapshots_against_a_load_and_half_an_interval():
    base = Extrapolation(params=6.4e9, write_gbps=2.0, startup_s=60, step_s=10, ckpt_every_s=1800)
    c = CrashExtrapolation(base, ranks=64, detection_s=1.5, restore_local_gbps=1.2, restore_peer_gbps=0.8,
                           blocking_gbps=8.0, replicate_gbps=0.4, shm_write_gbps=0.8)  # fmt: skip
    assert c.state_gb == pytest.approx(1.2)  # 6.4e9 x 12 B / 64 ranks
    assert c.dcp_cost_s() == pytest.approx(1.5 + 60 + base.load_s + 900)
    assert c.snapshot_cost_s(peer=False) == pytest.approx(1.5 + 60 + 1.0 + 10)
    assert c.snapshot_cost_s(peer=True) == pytest.approx(1.5 + 60 + 1.5 + 10)
    assert c.background_s() == pytest.approx(3.0 + 3.0) and c.snapshot_overhead() == pytest.approx(0.015)
    periodic = base.async_block_s / base.ckpt_every_s
    assert c.goodput(3600, True) == pytest.approx(1 - 72.5 / 3600 - periodic - 0.015)
    slow = CrashExtrapolation(base, ranks=64, replicate_gbps=0.1, shm_write_gbps=0.8, blocking_gbps=8.0)
    assert slow.snapshot_overhead() == pytest.approx((0.15 + 12 + 3 - 10) / 10)  # waits for the replica
    text = render_extrapolation(base)
    assert "### Crashes at 7B scale" in text and "**measured**" in text and "**Assumed**" in text


def test_extrapolation_rewrites_only_its_own_section(tmp_path, monkeypatch):
    """The measured runs' section ("goodput") stays as it is; the extrapolation's ("goodput-extrapolation")
    is rebuilt from the kept results and its stated assumptions alone, after it."""
    page = tmp_path / "benchmarks.md"
    measured = "<!-- bench:goodput -->\n## Goodput\n\n| run | goodput |\n| --- | --- |\n| a | 50% |\n"
    measured += "<!-- /bench:goodput -->\n"
    page.write_text(f"# B\n\n{measured}\n<!-- bench:goodput-extrapolation -->\nold\n"
                    "<!-- /bench:goodput-extrapolation -->\n\nafter\n")  # fmt: skip
    monkeypatch.setenv("BENCH_PAGE", str(page))  # the page every generator writes (bench.report.page_path)

    command = "python -m bench.goodput --extrapolation"
    text = render_extrapolation(Extrapolation())
    assert f"Rewritten from the kept results by `{command}`".lower() in text.lower()  # the page test runs it
    assert goodput.main(command.split()[3:]) == 0

    text = page.read_text()
    assert measured in text and "\nold\n" not in text and text.endswith("\nafter\n")
    assert text.count("### 7B-class extrapolation") == 1 and "### Crashes at 7B scale" in text
    page.write_text("# B\n")  # a page without the sections: the extrapolation's is added
    assert goodput.main(["--extrapolation"]) == 0
    assert "<!-- bench:goodput-extrapolation -->\n### 7B-class extrapolation" in page.read_text()


def crash_row(name: str, crashes: int, peer: int = 0, **fields) -> dict:
    return {"name": name, "interruption": "kill", "crashes": crashes, "replayed": 0, "total": 6.0,
            "detection": 1.5, "queue": 0.0, "startup": 4.0, "load": 0.2, "goodput": 0.7,
            "losses_identical": True, "peer_restores": peer, "end": "finished", **fields}  # fmt: skip


def test_the_crash_table_says_how_many_restores_took_the_peer_nodes_replica():
    from bench.cluster.goodput_crash import CRASH_RUNS, NODE_MEMORY_LOST, render_crashes

    assert set(CRASH_RUNS) >= NODE_MEMORY_LOST
    results = {"command": "python -m bench.goodput --crashes", "date": "2026-11-24", "cpu": "cpu",
               "runs": [crash_row("crash-in-place-snapshots-30s", 1),
                        crash_row("crash-in-place-peer-30s", 2, peer=2)]}  # fmt: skip
    page = render_crashes(results, "bench/results/x.json")
    peer_row = next(line for line in page.splitlines() if line.startswith("| crash-in-place-peer-30s"))
    assert "kill (2 of 2 restored from the peer)" in peer_row
    assert "restored from the peer" not in next(line for line in page.splitlines() if "snapshots-30s" in line)
    assert "`python -m bench.goodput --crash-page-from bench/results/x.json`" in page


def write_crash_run(path, kills: list[float], peer_files: list[int], extra_lines: int) -> None:
    """A restarted-in-place run: each kill a crash line, a restore log line (`peer_files` of 2 files
    from a peer), a resume event; `extra_lines` more peer-restore lines that belong to no kill."""
    rows, crashes, log = [], [], []
    for i, (kill, peer) in enumerate(zip(kills, peer_files, strict=True)):
        crashes.append({"time": kill + 2, "action": "restart", "step": 10 * i + 5})
        rows.append({"kind": "event", "event": "resume", "step": 10 * i + 5, "time": kill + 8})
        rows.append({"kind": "train", "step": 10 * i + 6, "time": kill + 9, "time_step_s": 0.5})
        log.append(log_line(kill + 6, f"resuming from the snapshot of step {10 * i + 5} in node memory "
                                      f"({peer} of 2 rank file(s) from a peer node): newer"))  # fmt: skip
    log += [log_line(kills[-1] + 100 + k, "resuming from the snapshot of step 99 in node memory (1 of 2 "
                     "rank file(s) from a peer node): newer") for k in range(extra_lines)]  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "crashes.jsonl").write_text("".join(json.dumps(c) + "\n" for c in crashes))
    (path / "job.log").write_text("\n".join(log))


def test_a_restore_from_the_peer_is_counted_once_per_crash_from_the_restore_that_crash_led_to(tmp_path):
    from bench.cluster.goodput_crash import crash_splits

    t0 = 3_000_000.0
    kills = [t0, t0 + 60, t0 + 120]
    write_crash_run(tmp_path, kills, peer_files=[1, 0, 1], extra_lines=4)
    log = (tmp_path / "job.log").read_text()
    splits = crash_splits(RunFiles(tmp_path), [(t0 - 50, t0 + 400)], log, kills)
    assert [c["from_peer"] for c in splits] == [True, False, True]  # not 6 lines over the whole job
    assert [c["detection"] for c in splits] == [2.0, 2.0, 2.0]


def test_a_crash_run_counts_only_when_every_step_was_logged_and_it_finished(tmp_path):
    from bench.cluster.goodput_crash import completeness, losses_match

    run, reference = RunFiles(tmp_path / "run"), RunFiles(tmp_path / "ref")
    for files, steps in ((run, [1, 2, 2, 4]), (reference, [1, 2, 3, 4])):
        files.path.mkdir()
        rows = [{"kind": "train", "step": s, "loss": float(s), "time": 1.0} for s in steps]
        (files.path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    finished = {"status": "finished", "step": 4}
    assert completeness(run, finished, 4) == "steps never logged: [3]"
    assert not losses_match(run, reference)  # every logged loss matches, but step 3 is missing
    assert completeness(reference, finished, 4) == "" and losses_match(reference, reference)
    assert completeness(reference, {"status": "running", "step": 3}, 4) == "the run did not finish at step 4"


def test_every_measured_input_of_the_crash_extrapolation_is_read_from_its_kept_file(tmp_path, monkeypatch):
    import shutil

    from bench.cluster.goodput_crash_extrapolation import CRASH_RUN

    for name in (*SNAPSHOT_RUNS, CRASH_RUN):
        shutil.copy(kept.path_of(name), tmp_path / name)
    monkeypatch.setattr(kept, "RESULTS_DIR", tmp_path)
    text = render_extrapolation(Extrapolation())
    for shown in (
        "replication 264 MB/s",
        "replication 178 MB/s",
        "(0.987 s)",
        "(2.13 s)",
        "detection 2.23 s",
    ):
        assert shown in text
    assert "exit 5 s (assumed: Slurm's GraceTime" in text and "async blocking 1 s (assumed)" in text

    fast = kept.load(tmp_path / SNAPSHOT_RUNS[1])
    fast["figures"]["replicate_mb_s"] = 900
    kept.save(str(tmp_path / SNAPSHOT_RUNS[1]), fast)
    crash = kept.load(tmp_path / CRASH_RUN)
    for row in crash["runs"]:
        row["detection"] = 4.0
    kept.save(str(tmp_path / CRASH_RUN), crash)
    changed = render_extrapolation(Extrapolation())
    assert "replication 900 MB/s" in changed and "replication 178 MB/s" not in changed
    assert "detection 4.00 s" in changed
    (tmp_path / CRASH_RUN).unlink()
    with pytest.raises(ValueError, match="kept results .*goodput-crash"):
        render_extrapolation(Extrapolation())


def test_both_snapshot_runs_are_shown_and_the_grid_marks_where_snapshots_lose_to_dcp():
    text = render_extrapolation(Extrapolation())
    assert "07:25 UTC's figures a snapshot every step beats DCP only" in text
    assert "07:39 UTC's figures a snapshot every step **loses to** DCP only" in text
    grid = text[text.index("Sensitivity: goodput with a snapshot every N steps") :]
    row = next(line for line in grid.splitlines() if line.startswith("| 178 (run"))
    cells = row.split(" | ")
    assert cells[3].startswith("**") and not cells[4].startswith(
        "**"
    )  # 10 s step: every 1 loses, every 4 not


def test_only_a_restore_that_took_a_peers_file_counts_as_from_the_peer():
    from bench.cluster.goodput_crash import from_peer

    line = "INFO relaytrain.checkpoint: resuming from the snapshot of step {} in node memory ({} of 2 "
    lines = [line.format(step, n) + "rank file(s) from a peer node): newer than the newest checkpoint"
             for step, n in ((37, 0), (70, 1), (100, 2))]  # fmt: skip
    assert [from_peer(x) for x in lines] == [False, True, True]
    assert not from_peer("resuming from /x/step_10 (step 10): latest")


def test_a_crash_run_is_kept_as_the_row_the_page_shows_and_detection_is_the_mean_over_every_crash():
    from bench.cluster.goodput_crash import CrashRun, mean_detection, render_crashes, summary

    split = {"action": "restart", "detection": 2.0, "queue": 0.0, "startup": 4.0, "load": 0.5, "total": 7.0,
             "replayed": 1, "from_peer": True}  # fmt: skip
    run = CrashRun(RunResult("crash-in-place-peer-30s", "kill", allocated_s=10, productive_s=7,
                             final="finished (max_steps) at step 120"), 30.0,
                   crashes=[split, {**split, "detection": 3.0, "from_peer": False}], losses_identical=True,
                   peer_restores=1)  # fmt: skip
    row = summary(run)
    assert (row["crashes"], row["detection"], row["goodput"], row["end"]) == (2, 2.5, 0.7, run.result.final)
    weighted = mean_detection([row, {**row, "crashes": 6, "detection": 1.5}])
    assert weighted == pytest.approx((2 * 2.5 + 6 * 1.5) / 8)
    page = render_crashes({"command": "c", "date": "d", "cpu": "cpu", "runs": [row]}, "k.json")
    line = next(x for x in page.splitlines() if x.startswith("| crash-in-place"))
    assert line == (
        "| crash-in-place-peer-30s | kill (1 of 2 restored from the peer) | 2 | 1.00 | 7.00 (2.50 + 0 + 4.00 "
        "+ 0.500) | 70.0% | yes | finished (max_steps) at step 120 |"
    )
