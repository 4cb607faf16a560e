"""bench.chaos --hangs (bench/cluster/chaos_hangs*.py): how a hang trial's job log, metrics and hang record
are read and judged, and how its section is written, on synthetic runs (fast, no Slurm)."""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
from dataclasses import asdict
from datetime import datetime

import pytest

from relaytrain.resilience.hangs.monitor import NEAREST

from bench.cluster import chaos
from bench.cluster.chaos_hangs import HANG_ALLOWED, draw, fault_landed, first_run_setup
from bench.cluster.chaos_hangs_clean import (
    CLEAN_VARIANTS,
    CONFIGS,
    VariantBenches,
    clean_variant,
    cold_setup,
    parse_variants,
    remove_cold_folder,
    write_clean_config,
)
from bench.cluster.chaos_hangs_judge import (
    HangTrial,
    culprit_correct,
    detections,
    first_step_after_restart,
    judge,
    line_time,
    slow_lines,
)
from bench.cluster.chaos_hangs_page import render_hangs_section, targets
from bench.cluster.chaos_page import results_data
from bench.cluster.chaos_run import STEPS, Bench
from bench.cluster.harness import RunFiles, watched_rank
from bench.report import REPO

FAULT = datetime(2026, 11, 27, 3, 10, 0).timestamp()
DETECTED = "hang detected: rank 1 on n2 in data at step 12 (state S); 41 s without progress; report logs/x.md"
CULPRIT = {"rank": 1, "node": "n2", "phase": "data", "why": "behind"}
HUNG = [{"job_id": "7", "step": 12, "action": "restart", "hang": {"culprits": [CULPRIT]}}]  # crashes.jsonl


def log(*lines: str) -> str:
    return "\n".join(["[relaytrain 2026-11-27T03:09:50] job 7: restart count 0", *lines, "trailing output"])


def records(fault_to_restart_s: float = 50.0) -> list[dict]:
    train = [{"kind": "train", "step": s, "time": FAULT - 12 + s, "loss": 1.0} for s in range(1, 12)]
    resume = {"kind": "event", "event": "resume", "step": 11, "time": FAULT + 45, "step_restart": 1}
    again = [{"kind": "train", "step": s, "time": FAULT + fault_to_restart_s + s - 12, "step_restart": 1}
             for s in range(12, 15)]  # fmt: skip
    return [*train, resume, *again]


def hang_record(at: float | None = FAULT + 41.25, **extra) -> dict:
    return {"job_id": "7", "step_restarts": 0, "step": 12, "detected_at": at, "culprits": [CULPRIT],
            "line": DETECTED, **extra}  # fmt: skip


def test_both_stamps_of_a_log_line_read_as_local_time():
    assert line_time("[relaytrain 2026-11-27T03:10:41] hang detected: x") == FAULT + 41
    assert line_time("2026-11-27 03:10:41 [rank 0 n1 local 0] WARNING x: hang detected: y") == FAULT + 41
    assert line_time("2026-11-27 03:10:41,500 rank 0") == FAULT + 41.5
    assert line_time("hang detected: no stamp") is None


def test_a_detection_takes_the_records_time_for_its_line_else_its_stamp_else_none():
    plain = log(DETECTED)
    (found,) = detections(plain, hang_record())
    assert (found.time, found.source) == (FAULT + 41.25, "hang/last.json detected_at")
    stamped = log(f"[relaytrain 2026-11-27T03:10:42] {DETECTED}")
    assert detections(stamped, {})[0].time == FAULT + 42  # no record: the stamp
    assert detections(stamped, hang_record(line="hang detected: another hang"))[0].source == "job log stamp"
    assert detections(plain, {})[0].time is None
    assert detections(log(), hang_record())[0].source == "hang/last.json only (no job-log line)"
    assert detections(log(), {}) == []


def test_the_culprit_is_right_only_when_it_is_the_faulted_rank_alone_on_its_node():
    assert culprit_correct(hang_record(), 1, "n2")
    assert not culprit_correct(hang_record(), 1, "n1")
    assert not culprit_correct(hang_record(), 0, "n2")
    both = hang_record(culprits=[CULPRIT, {**CULPRIT, "rank": 0, "node": "n1"}])
    assert not culprit_correct(both, 1, "n2")
    assert not culprit_correct({}, 1, "n2") and not culprit_correct({"culprits": "rank 1"}, 1, "n2")


def test_the_first_step_after_the_restart_is_the_first_train_record_of_a_restarted_step():
    assert first_step_after_restart(records())["step"] == 12
    assert first_step_after_restart([r for r in records() if not r.get("step_restart")]) is None


def hang_trial(**fields) -> HangTrial:
    defaults = dict(index=0, kind="hang_fifo", rank=1, node="n2", fault_time=FAULT, bit_exact=True,
                    latest_complete=True, final_status="finished", evidence=["landed: FIFO"])  # fmt: skip
    return HangTrial(**(defaults | fields))


def test_a_hang_trial_is_judged_on_detection_time_culprit_and_restart():
    trial = hang_trial()
    judge(trial, log(DETECTED), hang_record(), records(), HUNG)
    assert (trial.detection_s, trial.restart_s, trial.step_restarts) == (41.2, 50.0, 1)
    assert trial.checks == {"hang detected once": True, "detected within 60 s": True,
                            "culprit rank and node named": True, "restarted in place": True}  # fmt: skip
    assert trial.ok
    late = hang_trial()
    judge(late, log(DETECTED), hang_record(at=FAULT + 75), records())
    assert late.detection_s == 75 and not late.checks["detected within 60 s"] and not late.ok
    wrong = hang_trial(node="n1")
    judge(wrong, log(DETECTED), hang_record(), records())
    assert not wrong.checks["culprit rank and node named"] and not wrong.ok
    undetected = hang_trial()
    judge(undetected, log(), {}, [r for r in records() if not r.get("step_restart")])
    assert undetected.detection_s is None and not any(undetected.checks.values())
    requeued = hang_trial(restarts=1)  # the hang's crash went the requeue way
    judge(requeued, log(DETECTED), hang_record(), records(), [HUNG[0] | {"action": "requeue"}])
    assert not requeued.checks["restarted in place"]
    unrecorded = hang_trial()
    judge(unrecorded, log(DETECTED), hang_record(), records(), [])
    assert not unrecorded.checks["restarted in place"]
    # restarted in place for the hang, the job requeued later at its time budget: the hang's answer holds
    later = hang_trial(restarts=1)
    judge(later, log(DETECTED), hang_record(), records(), [{"action": "restart", "why": "exit 1"}, *HUNG])
    assert later.checks["restarted in place"] and later.ok
    assert not hang_trial(evidence=[]).ok  # without evidence of the fault a trial does not count


def test_a_long_step_trial_also_needs_a_step_median_of_20_s_before_the_fault():
    def timed(seconds: float) -> list[dict]:
        return [{**r, "time_step_s": seconds} if r["kind"] == "train" else r for r in records()]

    trial = hang_trial(kind="hang_stop_long_step")
    judge(trial, log(DETECTED), hang_record(), timed(21.0), HUNG)
    assert trial.checks["step median >= 20 s"] and trial.ok, trial.checks
    assert "step median 21.0 s over 11 steps before the fault" in trial.detail
    short = hang_trial(kind="hang_stop_long_step")
    judge(short, log(DETECTED), hang_record(), timed(0.5))
    assert not short.checks["step median >= 20 s"] and not short.ok


def test_a_slow_rank_passes_with_its_line_and_no_restart():
    slow = "[relaytrain 2026-11-27T03:11:00] slow rank: rank 1 on n2 behind the others in 9 of 10 samples"
    no_restart = [r for r in records() if not r.get("step_restart")]
    trial = hang_trial(kind="slow_rank")
    judge(trial, log(slow), {}, no_restart)
    assert trial.slow_lines == [slow.split("] ", 1)[1]] and trial.ok
    assert slow_lines(log(slow), 0) == [] and slow_lines(log("rank 1 is slow"), 1) == []
    other = hang_trial(kind="slow_rank", rank=0)
    judge(other, log(slow), {}, no_restart)
    assert not other.ok  # the line names another rank
    restarted = hang_trial(kind="slow_rank")
    judge(restarted, log(slow, DETECTED), hang_record(), records())
    assert not restarted.checks["no hang detected"] and not restarted.checks["no restart"]


def test_a_clean_run_fails_on_any_hang_line():
    no_restart = [r for r in records() if not r.get("step_restart")]
    clean = hang_trial(kind="clean", rank=-1, node="")
    judge(clean, log(), {}, no_restart)
    assert clean.detections == 0 and clean.ok
    false = hang_trial(kind="clean", rank=-1, node="")
    judge(false, log(DETECTED), hang_record(), no_restart)
    assert false.detections == 1 and not false.ok
    with pytest.raises(ValueError, match="no hang trial kind 'hang'"):
        judge(hang_trial(kind="hang"), log(), {}, [])


def test_a_clean_run_keeps_per_phase_the_pause_nearest_its_limit_over_its_job_steps(tmp_path):
    no_restart = [r for r in records() if not r.get("step_restart")]
    clean = hang_trial(kind="clean", rank=-1, node="", job="12")
    steps = [
        f"{NEAREST} forward/backward 3.0 s of 40 s; set-up 10.5 s of 120 s",
        f"{NEAREST} checkpoint save 30.0 s of 80 s; forward/backward 8.0 s of 40 s",
    ]
    judge(clean, log(*steps), {}, no_restart)
    assert clean.nearest == {"forward/backward": [8.0, 40.0], "set-up": [10.5, 120.0],
                             "checkpoint save": [30.0, 80.0]}  # fmt: skip
    page = targets([clean])
    assert (
        "checkpoint save 30 s of 80 s (38%); forward/backward 8 s of 40 s (20%); set-up 10.5 s of 120 s"
        in page
    )


def test_the_faults_own_landed_line_gives_its_time_not_the_step_delays():
    job_log = log(
        "relaytrain-faults: landed: 0.3 s step delay after step 1 on rank 1 [t=100.5]",
        "relaytrain-faults: landed: data loader stall at step 9 on rank 0 [t=101.25]",
        "relaytrain-faults: landed: data loader stall at step 9 on rank 1 [t=102.75]",
    )
    assert fault_landed(job_log, "hang_loader_stall", 1) == ("data loader stall at step 9 on rank 1", 102.75)
    assert fault_landed(job_log, "hang_fifo", 1) is None
    assert fault_landed(job_log, "slow_rank", 1) is None


def test_a_phase_kinds_landed_line_is_the_ranks_own_sigstop_in_that_phase():
    job_log = log(
        "relaytrain-faults: landed: SIGSTOP in evaluation on rank 0 [t=100.5]",
        "relaytrain-faults: landed: SIGSTOP in checkpoint save on rank 1 [t=101.25]",
    )
    assert fault_landed(job_log, "hang_stop_eval", 0) == ("SIGSTOP in evaluation on rank 0", 100.5)
    assert fault_landed(job_log, "hang_stop_save", 1) == ("SIGSTOP in checkpoint save on rank 1", 101.25)
    assert (
        fault_landed(job_log, "hang_stop_eval", 1) is None
        and fault_landed(job_log, "hang_stop_compile", 0) is None
    )
    setup = first_run_setup(rank=1, stop_in_phase="checkpoint save")  # a shell line: the label quoted
    assert 'RELAYTRAIN_FAULT_STOP_IN_PHASE="checkpoint save"' in setup and "'" not in setup
    echo = f'{setup}; echo "$RELAYTRAIN_FAULT_STOP_IN_PHASE"'
    shown = subprocess.run(
        ["sh", "-c", echo], capture_output=True, text=True, env={"PATH": os.environ["PATH"]}, check=True
    )
    assert shown.stdout == "checkpoint save\n"


def test_kinds_are_interleaved_and_checked():
    assert [t.kind for t in draw(["clean", "hang_fifo"], 2)] == ["clean", "hang_fifo", "clean", "hang_fifo"]
    assert [t.index for t in draw(["clean"], 3, start=5)] == [5, 6, 7]
    with pytest.raises(ValueError, match="no hang kind hang_nope"):
        draw(["hang_nope"], 1)


def test_the_faults_arm_in_the_first_run_only_and_hang_files_are_no_leftovers():
    setup = first_run_setup(rank=1, fifo_at_step=9)
    assert setup.startswith('if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then export ')
    assert "RELAYTRAIN_FAULT_FIFO_AT_STEP=9" in setup and "RELAYTRAIN_FAULT_RANK=1" in setup
    assert HANG_ALLOWED.match("hang/nodes/n1.json") and HANG_ALLOWED.match("checkpoints/step_10/x")
    assert not HANG_ALLOWED.match("stray.txt") and not HANG_ALLOWED.match("xhang/a")
    # a rank's compiled code (parallel.compile) is kept on purpose; a stray file beside it is not
    assert HANG_ALLOWED.match("compile/rank_1.bin") and not HANG_ALLOWED.match("compile/rank_1.bin.tmp")


def test_a_ranks_pid_and_node_come_from_the_node_watchers_files(tmp_path):
    run = RunFiles(tmp_path / "run")
    nodes = run.dir.hang / "nodes"
    nodes.mkdir(parents=True)
    rank = {"rank": 1, "pid": 4242, "node": "n2", "state": "S"}
    (nodes / "n2.json").write_text(json.dumps({"node": "n2", "job_id": "7", "ranks": [rank]}))
    (nodes / "n1.json").write_text('{"node": "n1", "job_id": "7", "ra')  # half written: skipped
    assert watched_rank(run, "7", 1) == (4242, "n2")
    assert watched_rank(run, "8", 1) is None and watched_rank(run, "7", 0) is None
    (nodes / "n2.json").write_text(
        json.dumps({"node": "n2", "job_id": "7", "ranks": [rank | {"state": "X"}]})
    )
    assert watched_rank(run, "7", 1) is None  # gone
    assert run.hang_record() == {}
    run.dir.hang_record.write_text(json.dumps(hang_record()))
    assert run.hang_record()["culprits"] == [CULPRIT]


def test_the_hangs_section_is_written_from_kept_results(tmp_path, monkeypatch):
    trials = [hang_trial(), hang_trial(index=1, kind="clean", rank=-1, node="", job="12")]
    judge(trials[0], log(DETECTED), hang_record(), records(), HUNG)
    judge(trials[1], log(), {}, [r for r in records() if not r.get("step_restart")])
    data = results_data("python -m bench.chaos --hangs hang_fifo,clean --trials 1", "2026-11-27", 7,
                        {"cpu": "cpu", "cores": 2}, "1.0/1.0/1.0 → 2.0/2.0/2.0", trials)  # fmt: skip
    kept = tmp_path / "hangs-seed7.json"
    kept.write_text(json.dumps(data))
    section = render_hangs_section([str(kept)])
    assert section.startswith("## Hangs: detected, named and restarted on real Slurm\n")
    assert "**2 of 2 trials passed.**" in section and "| 0 | hang_fifo | 1 on n2 |" in section
    assert "Detection ≤ 60 s after the fault: **met**: 1 of 1 hang trials (median 41.2 s" in section
    assert (
        "0 false detections in ≥ 20 clean runs: **not met**: 0 `hang detected:` line(s) in 1 clean runs"
        in section
    )
    assert (
        f"Rewritten from the kept results by `python -m bench.chaos --page-from {kept} --section hangs`"
        in section
    )
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n")
    monkeypatch.setenv("BENCH_PAGE", str(page))
    assert chaos.main(["--page-from", str(kept), "--section", "hangs"]) == 0
    assert "<!-- bench:hangs -->" in page.read_text() and section in page.read_text()
    wrong = tmp_path / "chaos.json"
    wrong.write_text(json.dumps({"trials": [{"index": 0, "phase": "mid_step", "event": "usr2"}]}))
    with pytest.raises(SystemExit):
        chaos.main(["--page-from", str(wrong), "--section", "hangs"])
    assert asdict(trials[0])["culprits"] == [CULPRIT]


def test_the_decisions_quote_of_the_hang_line_is_not_a_second_detection():
    line = "hang detected: rank 1 on nsnode2 in data (stopped) at step 12; report logs/hang-step12.md"
    log = "\n".join([line, f"relaytrain: crash ({line}); restarting the job step in place on the same nodes"])
    found = detections(log, {"line": line, "detected_at": 1000.5})
    assert [(d.line, d.time) for d in found] == [(line, 1000.5)]


def test_a_skipped_collective_that_gloo_fails_at_once_is_judged_as_the_crash_it_is():
    trial = HangTrial(4, "hang_skip_collective", rank=1, node="n2", fault_time=100.0)
    log = "landed: skipped ...\nwhat(): ... Is there a distributed collective mismatch?"
    records = [
        {"kind": "train", "step": 5, "time": 99.0},
        {"kind": "event", "event": "step_restart", "step": 4, "time": 101.5},
        {"kind": "train", "step": 5, "time": 110.0, "step_restart": 1},
    ]
    judge(trial, log, {}, records)
    assert trial.detection_s == 1.5 and trial.restart_s == 10.0 and "gloo failed" in trial.detail
    assert trial.checks == {
        "no hang detected": True,
        "the backend failed the mismatch, the step restarted in place": True,
    }


def test_clean_variants_cycle_by_trial_index_with_both_checkpoint_modes():
    pairs = [clean_variant(i) for i in range(2 * len(CLEAN_VARIANTS))]
    assert sorted(pairs) == sorted((v, m) for v in CLEAN_VARIANTS for m in ("async", "sync"))
    assert pairs[:4] == [("debug", "async"), ("wide", "async"), ("compile", "async"), ("restart", "async")]
    picked = parse_variants("wide, compile,restart")
    assert [clean_variant(i, picked) for i in (0, 1, 2, 3)] == [
        ("wide", "async"), ("compile", "async"), ("restart", "async"), ("wide", "sync")]  # fmt: skip
    with pytest.raises(ValueError, match="no clean variant huge; the variants: debug, wide"):
        parse_variants("wide,huge")
    with pytest.raises(ValueError, match=r"no clean variant \(none\)"):
        parse_variants(" , ")


def test_the_cold_compile_variant_turns_inductor_s_caches_off_in_a_folder_of_the_job_s_own(tmp_path):
    assert cold_setup("compile", tmp_path) == "" and cold_setup("debug", tmp_path) == ""
    line = cold_setup("compile_cold", tmp_path)
    env = subprocess.run(["bash", "-c", f"SLURM_JOB_ID=7; {line}; env"], capture_output=True, text=True)
    exported = env.stdout.splitlines()
    assert f"TORCHINDUCTOR_CACHE_DIR={tmp_path}/inductor-7" in exported
    assert "TORCHINDUCTOR_FORCE_DISABLE_CACHES=1" in exported
    (tmp_path / "inductor-7" / "ab").mkdir(parents=True)
    remove_cold_folder(tmp_path, "7")  # after the trial: its generated kernels are no bench source
    assert not (tmp_path / "inductor-7").exists()
    assert CONFIGS["compile_cold"] == CONFIGS["compile"]  # the same runs: compile's reference run serves


def test_each_clean_config_is_a_valid_config_of_its_model_steps_and_compile(tmp_path):
    from relaytrain.config.loader import load_config
    from relaytrain.model.flops import count_parameters

    debug = tomllib.loads((REPO / "configs" / "debug.toml").read_text())
    for variant in CLEAN_VARIANTS:
        (tmp_path / variant).mkdir()
        bench = Bench(tmp_path / variant, None)
        write_clean_config(bench, CONFIGS[variant])
        cfg = load_config(bench.config)
        assert cfg.parallel.compile == variant.startswith("compile")
        assert cfg.train.seq_len == debug["train"]["seq_len"] and cfg.checkpoint.mode == "async"
        state_gb = 12 * count_parameters(cfg.model) / 1e9  # fp32 weights and AdamW's two moments
        if variant == "wide":
            assert (cfg.train.max_steps, cfg.checkpoint.interval, cfg.train.eval_every) == (6, 2, 3)
            assert 1.1 < state_gb < 1.3
        elif variant == "long":  # the long-step trial's run: its steps slowed by the faults, not the config
            assert (cfg.train.max_steps, cfg.checkpoint.interval, cfg.train.eval_every) == (8, 4, 4)
            assert state_gb < 0.1
        else:
            assert (cfg.model.dim, cfg.model.n_layers) == (debug["model"]["dim"], debug["model"]["n_layers"])
            assert cfg.train.max_steps == STEPS and state_gb < 0.1


def test_a_variant_that_changes_the_losses_gets_its_own_reference_run(tmp_path, monkeypatch):
    made = []
    monkeypatch.setattr(Bench, "run_reference", lambda self: made.append(self.base.name))
    debug = Bench(tmp_path, "cluster")
    benches = VariantBenches(debug)
    assert benches("debug") is debug and benches("restart") is debug and made == [tmp_path.name]
    wide = benches("wide")
    assert wide is not debug and wide.cluster == "cluster" and benches("wide") is wide
    assert benches("compile").config.parent == tmp_path / "compile"
    assert made == [tmp_path.name, "wide", "compile"]  # once each
    assert "n_layers = 9" in wide.config.read_text() and "compile = true" not in wide.config.read_text()


def clean_trial(variant: str, **fields) -> HangTrial:
    return hang_trial(kind="clean", variant=variant, mode="sync", **fields)


KILLED = ["SIGKILL pid 4242 (rank 1): gone", "pid 4242 from hang/nodes"]
RESTART = {"job_id": "7", "step": 12, "action": "restart", "why": "exit code 1"}


def test_a_clean_restart_passes_only_with_the_kill_landed_restarted_in_place_and_no_hang_line():
    trial = clean_trial("restart", hit=KILLED)
    judge(trial, log(), {}, records(), [RESTART])
    assert trial.checks == {"no hang detected": True, "the killed rank's process gone": True,
                            "restarted in place for the kill": True} and trial.ok  # fmt: skip
    assert trial.restart_s == 50.0
    hung = clean_trial("restart", hit=KILLED)
    judge(hung, log(DETECTED), hang_record(), records(), [RESTART])
    assert not hung.checks["no hang detected"] and not hung.ok
    alive = clean_trial("restart", hit=["SIGKILL pid 4242 (rank 1): still running 10 s later"])
    judge(alive, log(), {}, records(), [RESTART])
    assert not alive.checks["the killed rank's process gone"] and not alive.ok
    for crashes in ([], [RESTART | {"action": "requeue"}], [RESTART | {"hang": {"culprits": [CULPRIT]}}]):
        unrecorded = clean_trial("restart", hit=KILLED)
        judge(unrecorded, log(), {}, records(), crashes)
        assert not unrecorded.checks["restarted in place for the kill"] and not unrecorded.ok
    requeued = clean_trial("restart", hit=KILLED, restarts=1)
    judge(requeued, log(), {}, records(), [RESTART])
    assert not requeued.ok


def test_the_other_clean_variants_fail_on_a_crash_and_show_their_variant_on_the_page(tmp_path):
    no_restart = [r for r in records() if not r.get("step_restart")]
    wide = clean_trial("wide", rank=-1, node="", detail="wide, checkpoint.mode=sync, 6 steps")
    judge(wide, log(), {}, no_restart, [])
    assert wide.ok and wide.checks == {"no hang detected": True, "no restart": True}
    crashed = clean_trial("compile", rank=-1, node="")
    judge(crashed, log(), {}, no_restart, [RESTART])
    assert not crashed.checks["no restart"] and not crashed.ok
    data = results_data("c", "2026-11-27", 7, {"cpu": "cpu", "cores": 2}, "", [wide])
    kept = tmp_path / "hangs-seed7.json"
    kept.write_text(json.dumps(data))
    row = "| 0 | clean (wide) | – | wide, checkpoint.mode=sync, 6 steps |"
    assert row in render_hangs_section([str(kept)])


def test_each_trial_gets_its_variant_and_the_flags_that_let_its_job_run_in_one_allocation():
    from bench.cluster.chaos_hangs_variants import OVERRIDES, assign_variant, overrides_of, time_limit_note

    def variant_of(kind: str, index: int = 0) -> HangTrial:
        trial = HangTrial(index, kind)
        assign_variant(trial)
        return trial

    restore, save, long = (
        variant_of(k) for k in ("hang_stop_restore", "hang_stop_save", "hang_stop_long_step")
    )
    assert [(t.variant, t.mode) for t in (restore, save, long)] == [("wide", "sync")] * 2 + [
        ("long", "async")
    ]
    assert (variant_of("clean", 1).variant, variant_of("hang_stop_rank0").variant) == ("wide", "")
    assert overrides_of(variant_of("hang_stop_rank1")) == OVERRIDES  # the debug bench as it is
    assert overrides_of(variant_of("hang_stop_eval")) == (*OVERRIDES, "--checkpoint.mode=async")
    wide = overrides_of(save)
    assert "--checkpoint.snapshot_every=0" in wide and "--checkpoint.mode=sync" in wide
    # 10 minutes leave 300 s of training after the time budget's margin: seed 5305's wide trials were
    # requeued at their time budget after their restarts in place
    for trial in (restore, save, long):
        assert "--slurm.time=00:30:00" in overrides_of(trial)
        assert time_limit_note(trial) == "; --slurm.time=00:30:00"
    assert (
        "--checkpoint.snapshot_every=2" in overrides_of(long) and time_limit_note(variant_of("clean")) == ""
    )


def test_the_wide_trials_flags_pass_the_plan_on_a_local_node_and_snapshots_would_not(tmp_path):
    """The save trial's launch error (seeds 5303, 5304): the plan refused the wide state's snapshots in
    /dev/shm on a node of 2.6 GiB (sinfo's figure for the local cluster's nodes)."""
    from relaytrain.config.loader import load_config
    from relaytrain.plan.checks import make_plan

    from bench.cluster.chaos_hangs_variants import OVERRIDES, assign_variant, overrides_of

    bench = Bench(tmp_path, None)
    write_clean_config(bench, CONFIGS["wide"])
    trial = HangTrial(0, "hang_stop_save")
    assign_variant(trial)

    def failed(flags) -> list[str]:
        cfg = load_config(bench.config, list(flags))
        plan = make_plan(cfg, 2, 0, tasks_per_node=1, host_memory=(2.6 * 1024**3, "sinfo"))
        return [f"{name}: {detail}" for name, level, detail in plan.checks if level == "fail"]

    assert failed(overrides_of(trial)) == []
    with_snapshots = [f for f in overrides_of(trial) if "snapshot_every" not in f] + [OVERRIDES[0]]
    refused = failed(with_snapshots)  # the refusal seeds 5303 and 5304 met, figure for figure
    assert len(refused) == 1 and refused[0].startswith("snapshots: 2.9 GiB per node: 2.3 GiB in /dev/shm")


def test_the_variants_reference_runs_come_before_the_trials_and_a_failed_one_fails_its_trials(
    tmp_path, monkeypatch
):
    from bench.cluster.chaos_hangs import HangTrials

    made = []

    def reference(self):
        made.append(self.base.name)
        if self.base.name == "long":
            raise RuntimeError("the reference run failed: boom")

    monkeypatch.setattr(Bench, "run_reference", reference)
    (tmp_path / "debug").mkdir()
    runner = HangTrials(Bench(tmp_path / "debug", "cluster"))
    trials = draw(["hang_stop_restore", "hang_stop_long_step", "hang_stop_save"], 2)
    runner.prepare(trials)
    assert made == ["wide", "long"]  # once per config, before any trial ran; no debug trial, no debug run
    long = trials[1]
    runner.run(long, rng=None)  # no Slurm: the trial ends on its reference's error
    assert long.error == "the long reference run: the reference run failed: boom" and made == ["wide", "long"]
    runner.prepare(draw(["hang_stop_rank1", "hang_fifo"], 1))
    assert made == ["wide", "long", "debug"]  # the kinds without a variant run the debug bench


def test_clean_trials_that_never_started_are_named_not_counted_and_a_runs_notes_are_shown(tmp_path):
    ran = [hang_trial(index=i, kind="clean", rank=-1, node="", job=str(10 + i)) for i in range(20)]
    for trial in ran:
        judge(trial, log(), {}, [r for r in records() if not r.get("step_restart")])
    unrun = hang_trial(index=20, kind="clean", rank=-1, node="", evidence=[], final_status="")
    data = results_data("python -m bench.chaos --hangs clean --trials 21", "2026-12-07", 9,
                        {"cpu": "cpu", "cores": 2}, "1.0/1.0/1.0 → 2.0/2.0/2.0", [*ran, unrun])  # fmt: skip
    data["notes"] = ["Seed 9's trial 20 was not run (the run was stopped)."]
    kept = tmp_path / "hangs-seed9.json"
    kept.write_text(json.dumps(data))
    section = render_hangs_section([str(kept)])
    assert (
        "0 false detections in ≥ 20 clean runs: **met**: 0 `hang detected:` line(s) in 20 clean runs; "
        "1 more never started (stopped runs, named below)." in section
    )
    assert "\nSeed 9's trial 20 was not run (the run was stopped).\n" in section
