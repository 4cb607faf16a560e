# ruff: noqa: F811  (the tests take the imported `work` fixture as a parameter)
"""What launch chooses and refuses before queueing: CPUs/memory/exclusivity nobody set, container paths,
chain dependencies in dry runs, array caps, and presets that pass their own plan (with estimates)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from relaytrain.cli import main
from relaytrain.config import load_config
from relaytrain.errors import UserError
from relaytrain.plan.checks import make_plan
from relaytrain.slurm import partition
from relaytrain.slurm.launch import LaunchRequest, chain, launch, sweep
from test_slurm_script import (
    dry,
    quiet,
    run_script,
    srun_calls,
    work,  # noqa: F401  (the fixture the tests below take)
)

from conftest import fake_tool

REPO = Path(__file__).resolve().parents[1]


def dry_lines(config: str, **kwargs) -> list[str]:
    lines: list[str] = []
    slurm = {"gpu_type": "h100", **kwargs.pop("slurm", {})}
    path = str(REPO / "configs" / f"{config}.toml")
    # Resources and layouts, not data: the presets' data rule is tests/test_data_fit.py's.
    overrides = [*kwargs.pop("overrides", []), "--data.allow_small=true"]
    launch(LaunchRequest(config=path, slurm=slurm, dry_run=True, overrides=overrides, **kwargs), lines.append)
    return lines


def test_a_whole_node_job_gets_the_node_when_sinfo_cannot_answer(work):
    # The issue's command: 8 GPUs on one node, no profile, no cluster to ask.
    lines = dry_lines("8b", slurm={"nodes": 1, "gpus_per_node": 8, "partition": "gpu", "time": "24:00:00"})
    (note,) = [line for line in lines if line.startswith("resources:")]
    assert "--exclusive" in note and "--mem=0" in note and "sinfo could not describe partition gpu" in note
    script = work / "runs/8b/slurm/job.sh"
    text = script.read_text().splitlines()
    assert "#SBATCH --exclusive" in text and "#SBATCH --mem=0" in text
    saved = load_config(work / "runs/8b/slurm/config.toml").slurm
    assert saved.exclusive and saved.mem == "0" and saved.cpus_per_task == 0
    # The step takes the node's CPUs at run time: 8 per worker of torchrun's one task.
    assert run_script(script, {"SLURM_CPUS_ON_NODE": "64"}).returncode == 0
    (step,) = srun_calls(work)
    assert "--cpus-per-task=64" in step


def test_cpus_and_memory_come_from_sinfo_and_a_set_value_wins(work):
    fake_tool(work / "bin", "sinfo", "printf 'gpu*|gpu:h100:8(S:0-1)|1000000|96\\n'\n")
    partition._cached_facts.cache_clear()
    whole = dry("7b", slurm={"nodes": 1, "gpus_per_node": 8}).splitlines()
    for line in ("#SBATCH --exclusive", "#SBATCH --mem=0", "#SBATCH --cpus-per-task=96"):
        assert line in whole, line
    assert "export OMP_NUM_THREADS=12" in whole
    half = dry("7b", name="half", slurm={"nodes": 2, "gpus_per_node": 4}).splitlines()
    assert "#SBATCH --cpus-per-task=12" in half and "#SBATCH --mem=500000M" in half
    assert "#SBATCH --exclusive" not in half
    lines = dry_lines(
        "7b",
        name="mine",
        # 7B's async checkpoints pin ~75 GiB of host buffers on the node: plan refuses less memory.
        overrides=["--slurm.exclusive=false", "--slurm.mem=256G"],
        slurm={"nodes": 1, "gpus_per_node": 8, "cpus_per_task": 3},
    )
    assert not [line for line in lines if line.startswith("resources:")]
    mine = (work / "runs/mine/slurm/job.sh").read_text().splitlines()
    assert "#SBATCH --cpus-per-task=24" in mine and "#SBATCH --mem=256G" in mine
    assert "#SBATCH --exclusive" not in mine


def test_cpu_only_torchrun_holds_one_cpu_per_worker(work):
    text = dry("debug", slurm={"nodes": 1, "gpus_per_node": 0, "tasks_per_node": 2, "gpu_type": ""})
    assert "#SBATCH --cpus-per-task=2" in text.splitlines() and "export OMP_NUM_THREADS=1" in text


CONTAINER = {
    "container_image": "nvcr.io#nvidia/pytorch:25.09-py3",
    "container_mounts": ["/shared:/shared"],
    "container_workdir": "/shared/me/proj",
}


def test_survivors_run_under_one_node_s_torchrun_and_are_refused_where_ranks_are_srun_s_tasks(work, capsys):
    """One node: its torchrun gets the replacement budget, its own restarts stay 0. Several nodes (or a
    --command program): one line, before anything is written; a setting accepted and left without effect
    would be worse than a refusal."""
    for extra in (["--nodes", "2"], ["--nodes", "1-2"]):
        code = main(["launch", str(REPO / "configs/debug.toml"), "--gpus-per-node", "0", "--tasks-per-node",
                     "1", *extra, "--dry-run", "--resilience.survivors=true"])  # fmt: skip
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "resilience.survivors=true: a job of " in err[0], err
        assert "one of srun's tasks" in err[0] and "(--nodes 1)" in err[0], err
        assert not (work / "runs" / "debug").exists()
    code = main(["launch", "--command", "python train.py", "--name", "prog", "--gpus-per-node", "0",
                 "--tasks-per-node", "1", "--dry-run", "--resilience.survivors=true"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "resilience.survivors=true with --command" in err[0], err
    one = dry("debug", slurm={"nodes": 1, "gpus_per_node": 0, "tasks_per_node": 2},
              overrides=["--resilience.survivors=true", "--resilience.survivor_replacements=2"])  # fmt: skip
    (line,) = [line for line in one.splitlines() if "-m relaytrain.job.torchrun" in line]
    assert line.endswith("-m relaytrain.job.torchrun --survivor-replacements=2"), line
    assert "--standalone --nproc_per_node=2 --max_restarts=0" in one
    off = dry("debug", slurm={"nodes": 1, "gpus_per_node": 0, "tasks_per_node": 2})
    assert "--survivor-replacements" not in off


def test_a_container_job_whose_run_directory_is_not_mounted_is_refused(work, capsys):
    args = [f"--slurm.{key}={value}" for key, value in CONTAINER.items() if key != "container_mounts"]
    code = main(["launch", str(REPO / "configs/debug.toml"), "--gpus-per-node", "0", "--tasks-per-node", "1",
                 "--dry-run", '--slurm.container_mounts=["/shared:/shared"]', *args])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"the run directory {work}/runs/debug is not mounted at the same path inside the image" in err[0]
    assert not (work / "runs").exists()  # nothing written
    # Mounted, but the job would run in another directory and resolve run.dir='runs' there.
    with pytest.raises(UserError, match="run.dir='runs' is relative and the job runs in /shared/me/proj"):
        dry("debug", slurm={"gpus_per_node": 0, "tasks_per_node": 1, **CONTAINER,
                            "container_mounts": [f"{work}:{work}"]})  # fmt: skip


def test_a_container_job_says_how_relaytrain_runs_and_what_it_leaves_out(work):
    slurm = {"gpus_per_node": 0, "tasks_per_node": 1, "nodes": 2, "container_image": "img.sqsh",
             "container_mounts": [f"{work}:{work}"]}  # fmt: skip
    lines = dry_lines("debug", overrides=['--data.sources=["/elsewhere/corpus"]'], slurm=slurm)
    text = "\n".join(lines)
    assert "data source /elsewhere/corpus is not mounted" in text
    assert "relaytrain must be installed in the image" in text
    assert "left out: the pip freeze summary" in text and "crash recovery" in text
    script = work / "runs/debug/slurm/job.sh"
    assert f"    --container-workdir={work}" in script.read_text().splitlines()  # the launch directory
    # The crash check runs on the batch shell's python when it imports relaytrain, else says it did not.
    fake_tool(work / "bin", "srun", "exit 3\n")
    fake_tool(work / "bin", "python", "exit 1\n")
    result = run_script(script, {})
    assert result.returncode == 3
    assert (
        "this shell's python (outside the container image) cannot import relaytrain: the job step runs once, "
        "without the end-of-step decision or a requeue" in result.stdout
    )


def test_a_chain_dry_run_prints_linked_submissions_that_run_as_printed(work):
    lines: list[str] = []
    configs = [str(REPO / "configs/debug.toml"), str(REPO / "configs/125m.toml")]
    slurm = {"gpus_per_node": 0, "tasks_per_node": 1}
    toy = ["--data.allow_small=true"]  # the 125m preset on the bundled corpus (tests/test_data_fit.py)
    chain(
        LaunchRequest(after="1234", dry_run=True, slurm=slurm, force=True, overrides=toy),
        configs,
        lines.append,
    )
    tail = lines[lines.index("dry run: the chain is submitted with these commands, in order:") + 1 :]
    first, second = (work / "runs/debug/slurm/job.sh"), (work / "runs/125m/slurm/job.sh")
    assert [line.strip() for line in tail] == [
        f"stage0=$(sbatch --parsable --dependency=afterok:1234 --kill-on-invalid-dep=yes {first})",
        f'stage1=$(sbatch --parsable "--dependency=afterok:$stage0" --kill-on-invalid-dep=yes {second})',
    ]
    assert f"# Reproduce with: sbatch --dependency=afterok:1234 --kill-on-invalid-dep=yes {first}" in (
        first.read_text()
    )
    assert not list(work.glob("fake.sbatch.*"))  # a dry run submits nothing
    subprocess.run(["bash", "-c", "\n".join(tail)], check=True)  # the printed lines, pasted into a shell
    stage0, stage1 = (work / f"fake.sbatch.{n}" for n in (101, 102))
    assert "--dependency=afterok:1234" in stage0.read_text().splitlines()
    assert "--dependency=afterok:101" in stage1.read_text().splitlines()
    with pytest.raises(UserError, match="is not a Slurm job id"):
        chain(LaunchRequest(after="12; rm -rf x", dry_run=True, slurm=slurm), configs[:1], quiet)


def test_a_sweep_caps_its_concurrent_array_tasks(work, capsys):
    slurm = {"gpus_per_node": 0, "tasks_per_node": 1}
    req = LaunchRequest(config=str(REPO / "configs/debug.toml"), dry_run=True, slurm=slurm, max_concurrent=2)
    sweep(req, ["optim.lr=0.1,0.2,0.3"], quiet)
    assert "#SBATCH --array=0-2%2" in (work / "runs/debug-sweep/slurm/job.sh").read_text().splitlines()
    code = main(["sweep", str(REPO / "configs/debug.toml"), "--grid", "optim.lr=0.1,0.2", "--dry-run",
                 "--max-concurrent", "0", "--gpus-per-node", "0", "--tasks-per-node", "1"])  # fmt: skip
    assert code == 2 and "--max-concurrent 0" in capsys.readouterr().err


def test_launch_help_for_nodes_speaks_of_the_job_not_a_chain(capsys):
    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    start = help_text.index("--nodes NODES number")
    nodes = help_text[start : help_text.index("--gpus-per-node", start)]
    assert "chain" not in nodes and "each requeue" in nodes


def _documented_plans() -> list[str]:
    lines = []
    for doc in ("README.md", "docs/launching.md", "docs/elastic.md"):
        for line in (REPO / doc).read_text().splitlines():
            if line.startswith("relaytrain plan ") and "configs/" in line:
                lines.append(line.split("#")[0].strip())
    return lines


# The layouts the docs show, and the ones a new user tried (issue: 70b on 4 nodes, 8b on one).
PLANS = [
    *_documented_plans(),
    "relaytrain plan configs/70b.toml --nodes 4 --gpus-per-node 8 --gpu h100 --data.allow_small=true",
    "relaytrain plan configs/8b.toml --nodes 1 --gpus-per-node 8 --gpu h100 --data.allow_small=true",
]


@pytest.mark.parametrize("command", PLANS)
def test_presets_pass_their_own_plan_on_the_documented_layouts(command, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    # The layouts are for GPU clusters: plan them as on a login node whose Slurm cannot be asked, not
    # against the CPU-only local cluster another test may have left up (SLURM_CONF).
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "no-slurm.conf"))
    assert len(_documented_plans()) >= 3
    assert main(shlex.split(command)[1:]) == 0
    out = capsys.readouterr().out
    assert "verdict: ok" in out, out
    assert "│ warn" not in out and "│ fail" not in out, out
    assert "step time (estimate)" in out and "time to train (estimate)" in out


def test_step_estimate_is_flops_over_assumed_mfu(capsys, monkeypatch, tmp_path):
    from relaytrain.model.flops import flops_per_token

    # An 8-GPU node's plan, not the CPU-only local cluster's (SLURM_CONF of a Slurm test run before).
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "no-slurm.conf"))

    cfg = load_config(REPO / "configs/8b.toml")
    plan = make_plan(cfg, 4, 8, "h100", mfu=0.5)
    flops = flops_per_token(cfg.model, 8192) * 512 * 8192
    assert plan.step.step_flops == flops
    assert plan.step.seconds == pytest.approx(flops / (32 * 989e12 * 0.5))
    args = ["--nodes", "4", "--gpus-per-node", "8", "--gpu", "h100", "--mfu", "50", "--data.allow_small=true"]
    assert main(["plan", str(REPO / "configs/8b.toml"), *args]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"step time \(estimate\)\s*│ {plan.step.seconds:.1f} s, assuming 50% MFU", out), out
    assert make_plan(cfg, 4, 8, "v100").step.seconds == 0.0  # no peak figure: no time estimate
