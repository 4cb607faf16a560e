"""DeepSpeed ZeRO-3 and Megatron-core under `relaytrain launch --command` on the real local Slurm cluster
(docs/programs.md): each example on 2 nodes x 1 task (srun starts the ranks), stopped by the launch's
pre-timeout signal mid-run, requeued by exit 75, resumed, and ending with exactly the losses of an
uninterrupted torchrun run. With `--time 3 --signal USR2@60` the signal comes 90-120 s after each
run's start: the first run is slowed down to outlast it (5 s a step), the requeued one, at full speed,
must finish before it, DeepSpeed's start-up of about 25 s on a busy machine included.

Both jobs are submitted at once, then polled. DeepSpeed trains with torch's AdamW here
(examples/deepspeed/zero3_offload_torch_adamw.json: the same ZeRO-3 CPU offload, no C++ optimizer op);
tests/test_program_stacks.py runs the DeepSpeedCPUAdam config.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from e2e_slurm_jobs import FIRST_RUN_ONLY, job_log, job_output, launch
from test_e2e_programs import CONFIG, PROFILE, losses, run_local, state

from conftest import REPO
from slurm_fixtures import wait_job_finished

pytestmark = pytest.mark.slurm

SIGNALLED = ("--nodes", "2", "--tasks-per-node", "1", "--time", "3", "--signal", "USR2@60")
STEPS = ("--steps", "30")
TORCH_ADAMW = REPO / "examples" / "deepspeed" / "zero3_offload_torch_adamw.json"
EXAMPLES = {
    "deepspeed": (REPO / "examples" / "deepspeed_zero3.py", ("--ds-config", str(TORCH_ADAMW))),
    "megatron": (REPO / "examples" / "megatron_gpt.py", ()),
}


@pytest.fixture(scope="module")
def stacks(slurm_cluster, tmp_path_factory):
    pytest.importorskip("deepspeed")
    pytest.importorskip("megatron.core")
    base = tmp_path_factory.mktemp("e2e_stacks")
    runs, refs = base / "runs", base / "refs"
    config = base / "stacks.toml"
    config.write_text(CONFIG.format(runs=runs, setup=FIRST_RUN_ONLY.format("export STEP_DELAY_S=5")))
    jobs: dict[str, str] = {}
    try:
        for name, (example, args) in EXAMPLES.items():
            command = " ".join([f"python {example} --out $RELAYTRAIN_RUN_DIR/out", *args, *STEPS])
            jobs[name] = launch(str(config), "--name", name, *PROFILE, "--command",
                                f"{command} --step-delay ${{STEP_DELAY_S:-0}}", *SIGNALLED)  # fmt: skip
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        for name, (example, args) in EXAMPLES.items():  # one at a time: 2 cores
            ref = run_local([*torchrun, str(example), "--out", str(refs / name / "out"), *args, *STEPS],
                            refs / name)  # fmt: skip
            assert ref.wait(timeout=300) == 0, ref.communicate()[0][-4000:]
        fields = {name: wait_job_finished(int(job), timeout=420) for name, job in jobs.items()}
        yield {"runs": runs, "refs": refs, "jobs": jobs, "fields": fields}
    finally:
        subprocess.run(["scancel", *jobs.values()], capture_output=True, timeout=30)


@pytest.mark.parametrize("name", EXAMPLES)
def test_stack_is_stopped_by_the_signal_requeued_and_ends_with_the_uninterrupted_losses(stacks, name):
    run, job, fields = stacks["runs"] / name, stacks["jobs"][name], stacks["fields"][name]
    log = job_log(run, job)
    assert fields["JobState"] == "COMPLETED" and int(fields["Restarts"]) >= 1, log
    output = job_output(run, job)  # whole: DeepSpeed's warnings push these lines out of the log's tail
    assert "time_limit_signal" in output and "resuming at step" in output, log
    assert losses(run) == losses(stacks["refs"] / name), log  # every step once, the reference's loss
    assert state(run)["status"] == "finished"
