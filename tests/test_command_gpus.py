"""A `--command` job asks for the GPUs its processes use (relaytrain.slurm.command_gpus): tasks per node x
GPUs per task, or what the user says, with a warning where the numbers disagree. The documented
`launch --command` / `sweep --command` lines run as written (with `--dry-run` appended) on 8-GPU nodes
(no sinfo answer) and reserve exactly the GPUs their processes use."""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest

import test_slurm_script
from relaytrain.cli import main
from relaytrain.slurm.command_gpus import gpus_per_task
from test_readme import bash_blocks

from conftest import REPO, child_env

work = test_slurm_script.work  # fake srun/scontrol/sbatch on PATH, no sinfo answer, cwd in tmp_path


def documented_command_launches() -> list[str]:
    """Every `relaytrain launch|sweep --command` of the docs' bash blocks, continuation lines kept."""
    found = []
    for doc in ("programs.md", "launching.md"):
        for _, lines in bash_blocks(REPO / "docs" / doc):
            text = "\n".join(lines)
            for command in re.split(r"(?<!\\)\n", text):
                if re.match(r"relaytrain (launch|sweep) --command", command):
                    found.append(command)
    return found


def processes_per_task(script: str) -> int:
    """What one srun task of the script starts: a per-node launcher's --nproc_per_node, else 1."""
    match = re.search(r"--nproc_per_node=(\d+)", script)
    return int(match.group(1)) if match else 1


@pytest.mark.parametrize("line", documented_command_launches())
def test_documented_command_lines_reserve_the_gpus_their_processes_use(line, work):
    """Before: the DeepSpeed and Megatron lines (one process per node) and the sweep (4 tasks) reserved
    8 GPUs per node."""
    done = subprocess.run(["bash", "-c", line + " --dry-run"], cwd=work, env=child_env(), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "warning:" not in done.stdout, done.stdout
    name = shlex.split(line.replace("\\\n", " "))[shlex.split(line.replace("\\\n", " ")).index("--name") + 1]
    script = next((work / "runs").glob(f"{name}*/slurm/job.sh")).read_text()
    gpus = int(re.search(r"^#SBATCH --gpus-per-node=(\d+)$", script, re.M).group(1))
    tasks = int(re.search(r"^#SBATCH --ntasks-per-node=(\d+)$", script, re.M).group(1))
    assert tasks * processes_per_task(line) == gpus, (tasks, gpus, line)


def test_gpus_per_task_reads_per_node_launchers():
    assert gpus_per_task("python train.py --lr 1") == 1
    assert gpus_per_task("python -m relaytrain.job.torchrun --nproc_per_node=4 t.py") == 4
    assert gpus_per_task("torchrun --nproc-per-node 2 t.py") == 2
    assert gpus_per_task("deepspeed --num_gpus=8 t.py") == 8
    assert gpus_per_task("deepspeed t.py") is None  # every GPU it sees
    assert gpus_per_task("torchrun --nproc_per_node=$N t.py") is None


def _sbatch(work, name: str, option: str) -> int:
    script = (work / "runs" / name / "slurm" / "job.sh").read_text()
    return int(re.search(rf"^#SBATCH --{option}=(\d+)$", script, re.M).group(1))


def test_a_command_asks_for_what_its_processes_use_and_warns_where_told_otherwise(work, capsys):
    one = ["--tasks-per-node", "1", "--dry-run"]
    assert main(["launch", "--command", "python t.py", "--name", "a", *one]) == 0
    out = capsys.readouterr().out
    assert _sbatch(work, "a", "gpus-per-node") == 1 and "gpus: 1 GPU(s) per node" in out
    assert "warning:" not in out
    torchrun = "python -m relaytrain.job.torchrun --nproc_per_node=4 t.py"
    assert main(["launch", "--command", torchrun, "--name", "b", *one]) == 0
    assert _sbatch(work, "b", "gpus-per-node") == 4
    capsys.readouterr()
    # What the user says wins, with a warning naming the idle GPUs.
    assert main(["launch", "--command", "python t.py", "--name", "c", "--gpus-per-node", "8", *one]) == 0
    out = capsys.readouterr().out
    assert _sbatch(work, "c", "gpus-per-node") == 8
    assert "warning: --gpus-per-node 8, but the command's processes use 1" in out and "7 of them idle" in out
    # A per-node launcher left at one task per GPU: 8 launchers of 4 processes on 8 GPUs.
    assert main(["launch", "--command", torchrun, "--name", "d", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "warning: the command starts 4 processes per task" in out and "pass --tasks-per-node 1" in out
    # relaytrain's own trainer keeps one process per GPU on the node's GPUs.
    assert main(["launch", str(REPO / "configs" / "debug.toml"), "--name", "e", "--dry-run"]) == 0
    assert _sbatch(work, "e", "gpus-per-node") == 8
