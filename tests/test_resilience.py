"""Unit tests of relaytrain.resilience: requeue policy, marker, time budget, signals, watchdogs, NaN guard."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from relaytrain.config.loader import load_config
from relaytrain.errors import ConfigError
from relaytrain.job import JobFacts, RunDir
from relaytrain.resilience import (
    EXIT_DEADLINE,
    EXIT_DOUBLE_INTERRUPT,
    EXIT_HANG,
    EXIT_NONFINITE,
    EXIT_RESUME,
    NanGuard,
    RunStateFile,
    ShutdownController,
    StopReason,
    decide_requeue,
    exit_code_for,
    finished_message,
    handle_stop,
    mark_finished,
    mark_running,
)
from relaytrain.resilience.rank.early_signals import capture_early_signals
from relaytrain.resilience.run_state import RunState

REPO = Path(__file__).resolve().parents[1]
CASES = Path(__file__).with_name("resilience_cases.py")
S = StopReason

FAKE_SCONTROL = """#!/bin/sh
echo "$@" >> "$FAKE_SCONTROL_LOG"
case "$1 $2" in
  "show job") echo "JobId=$4 JobState=${FAKE_JOB_STATE:-RUNNING} EndTime=${FAKE_END:-Unknown}" \
    "PreemptTime=${FAKE_PREEMPT:-None} Restarts=0";;
  "requeue "*) exit ${FAKE_REQUEUE_RC:-0};;
esac
"""


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """A fake `scontrol` on PATH that records its arguments, and a clean SLURM environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(FAKE_SCONTROL)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    log_file = tmp_path / "scontrol.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SCONTROL_LOG", str(log_file))
    for name in (
        "SLURM_JOB_ID",
        "SLURM_ARRAY_JOB_ID",
        "SLURM_ARRAY_TASK_ID",
        "SLURM_RESTART_COUNT",
        "SLURM_JOB_END_TIME",
        "RELAYTRAIN_FAKE_JOB_END_TIME",
        "RELAYTRAIN_SLURM_SIGNAL",
    ):
        monkeypatch.delenv(name, raising=False)

    def calls() -> list[str]:
        return log_file.read_text().splitlines() if log_file.exists() else []

    return calls


def cfg_for(tmp_path, *overrides: str):
    return load_config(None, [f"--run.dir={tmp_path}", "--run.name=run", *overrides])


# -- the requeue decision (pure) ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reason", "enabled", "restarts", "in_slurm", "expected"),
    [
        (S.TIME_BUDGET, True, 0, True, True),
        (S.TIME_LIMIT_SIGNAL, True, 4, True, True),
        (S.TIME_LIMIT_SIGNAL, True, 5, True, False),  # cap: max_requeues=5
        (S.TIME_BUDGET, True, 5, True, False),
        (S.PREEMPTION, True, 99, True, True),  # preemptions are not capped
        (S.PREEMPTION, False, 0, True, False),  # resilience.requeue = false
        (S.TIME_BUDGET, True, 0, False, False),  # outside SLURM
        (S.NAN, True, 0, True, False),
        (S.ERROR, True, 0, True, False),
        (S.HANG, True, 0, True, False),
        (S.USER_INTERRUPT, True, 0, True, False),
        (S.CANCELLED, True, 0, True, False),
        (S.STOP_AT_STEP, True, 0, True, False),
        (S.SIGNAL, True, 0, True, False),
        (S.NONE, True, 0, True, False),  # finished: never requeued
    ],
)
def test_decide_requeue(reason, enabled, restarts, in_slurm, expected):
    assert decide_requeue(reason, enabled, 5, restarts, in_slurm) is expected


# -- handle_stop: marker + scontrol ---------------------------------------------------------------


def test_time_budget_stop_requeues_array_task(tmp_path, fake_slurm, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "107")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "100")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    cfg = cfg_for(tmp_path)
    assert handle_stop(cfg.resilience, RunDir(tmp_path), S.TIME_BUDGET, 40, rank=0) == EXIT_RESUME
    assert fake_slurm() == ["requeue 100_7"]
    state = RunStateFile(RunDir(tmp_path)).read().as_json()
    assert state["status"] == "stopped" and state["reason"] == "time_budget" and state["step"] == 40
    assert state["requeue_requested"] and state["requeued"] and not state["requeue_pending"]
    assert (state["job_id"], state["restart_count"], state["saved"]) == ("107", 2, True)


def test_other_ranks_only_get_the_exit_code(tmp_path, fake_slurm, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    assert (
        handle_stop(cfg_for(tmp_path).resilience, RunDir(tmp_path), S.TIME_LIMIT_SIGNAL, 9, rank=1)
        == EXIT_RESUME
    )
    assert fake_slurm() == [] and RunStateFile(RunDir(tmp_path)).read() is None


def test_preemption_requeues_but_scancel_does_not(tmp_path, fake_slurm, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "8")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "50")  # over max_requeues: preemption is not capped
    cfg = cfg_for(tmp_path)
    assert handle_stop(cfg.resilience, RunDir(tmp_path), S.PREEMPTION, 3, rank=0) == EXIT_RESUME
    assert fake_slurm() == ["show job -o 8", "requeue 8"]
    monkeypatch.setenv("FAKE_JOB_STATE", "CANCELLED")
    assert handle_stop(cfg.resilience, RunDir(tmp_path), S.PREEMPTION, 4, rank=0) == EXIT_RESUME
    assert fake_slurm()[2:] == ["show job -o 8"]
    state = RunStateFile(RunDir(tmp_path)).read().as_json()
    assert state["reason"] == "cancelled" and not state["requeue_requested"]


def test_time_limit_cap_and_errors_do_not_requeue(tmp_path, fake_slurm, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "20")
    cfg = cfg_for(tmp_path)  # max_requeues defaults to 20
    assert handle_stop(cfg.resilience, RunDir(tmp_path), S.TIME_LIMIT_SIGNAL, 5, rank=0) == EXIT_RESUME
    assert fake_slurm() == ["show job -o 9"]  # only the scancel check, no requeue
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert handle_stop(cfg.resilience, RunDir(tmp_path), S.NAN, 6, rank=0) == EXIT_NONFINITE
    assert RunStateFile(RunDir(tmp_path)).read().status == "failed"
    assert handle_stop(cfg.resilience, RunDir(tmp_path), S.STOP_AT_STEP, 7, rank=0) == 0
    off = cfg_for(tmp_path, "--resilience.requeue=false").resilience
    assert handle_stop(off, RunDir(tmp_path), S.TIME_BUDGET, 8, rank=0) == EXIT_RESUME
    assert fake_slurm() == ["show job -o 9"]


def test_no_requeue_outside_slurm(tmp_path, fake_slurm):
    assert handle_stop(cfg_for(tmp_path).resilience, RunDir(tmp_path), S.SIGNAL, 3, rank=0) == EXIT_RESUME
    assert fake_slurm() == [] and RunStateFile(RunDir(tmp_path)).read().status == "stopped"


def test_missing_or_failing_scontrol_leaves_requeue_pending(tmp_path, fake_slurm, monkeypatch, caplog):
    monkeypatch.setenv("SLURM_JOB_ID", "11")
    monkeypatch.setenv("FAKE_REQUEUE_RC", "1")
    cfg = cfg_for(tmp_path)
    handle_stop(cfg.resilience, RunDir(tmp_path), S.TIME_BUDGET, 12, rank=0)
    assert fake_slurm() == ["requeue 11"]
    state = RunStateFile(RunDir(tmp_path)).read().as_json()
    assert state["requeue_pending"] and not state["requeued"]
    monkeypatch.setenv("PATH", "/nonexistent")  # inside a container: no scontrol at all
    with caplog.at_level("WARNING"):
        handle_stop(cfg.resilience, RunDir(tmp_path), S.TIME_BUDGET, 13, rank=0)
    assert "scontrol is not on PATH" in caplog.text
    assert RunStateFile(RunDir(tmp_path)).read().requeue_pending


def test_run_state_markers(tmp_path, fake_slurm, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "3")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    cfg = cfg_for(tmp_path, "--train.max_steps=40")
    mark_running(cfg.train.max_steps, RunDir(tmp_path), rank=1, step=0)
    assert RunStateFile(RunDir(tmp_path)).read() is None
    mark_running(cfg.train.max_steps, RunDir(tmp_path), rank=0, step=10)
    assert RunStateFile(RunDir(tmp_path)).read().status == "running"
    assert finished_message(cfg.train.max_steps, RunDir(tmp_path)) is None
    mark_finished(RunDir(tmp_path), rank=0, step=40)
    text = (tmp_path / "run_state.json").read_text()
    assert '"status": "finished"' in text and '"requeue_pending": false' in text  # one key per line
    assert "already finished at step 40" in finished_message(cfg.train.max_steps, RunDir(tmp_path))
    assert finished_message(80, RunDir(tmp_path)) is None
    with pytest.raises(ValueError):
        RunStateFile(RunDir(tmp_path)).write(RunState.of("done", "", 1))


# -- the job's end time and the time budget -------------------------------------------------------


def job_end_time(environ):
    return JobFacts.from_env(environ).end_time()


def test_job_end_time_sources(fake_slurm, monkeypatch):
    assert job_end_time({"RELAYTRAIN_FAKE_JOB_END_TIME": "1000", "SLURM_JOB_END_TIME": "5"}) == (
        1000.0,
        "RELAYTRAIN_FAKE_JOB_END_TIME",
    )
    assert job_end_time({"RELAYTRAIN_FAKE_JOB_END_TIME": "soon", "SLURM_JOB_END_TIME": "5"})[0] == 5.0
    assert job_end_time({})[0] is None
    monkeypatch.setenv("FAKE_END", "2030-01-02T03:04:05")
    end, source = job_end_time({"SLURM_JOB_ID": "77"})
    assert source == "scontrol show job"
    assert time.localtime(end)[:6] == (2030, 1, 2, 3, 4, 5)
    assert fake_slurm() == ["show job -o 77"]
    monkeypatch.setenv("FAKE_END", "Unknown")
    assert job_end_time({"SLURM_JOB_ID": "77"})[0] is None


def controller(tmp_path, monkeypatch, end_in_s: float | None, *overrides: str, slurm: bool = False):
    if end_in_s is None:
        monkeypatch.delenv("RELAYTRAIN_FAKE_JOB_END_TIME", raising=False)
    else:
        monkeypatch.setenv("RELAYTRAIN_FAKE_JOB_END_TIME", str(time.time() + end_in_s))
    if slurm:
        monkeypatch.setenv("SLURM_JOB_ID", "1234")
    cfg = cfg_for(tmp_path, *overrides)
    return ShutdownController(
        cfg.resilience, rank=0, device=torch.device("cpu"), run=RunDir(tmp_path / "run")
    )


def test_time_budget_stops_before_the_signal(tmp_path, fake_slurm, monkeypatch):
    c = controller(tmp_path, monkeypatch, 3600)
    assert c.agree(1, save_estimate_s=60) == S.NONE
    assert c.agree(2, save_estimate_s=3400) == S.TIME_BUDGET  # 3600 s left < 3400 + 300 margin
    assert (c.stop_reason, c.stop_step, c.deadline.triggered_at is not None) == (S.TIME_BUDGET, 2, True)
    c.uninstall()
    c = controller(tmp_path, monkeypatch, 200)  # inside the 300 s margin already
    assert c.agree(1) == S.TIME_BUDGET
    c.uninstall()
    c = controller(tmp_path, monkeypatch, None)  # unknown end time: no budget
    assert c.agree(1, save_estimate_s=1e9) == S.NONE


def _signal_self_and_agree(c: ShutdownController, signum: int) -> StopReason:
    c.install()
    try:
        os.kill(os.getpid(), signum)
        return c.agree(1)
    finally:
        c.uninstall()


@pytest.mark.parametrize(
    ("signum", "slurm", "end_in_s", "expected"),
    [
        (signal.SIGUSR2, False, None, S.SIGNAL),  # resilience.slurm_signal sent by hand outside Slurm
        (signal.SIGUSR2, False, 200, S.SIGNAL),  # ... even with a (rehearsed) end time close
        (signal.SIGUSR2, True, 200, S.TIME_LIMIT_SIGNAL),  # Slurm's --signal, within lead + slack
        (signal.SIGUSR2, True, 86400, S.CANCELLED),  # scancel --signal=USR2 long before the limit
        (signal.SIGTERM, False, None, S.SIGNAL),  # kill / torchrun outside SLURM
        (signal.SIGTERM, True, 86400, S.PREEMPTION),  # lots of time left: preemption
        (signal.SIGTERM, True, 200, S.TIME_LIMIT_SIGNAL),  # near the end: the time limit
        (signal.SIGINT, True, 86400, S.USER_INTERRUPT),
    ],
)
def test_signal_classification(tmp_path, fake_slurm, monkeypatch, signum, slurm, end_in_s, expected):
    overrides = ("--resilience.time_budget_margin_s=0",)
    c = controller(tmp_path, monkeypatch, end_in_s, *overrides, slurm=slurm)
    assert _signal_self_and_agree(c, signum) == expected


def slurm_time(unix_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(unix_s))


@pytest.mark.parametrize("preempting", [False, True])
def test_a_job_that_slurm_began_to_preempt_stops_for_the_preemption(
    tmp_path, fake_slurm, monkeypatch, preempting
):
    """Preempting a job, Slurm shortens its EndTime to PreemptTime + GraceTime: a run that read its end
    time then (it started during the grace time) must not take the SIGTERM for the time limit."""
    now = time.time()
    monkeypatch.setenv("FAKE_END", slurm_time(now + 20))
    if preempting:
        monkeypatch.setenv("FAKE_PREEMPT", slurm_time(now - 1))
    c = controller(tmp_path, monkeypatch, None, "--resilience.time_budget_margin_s=0", slurm=True)
    assert (c.preempted_at is not None) == preempting
    assert fake_slurm() == ["show job -o 1234"] * 2  # EndTime, then PreemptTime
    expected = S.PREEMPTION if preempting else S.TIME_LIMIT_SIGNAL
    assert _signal_self_and_agree(c, signal.SIGTERM) == expected
    # no signal yet, the grace time's end inside the time budget: a preemption too
    c = controller(tmp_path, monkeypatch, None, "--resilience.time_budget_margin_s=60", slurm=True)
    assert c.agree(1) == (S.PREEMPTION if preempting else S.TIME_BUDGET)
    c.uninstall()


@pytest.mark.parametrize(
    ("script_signal", "expected"),
    [
        ("USR2", S.TIME_LIMIT_SIGNAL),  # the batch script asked Slurm for --signal=B:USR2@...
        ("none", S.CANCELLED),  # --signal none: a SIGUSR2 near the end is still someone's scancel --signal
        ("TERM", S.CANCELLED),
    ],
)
def test_a_slurm_signal_the_job_did_not_ask_for_is_not_the_time_limit(
    tmp_path, fake_slurm, monkeypatch, script_signal, expected
):
    monkeypatch.setenv("RELAYTRAIN_SLURM_SIGNAL", script_signal)
    c = controller(tmp_path, monkeypatch, 200, "--resilience.time_budget_margin_s=0", slurm=True)
    assert _signal_self_and_agree(c, signal.SIGUSR2) == expected


def test_ctrl_c_stop_exits_130_not_the_requeue_code(tmp_path):
    # 75 asks a batch script to requeue; a Ctrl-C on a laptop is the user's stop (saved, not requeued).
    assert exit_code_for(S.USER_INTERRUPT) == 130
    assert handle_stop(cfg_for(tmp_path).resilience, RunDir(tmp_path), S.USER_INTERRUPT, 3, rank=0) == 130
    state = json.loads((tmp_path / "run_state.json").read_text())
    assert (state["reason"], state["exit_code"], state["requeue_requested"]) == ("user_interrupt", 130, False)
    assert exit_code_for(S.SIGNAL) == EXIT_RESUME


def test_handlers_are_restored(tmp_path, fake_slurm, monkeypatch):
    before = signal.getsignal(signal.SIGUSR2)
    c = controller(tmp_path, monkeypatch, None)
    c.install()
    assert signal.getsignal(signal.SIGUSR2) != before
    c.uninstall(exiting=True)  # no stop requested: restores
    assert signal.getsignal(signal.SIGUSR2) == before
    c.install()
    os.kill(os.getpid(), signal.SIGUSR2)
    c.uninstall(exiting=True)  # after a stop a late SIGTERM from torchrun must not kill the exiting rank
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN and c.deadline.triggered_at is not None
    c.uninstall()
    assert signal.getsignal(signal.SIGUSR2) == before


def test_after_a_recorded_stop_without_a_signal_an_exiting_rank_ignores_late_stop_signals(
    tmp_path, fake_slurm, monkeypatch
):
    # exit_for_requeue() with no stop agreed (the program's own exit 75): torchrun SIGTERMs the ranks
    # still tearing down when the first exits; their 75 must not turn into -15.
    before = signal.getsignal(signal.SIGTERM)
    c = controller(tmp_path, monkeypatch, None)
    c.install()
    try:
        assert c.finish(S.PROGRAM_EXIT, 3) == EXIT_RESUME
        c.uninstall(exiting=True)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        c.uninstall()
        signal.signal(signal.SIGTERM, before)


def test_a_finished_run_ignores_a_late_time_limit_signal_while_it_exits(tmp_path, fake_slurm, monkeypatch):
    # Seen on the local cluster: the time-limit SIGUSR2 reached the ranks of a run that had just
    # finished; with the default action restored they died of it (exit 140) and the job FAILED.
    before = signal.getsignal(signal.SIGUSR2)
    c = controller(tmp_path, monkeypatch, None)
    c.install()
    try:
        c.uninstall(exiting=True, finished=True)
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    finally:
        c.uninstall()
        signal.signal(signal.SIGUSR2, before)


def test_a_start_up_signal_not_listed_gets_its_default_action_back(tmp_path, fake_slurm, monkeypatch):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR2)}
    c = controller(tmp_path, monkeypatch, None, '--resilience.signals=["SIGUSR2", "SIGINT"]')
    try:
        capture_early_signals()  # what the CLI does first thing
        c.install()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # kill -TERM ends the run
        assert signal.getsignal(signal.SIGUSR2) == c._handle
    finally:
        c.uninstall()
        for signum, handler in before.items():
            signal.signal(signum, handler)
    proc = run_case("unlisted", tmp_path / "run")  # ... and one received during start-up is delivered
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr
    assert "ready" not in proc.stdout


def test_concurrent_marker_writes_do_not_collide(tmp_path):
    errors: list[BaseException] = []

    def write(status: str) -> None:
        try:
            for step in range(200):
                RunStateFile(RunDir(tmp_path)).write(RunState.of(status, "", step))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(s,)) for s in ("stopped", "failed")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert RunStateFile(RunDir(tmp_path)).read().step == 199


def test_config_checks(tmp_path):
    with pytest.raises(ConfigError, match="hard_deadline_s"):
        cfg_for(tmp_path, "--resilience.hard_deadline_s=200", "--resilience.signal_lead_s=180")
    with pytest.raises(ConfigError, match="slurm_signal"):
        cfg_for(tmp_path, "--resilience.slurm_signal=SIGUSR1")


# -- subprocess scenarios that end in os._exit ----------------------------------------------------


def run_case(case: str, run_dir: Path, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("SLURM_JOB_ID", None)
    return subprocess.run(
        [sys.executable, str(CASES), case, str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        **kwargs,
    )


def test_hang_watchdog_dumps_stacks_and_exits(tmp_path):
    proc = run_case("hang", tmp_path)
    assert proc.returncode == EXIT_HANG, proc.stderr
    dump = (tmp_path / "logs" / "hang_rank0.txt").read_text()
    assert "rank 0 step 3" in dump and "stuck_in_collective" in dump
    assert "stuck_in_collective" in proc.stderr


def test_hang_watchdog_backstop_when_the_gil_is_held(tmp_path):
    proc = run_case("gil_hang", tmp_path)
    assert proc.returncode == 1, proc.stderr  # faulthandler's exit
    dump = (tmp_path / "logs" / "hang_rank0.txt").read_text()
    assert "Timeout" in dump and "resilience_cases.py" in dump


def test_hang_watchdog_quiet_while_steps_finish(tmp_path):
    proc = run_case("beating", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "logs" / "hang_rank0.txt").exists()  # no empty dump file left behind


def test_hard_deadline_exits_when_the_save_hangs(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_case("deadline", run_dir)
    assert proc.returncode == EXIT_DEADLINE, proc.stderr
    assert "agreed: signal" in proc.stdout
    assert "stuck_in_collective" in (run_dir / "logs" / "deadline_rank0.txt").read_text()
    state = json.loads((run_dir / "run_state.json").read_text())
    assert (state["status"], state["reason"], state["step"], state["saved"]) == (
        "stopped",
        "signal",
        7,
        False,
    )


def test_hard_deadline_starts_while_the_main_thread_is_blocked_in_cpp(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_case("blocked", run_dir)  # without the wakeup pipe: the 60 s store timeout, then 3
    assert proc.returncode == EXIT_DEADLINE, proc.stderr
    state = json.loads((run_dir / "run_state.json").read_text())
    assert (state["status"], state["step"], state["saved"]) == ("stopped", 5, False)


def test_a_completed_stop_disarms_the_hard_deadline(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_case("finished", run_dir)
    assert proc.returncode == 0, proc.stderr
    assert f"exit code: {EXIT_RESUME}" in proc.stdout
    state = json.loads((run_dir / "run_state.json").read_text())
    assert (state["status"], state["step"], state["saved"]) == ("stopped", 7, True)
    assert not (run_dir / "logs" / "deadline_rank0.txt").exists()


def test_a_failed_checkpoint_load_marks_the_run_failed(tmp_path):
    proc = run_case("load_fails", tmp_path / "run")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "error: checkpoint step_4 is unreadable" in proc.stdout
    assert "state: failed" in proc.stdout


def test_a_stop_during_evaluation_keeps_that_evaluation(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_case("eval_stop", run_dir)
    assert proc.returncode == EXIT_RESUME, proc.stdout + proc.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2] and evals[0]["val_loss"] is not None
    assert "state: stopped" in proc.stdout
    assert json.loads((run_dir / "run_state.json").read_text())["step"] == 2


def test_second_ctrl_c_exits_at_once(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(CASES), "sigint", str(tmp_path / "run")],
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGINT)  # the same Ctrl-C delivered twice (terminal + torchrun): ignored
        assert proc.stdout.readline().strip() == "first interrupt seen"
        time.sleep(1.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == EXIT_DOUBLE_INTERRUPT
    finally:
        proc.kill()
        proc.wait()


# -- NaN guard ------------------------------------------------------------------------------------

NAN, OK = torch.tensor(float("nan")), torch.tensor(1.0)


def test_nan_policy_stop(tmp_path):
    guard = NanGuard(cfg_for(tmp_path, "--resilience.nan_policy=stop").resilience, torch.device("cpu"))
    assert guard.check(OK, OK) == "ok"
    assert guard.check(OK, torch.tensor(float("inf"))) == "stop"  # a bad grad norm counts too


def test_nan_policy_skip_escalates_to_stop(tmp_path):
    guard = NanGuard(
        cfg_for(tmp_path, "--resilience.nan_policy=skip", "--resilience.nan_max_consecutive=2").resilience,
        torch.device("cpu"),
    )
    assert [guard.check(x, 1.0) for x in (NAN, OK, NAN, NAN)] == ["skip", "ok", "skip", "stop"]
    assert guard.bad_total == 3


def test_nan_policy_rollback(tmp_path):
    cfg = cfg_for(tmp_path, "--resilience.nan_policy=rollback", "--resilience.nan_max_consecutive=2")
    guard = NanGuard(cfg.resilience, torch.device("cpu"))
    verdicts = [guard.check(NAN, None) for _ in range(8)]
    assert verdicts == ["skip", "rollback"] * 3 + ["skip", "stop"]  # at most MAX_ROLLBACKS = 3 rollbacks
