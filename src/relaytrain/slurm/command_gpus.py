"""GPUs for a `--command` job: the GPUs its processes use, not every GPU of the node.

srun starts `slurm.tasks_per_node` tasks per node (0: one per GPU). A task of a plain program (one
process: a DeepSpeed or DDP rank started by srun) uses one GPU; a task that is a per-node launcher
(`torchrun` / `python -m relaytrain.job.torchrun --nproc_per_node=N`, `deepspeed --num_gpus=N`) uses N.
Where nobody set `slurm.gpus_per_node` (a flag, the config, a `--slurm.` override; a profile only says
what a node has) the job asks for tasks x GPUs per task, and says so when that is not the whole node;
where someone did and the command's processes use another number, launch warns: GPUs reserved and
idle, or more processes than GPUs.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from relaytrain.config import SlurmConfig

_COUNT_FLAG = re.compile(r"^--(nproc[_-]per[_-]node|num[_-]gpus)(=(.*))?$")
HINT = "pass --gpus-per-node and --tasks-per-node to change it"


def gpus_per_task(command: str) -> int | None:
    """GPUs one task of the command uses: N for a per-node launcher's `--nproc_per_node=N` or
    `--num_gpus=N`, 1 for a single process; None when the count is not a number (`$VAR`, `gpu`) or the
    `deepspeed` launcher takes every GPU it sees."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    for i, word in enumerate(words):
        match = _COUNT_FLAG.match(word)
        if match:
            value = match.group(3) if match.group(2) else (words[i + 1] if i + 1 < len(words) else "")
            return int(value) if value.isdigit() and int(value) > 0 else None
    return None if any(Path(w).name == "deepspeed" for w in words) else 1


def choose_command_gpus(s: SlurmConfig, command: str, user_set: bool) -> list[str]:
    """Set `s.gpus_per_node` for a --command job where the user did not (`user_set`); return the lines
    that say what was chosen, or warn where the numbers disagree."""
    if s.gpus_per_node <= 0:
        return []  # CPU-only nodes
    per_task, tasks, node = gpus_per_task(command), s.tasks_per_node, s.gpus_per_node
    if not tasks:  # one task per GPU
        if per_task is not None and per_task > 1:
            return [
                f"warning: the command starts {per_task} processes per task (a per-node launcher) and the "
                f"job one task per GPU, {node} per node: {node * per_task} processes for {node} GPUs; "
                "pass --tasks-per-node 1"
            ]
        return []
    if per_task is None:
        return [
            f"warning: cannot tell from the command how many GPUs each of its {tasks} task(s) per node uses; "
            f"asking for {node} per node; {HINT}"
        ]
    used = tasks * per_task
    if user_set:
        if used == node:
            return []
        what = f"{node - used} of them idle" if used < node else f"{used - node} processes without a GPU"
        return [
            f"warning: --gpus-per-node {node}, but the command's processes use {used} ({tasks} task(s) per "
            f"node x {per_task} GPU(s) per task): {what}; {HINT}"
        ]
    s.gpus_per_node = used
    if used == node:
        return []
    over = f"; more than the {node} a node has" if used > node else f" of the node's {node}"
    return [
        f"gpus: {used} GPU(s) per node ({tasks} task(s) per node x {per_task} GPU(s) per task, what the "
        f"command's processes use{over}); {HINT}"
    ]
