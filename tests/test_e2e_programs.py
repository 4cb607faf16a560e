"""Foreign programs under `relaytrain launch --command` on the real local Slurm cluster (docs/programs.md).

All jobs are submitted at once, then polled:

* the plain DDP example on 2 nodes x 2 tasks and the Hugging Face Trainer example on one node get
  the pre-timeout signal (`--time 3 --signal USR2@60`, first run slowed down), save, are requeued by
  relaytrain.program and resume; each ends with exactly the uninterrupted run's loss;
* a program that ignores the signal, and one run with the --command default (no signal), end
  TIMEOUT and are not requeued;
* `scancel --signal=USR2` stops the DDP example with a checkpoint and no requeue;
* a `sweep --command` array whose tasks exit 75 on their first run: each task is requeued on its own
  and then runs its own command, with its grid value, in its own run directory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_slurm_jobs import FIRST_RUN_ONLY, cli, job_log, launch, submitted_id

from conftest import REPO, child_env
from slurm_fixtures import FINISHED_STATES, job_fields, slurm, wait_for, wait_job_finished

pytestmark = pytest.mark.slurm

PROFILE = ("--profile", str(REPO / "configs" / "clusters" / "local.toml"), "--gpus-per-node", "0")
# 3-minute jobs, the signal 60 s before the end: the requeued run has 2 minutes before its own signal to
# start (torch, transformers) and finish, on a machine whose 2 cores the rest of the suite loads (in 60 s
# the Hugging Face run did not always finish, and was stopped and requeued once more).
SIGNALLED = ("--time", "3", "--signal", "USR2@60")
# The jobs' config: runs under the test's directory, a 5 s time-budget margin and a save deadline
# shorter than the 30-60 s signal leads, and a first run slowed down by STEP_DELAY_S (40 steps: 160 s,
# past the signal at 120 s) so that the signal comes mid-training.
CONFIG = """[run]
dir = "{runs}"

[resilience]
time_budget_margin_s = 5
hard_deadline_s = 20

[slurm]
setup = ['{setup}']
"""
DDP = f"python {REPO / 'examples' / 'ddp_train.py'} --out $RELAYTRAIN_RUN_DIR/out"
HF = f"python {REPO / 'examples' / 'hf_trainer.py'} --out $RELAYTRAIN_RUN_DIR/out"
ARRAY_TASK = (
    'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then exit 75; fi; '
    'echo {value} "$SLURM_ARRAY_TASK_ID" > "$RELAYTRAIN_RUN_DIR/done"'
)
# It ignores the signal from its first instruction (the task's shell, then python inherits it): a loaded
# machine's slow start-up must not let the signal in before python's own handler is set.
IGNORES = (
    "trap '' USR2; "
    "python -c 'import signal, time; signal.signal(signal.SIGUSR2, signal.SIG_IGN); time.sleep(600)'"
)


def run_local(cmd: list[str], run_dir: Path) -> subprocess.Popen:
    env = child_env(RELAYTRAIN_RUN_DIR=str(run_dir))
    for key in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        env.pop(key)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "out" / "losses.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["step"]: r["loss"] for r in rows}


def state(run_dir: Path) -> dict:
    path = run_dir / "run_state.json"
    return json.loads(path.read_text()) if path.exists() else {}


@pytest.fixture(scope="module")
def programs(slurm_cluster, tmp_path_factory, monkeypatch_module):
    base = tmp_path_factory.mktemp("e2e_programs")
    runs = base / "runs"
    monkeypatch_module.chdir(base)
    jobs: dict[str, str] = {}

    config = base / "programs.toml"
    config.write_text(CONFIG.format(runs=runs, setup=FIRST_RUN_ONLY.format("export STEP_DELAY_S=4")))

    def go(name: str, *args: str) -> None:
        jobs[name] = launch(str(config), "--name", name, *PROFILE, *args)

    try:
        go("ddp", "--command", f"{DDP} --steps 40 --step-delay ${{STEP_DELAY_S:-0}}", "--nodes", "2",
           "--tasks-per-node", "2", *SIGNALLED)  # fmt: skip
        go("hf", "--command", f"{HF} --steps 40 --step-delay ${{STEP_DELAY_S:-0}}", "--nodes", "1",
           "--tasks-per-node", "1", *SIGNALLED)  # fmt: skip
        # 2 minutes, not 1: Slurm may send a --signal up to 60 s before its time (sbatch(1)): on a 1-minute
        # job USR2@30 came 2 s after the start, before the task's shell had set its trap, and ended it.
        go("ignores", "--command", IGNORES, "--nodes", "1", "--tasks-per-node", "1", "--time", "2",
           "--signal", "USR2@30")  # fmt: skip
        go("default", "--command", "sleep 600", "--nodes", "1", "--tasks-per-node", "1", "--time", "1")
        go("cancel", "--command", f"{DDP} --steps 300 --step-delay 1", "--nodes", "1",
           "--tasks-per-node", "1", "--time", "10", "--signal", "USR2@30")  # fmt: skip
        code, out = cli("sweep", str(config), "--command", ARRAY_TASK, "--name", "arr", "--grid", "value=a,b",
                        *PROFILE, "--nodes", "1", "--tasks-per-node", "1", "--time", "2")  # fmt: skip
        assert code == 0, out
        array = submitted_id(out)
        jobs["arr"] = array
        # The stop by `scancel --signal=USR2` before the local reference runs, which take minutes on a loaded
        # machine: a USR2 within signal_lead_s + 90 s of the job's end counts as Slurm's --signal (the
        # time limit, requeued), which a 5-minute job reached once while they ran.
        cancel_dir = runs / "cancel"
        wait_for(lambda: losses(cancel_dir), 240, "the cancel job's first step", interval=1.0)
        slurm("scancel", "--signal=USR2", jobs["cancel"])
        refs = base / "refs"
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"]
        ddp_ref = run_local([*torchrun, str(REPO / "examples" / "ddp_train.py"), "--out",
                             str(refs / "ddp" / "out"), "--steps", "40"], refs / "ddp")  # fmt: skip
        assert ddp_ref.wait(timeout=300) == 0, ddp_ref.communicate()[0]
        hf_ref = run_local([sys.executable, str(REPO / "examples" / "hf_trainer.py"), "--out",
                            str(refs / "hf" / "out"), "--steps", "40"], refs / "hf")  # fmt: skip
        assert hf_ref.wait(timeout=300) == 0, hf_ref.communicate()[0]
        fields = {
            name: wait_job_finished(int(job), timeout=400) for name, job in jobs.items() if name != "arr"
        }
        tasks = [
            wait_for(lambda i=i: finished(f"{array}_{i}"), 300, f"array task {array}_{i}") for i in (0, 1)
        ]
        yield {"runs": runs, "refs": refs, "jobs": jobs, "fields": fields, "tasks": tasks}
    finally:
        subprocess.run(["scancel", *jobs.values()], capture_output=True, timeout=30)


def finished(job_id: str) -> dict[str, str] | None:
    fields = job_fields(job_id)
    return fields if fields.get("JobState") in FINISHED_STATES else None


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_ddp_on_two_nodes_is_requeued_after_the_signal_and_ends_with_the_reference_loss(programs):
    run, job = programs["runs"] / "ddp", programs["jobs"]["ddp"]
    fields = programs["fields"]["ddp"]
    log = job_log(run, job)
    assert fields["JobState"] == "COMPLETED" and int(fields["Restarts"]) >= 1, log
    assert "stopping at step" in log and "resuming at step" in log, log
    reference = losses(programs["refs"] / "ddp")
    assert losses(run) == reference, log  # every step once, each with the uninterrupted run's loss
    assert state(run)["status"] == "finished"


def test_hf_trainer_is_requeued_and_resumes_from_its_checkpoint(programs):
    run, job = programs["runs"] / "hf", programs["jobs"]["hf"]
    fields = programs["fields"]["hf"]
    log = job_log(run, job)
    assert fields["JobState"] == "COMPLETED" and int(fields["Restarts"]) >= 1, log
    assert "resuming from" in log and "checkpoint-" in log, log
    final = json.loads((run / "out" / "final.json").read_text())
    assert final == json.loads((programs["refs"] / "hf" / "out" / "final.json").read_text()), log


@pytest.mark.parametrize("name", ["ignores", "default"])
def test_a_program_that_does_not_stop_ends_timeout_without_requeue(programs, name):
    fields = programs["fields"][name]
    log = job_log(programs["runs"] / name, programs["jobs"][name])
    assert fields["JobState"] == "TIMEOUT" and fields["Restarts"] == "0", log
    assert not state(programs["runs"] / name)  # nothing claimed a stop
    script = (programs["runs"] / name / "slurm" / "job.sh").read_text()
    assert ("#SBATCH --signal=B:USR2@30" in script) == (name == "ignores")


def test_scancel_signal_stops_with_a_checkpoint_and_no_requeue(programs):
    run = programs["runs"] / "cancel"
    fields = programs["fields"]["cancel"]
    log = job_log(run, programs["jobs"]["cancel"])
    assert fields["Restarts"] == "0", log
    record = state(run)
    assert record["reason"] == "cancelled" and record["saved"] and not record["requeue_requested"], log
    assert (run / "out" / "checkpoint.pt").exists()
    assert record["step"] == max(losses(run))


def test_a_command_sweep_requeues_each_array_task_that_exits_75(programs):
    array = programs["jobs"]["arr"]
    for index, value in enumerate("ab"):
        run, fields = programs["runs"] / f"arr-{index}", programs["tasks"][index]
        log = (programs["runs"] / "arr-sweep" / "slurm" / f"{array}_{index}.out").read_text(errors="replace")
        assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", log
        assert (run / "done").read_text().split() == [value, str(index)], log
        record = state(run)
        assert record["reason"] == "program_exit" and record["requeue_requested"], log
