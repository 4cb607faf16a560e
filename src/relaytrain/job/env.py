"""SLURM -> torch.distributed environment mapping inside an srun task.

`srun` starts one task per GPU and sets SLURM_PROCID/SLURM_LOCALID/...; torch wants RANK/LOCAL_RANK/
WORLD_SIZE/MASTER_ADDR/MASTER_PORT. `apply_slurm_env` fills them in inside an srun step, unless a
launcher (torchrun) has already set them. The task wrapper (`python -m relaytrain.job.task --map-env
-- CMD ...`) applies it before any program (DeepSpeed, Lightning, a plain script) starts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from relaytrain.job.ports import base_port
from relaytrain.job.slurm_command import run_slurm_command

# Slurm's internal ids for the batch and extern steps (and others near 2**32) are not srun steps.
_MAX_REAL_STEP_ID = 0xFFFFFF00


def in_srun_step(environ: Mapping[str, str]) -> bool:
    """True inside a task that srun started (not the batch shell, not a login shell)."""
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID", ""))
    return step.isdigit() and int(step) < _MAX_REAL_STEP_ID and "SLURM_PROCID" in environ


def expand_nodelist(nodelist: str) -> list[str]:
    """`node[1-3],gpu07` -> hostnames, with python-hostlist, else `scontrol show hostnames`."""
    if not nodelist:
        return []
    try:
        import hostlist

        return list(hostlist.expand_hostlist(nodelist))
    except ImportError:
        return run_slurm_command(["scontrol", "show", "hostnames", nodelist]).stdout.split()


def tasks_on_node(tasks_per_node: str, node_index: int) -> int | None:
    """SLURM_STEP_TASKS_PER_NODE (`4(x2),3`) -> the task count of node `node_index`."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            return None
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts[node_index] if 0 <= node_index < len(counts) else None


def _visible_ids(value: str | None) -> list[str] | None:
    return None if value is None else [v for v in value.split(",") if v]


def normalize_amd_visibility(environ: MutableMapping[str, str]) -> None:
    """On AMD nodes Slurm restricts GPUs with ROCR_VISIBLE_DEVICES, which renumbers them from 0.

    HIP_VISIBLE_DEVICES/CUDA_VISIBLE_DEVICES that repeat the same absolute ids (set by a module, a
    container hook or Slurm's gres plugin) would filter a second time and hide devices, so they are dropped.
    Different values are kept: they are the user's own selection.
    """
    rocr = _visible_ids(environ.get("ROCR_VISIBLE_DEVICES"))
    if not rocr:
        return
    for key in ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        ids = _visible_ids(environ.get(key))
        if ids is not None and ids == rocr and ids != [str(i) for i in range(len(ids))]:
            del environ[key]


def apply_slurm_env(environ: MutableMapping[str, str]) -> bool:
    """Set RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR and MASTER_PORT from
    the SLURM variables of an srun task. Returns whether it applied.

    Does nothing outside an srun step or when RANK and WORLD_SIZE are already set (torchrun sets them).
    MASTER_ADDR/MASTER_PORT already exported by the job script are kept; otherwise MASTER_ADDR is the
    first host of the step's nodelist and MASTER_PORT is derived from the job id (the same on every rank).
    """
    if not in_srun_step(environ) or ("RANK" in environ and "WORLD_SIZE" in environ):
        return False
    node_id = int(environ.get("SLURM_NODEID", "0"))
    world = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or "1"
    local_world = None
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if environ.get(key):
            local_world = tasks_on_node(environ[key], node_id)
            if local_world is not None:
                break
    if local_world is None:
        local_world = int(environ.get("SLURM_NTASKS_PER_NODE", world))
    environ["RANK"] = environ["SLURM_PROCID"]
    environ["LOCAL_RANK"] = environ.get("SLURM_LOCALID", "0")
    environ["WORLD_SIZE"] = world
    environ["LOCAL_WORLD_SIZE"] = str(local_world)
    environ["NODE_RANK"] = str(node_rank(environ, node_id))
    if not environ.get("MASTER_ADDR"):
        nodelist = (
            environ.get("SLURM_STEP_NODELIST")
            or environ.get("SLURM_JOB_NODELIST")
            or environ.get("SLURM_NODELIST", "")
        )
        hosts = expand_nodelist(nodelist)
        environ["MASTER_ADDR"] = hosts[0] if hosts else "127.0.0.1"
    if not environ.get("MASTER_PORT"):
        environ["MASTER_PORT"] = str(base_port(environ.get("SLURM_JOB_ID", "0")))
    normalize_amd_visibility(environ)
    return True


def node_rank(environ: Mapping[str, str], node_id: int) -> int:
    """This node's place among the step's nodes in rank order: SLURM_NODEID, except in a step placed by a
    host file (a spare in a lower node's place), whose ranks follow the file's node order, not Slurm's
    (the node id follows Slurm's): then the node's first line in the file, counting each node once."""
    hostfile, me = environ.get("SLURM_HOSTFILE"), environ.get("SLURMD_NODENAME")
    if not hostfile or not me:
        return node_id
    try:
        lines = Path(hostfile).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return node_id
    order = list(dict.fromkeys(line.strip() for line in lines if line.strip()))
    return order.index(me) if me in order else node_id


def narrow_to_nodes(environ: MutableMapping[str, str], nodes: list[str]) -> None:
    """The job's node variables for a job step restarted on fewer nodes (a node was lost under
    `sbatch --no-kill`): the tasks read the job's nodes from these, and the lost node is no longer the
    job's. The task count goes too: the step's `srun --ntasks` sets it."""
    joined = ",".join(nodes)
    environ.update(
        SLURM_JOB_NODELIST=joined,
        SLURM_NODELIST=joined,
        SLURM_JOB_NUM_NODES=str(len(nodes)),
        SLURM_NNODES=str(len(nodes)),
    )
    for name in ("SLURM_NTASKS", "SLURM_NPROCS"):
        environ.pop(name, None)


def place_by_hostfile(environ: MutableMapping[str, str], hostfile: str | None) -> bool:
    """Have the next `srun --distribution=arbitrary` place its tasks by ``hostfile`` (one node per task,
    in rank order), or (None) by Slurm's node order again; returns whether a host file was in use."""
    if hostfile is not None:
        environ["SLURM_HOSTFILE"] = hostfile
        return True
    return environ.pop("SLURM_HOSTFILE", None) is not None
