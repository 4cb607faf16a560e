"""DeepSpeed ZeRO-3 and Megatron-core under `relaytrain launch --command` on the real local Slurm cluster,
launched by the two lines of docs/programs.md "Launching them" (DeepSpeed: srun starts the ranks;
Megatron: relaytrain.job.torchrun, one per node), 2 nodes x 1 task each: stopped by the launch's
pre-timeout signal mid-run, requeued by exit 75, resumed, ending with exactly the losses of an
uninterrupted torchrun run.

The documented lines are parsed by bash as written; the test then adds what a 2-core test needs: its
config (run directory, a slowed first run), the local cluster's profile (CPU nodes: `--gpus-per-node 0`,
one process per node: `--tasks-per-node 1`, Megatron's `--nproc_per_node=1`), `--time 3 --signal USR2@60`
(the signal comes 90-120 s after each run's start: the first run, at 5 s a step, outlasts it; the
requeued one, at full speed and DeepSpeed's start-up of about 25 s included, finishes before it), and
to each command `--steps 30`, the step delay and, for DeepSpeed, the torch-AdamW config (the same
ZeRO-3 CPU offload without the C++ optimizer op; tests/test_program_stacks.py runs DeepSpeedCPUAdam).
Both jobs are submitted at once, then polled.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from e2e_slurm_jobs import FIRST_RUN_ONLY, job_log, job_output, launch
from test_e2e_programs import CONFIG, PROFILE, losses, run_local, state
from test_readme import bash_blocks

import needs
from conftest import REPO
from slurm_fixtures import wait_job_finished

pytestmark = pytest.mark.slurm

# The documented lines are for 8-GPU nodes; a CPU node of the local cluster runs one process.
TEST_LAUNCH = ("--time", "3", "--signal", "USR2@60", "--tasks-per-node", "1")
ONE_PROCESS = ("--nproc_per_node=8", "--nproc_per_node=1")
STEPS = ("--steps", "30")
TORCH_ADAMW = REPO / "examples" / "deepspeed" / "zero3_offload_torch_adamw.json"
# name in the documented line: (example, what the test adds to its command)
EXAMPLES = {
    "zero3": (REPO / "examples" / "deepspeed_zero3.py", ("--ds-config", str(TORCH_ADAMW), *STEPS)),
    "gpt": (REPO / "examples" / "megatron_gpt.py", STEPS),
}
# `relaytrain` replaced by a function that prints its arguments as bash passed them
ARGV = "relaytrain() { python -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\"; }\n"


def documented_launches() -> dict[str, list[str]]:
    """The arguments of each `relaytrain launch` line of the docs, by --name."""
    (lines,) = [
        lines for heading, lines in bash_blocks(REPO / "docs" / "programs.md") if heading == "Launching them"
    ]
    done = subprocess.run(["bash", "-c", ARGV + "\n".join(lines)], capture_output=True, text=True, check=True)
    launches = [json.loads(line) for line in done.stdout.splitlines()]
    return {argv[argv.index("--name") + 1]: argv for argv in launches}


def own_lines(output: str) -> str:
    """The lines of every run of the job that relaytrain, the example or torchrun's agent wrote (a failed
    first run is out of the log's tail)."""
    marks = ("[relaytrain", "relaytrain.job", "stop", "resuming", "hard deadline", "slurmstepd", "srun:")
    agent = ("signal", "forcefully")
    return "\n".join(
        line for line in output.splitlines()
        if line.startswith(marks) or ("elastic" in line and any(word in line for word in agent))
    )  # fmt: skip


@pytest.fixture(scope="module")
def stacks(slurm_cluster, deepspeed_ops, tmp_path_factory):
    needs.module("megatron.core")
    base = tmp_path_factory.mktemp("e2e_stacks")
    (base / "examples").symlink_to(REPO / "examples")  # the documented lines' relative paths
    runs, refs = base / "runs", base / "refs"
    config = base / "stacks.toml"
    config.write_text(CONFIG.format(runs=runs, setup=FIRST_RUN_ONLY.format("export STEP_DELAY_S=5")))
    launches = documented_launches()
    assert set(launches) == set(EXAMPLES)
    jobs: dict[str, str] = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(base)
        try:
            for name, argv in launches.items():
                assert argv[0] == "launch", argv
                args = list(argv[1:])
                at = args.index("--command") + 1
                command = args[at].replace(*ONE_PROCESS)
                args[at] = " ".join([command, *EXAMPLES[name][1], "--step-delay ${STEP_DELAY_S:-0}"])
                jobs[name] = launch(*args, str(config), *PROFILE, *TEST_LAUNCH)
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
            for name, (example, args) in EXAMPLES.items():  # one at a time: 2 cores
                ref = run_local([*torchrun, str(example), "--out", str(refs / name / "out"), *args],
                                refs / name)  # fmt: skip
                assert ref.wait(timeout=300) == 0, ref.communicate()[0][-4000:]
            fields = {name: wait_job_finished(int(job), timeout=420) for name, job in jobs.items()}
            yield {"runs": runs, "refs": refs, "jobs": jobs, "fields": fields}
        finally:
            subprocess.run(["scancel", *jobs.values()], capture_output=True, timeout=30)


@pytest.mark.parametrize("name", EXAMPLES)
def test_documented_launch_is_stopped_by_the_signal_requeued_and_ends_with_the_uninterrupted_losses(
    stacks, name
):
    run, job, fields = stacks["runs"] / name, stacks["jobs"][name], stacks["fields"][name]
    output = job_output(run, job)  # whole: DeepSpeed's warnings push these lines out of the log's tail
    log = job_log(run, job) + "\nevery run's own lines:\n" + own_lines(output)
    assert fields["JobState"] == "COMPLETED" and int(fields["Restarts"]) >= 1, log
    assert "time_limit_signal" in output and "resuming at step" in output, log
    # the resumed run prints the stop's record: rank 0's `scontrol requeue` outlived the SIGTERM it brought
    assert "'requeue_pending': False, 'requeued': True" in output, log
    # A stop, not a failure: no launcher's traceback. relaytrain.job.torchrun's own stop line is not asked
    # for: rank 0's requeue ends the job, and Slurm ends the agents while they wait for their workers to exit,
    # before (seen) or after they print it.
    assert "Traceback" not in output, log
    stops = [line for line in output.splitlines() if line.startswith("relaytrain.job.torchrun:")]
    assert all(" stopped " in line for line in stops) and (name == "gpt" or not stops), stops
    assert losses(run) == losses(stacks["refs"] / name), log  # every step once, the reference's loss
    assert state(run)["status"] == "finished"
