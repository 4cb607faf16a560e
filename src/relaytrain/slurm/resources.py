"""CPUs, memory and node exclusivity for a job whose profile, config and flags do not say them.

Slurm's own default is one CPU per task: a one-node job (one srun task running torchrun with a worker per
GPU) would run every worker on one core. So where nobody set `slurm.cpus_per_task`, `slurm.mem` or
`slurm.exclusive`, the launcher chooses them and says so:

* CPU-only nodes (`gpus_per_node = 0`): one CPU per process (what the local test cluster profile sets).
* `sinfo` knows the partition's nodes (GPUs, CPUs, memory): a job that asks for every GPU of a node gets
  the whole node (`--exclusive`, `--mem=0`, the node's CPUs split over its processes); a job that asks for
  part of a node gets that share of the node's CPUs and memory.
* `sinfo` cannot answer (a dry run on a laptop, the controller down): a job asking for
  `DEFAULT_GPUS_PER_NODE` GPUs or more is taken to want whole nodes (`--exclusive`, `--mem=0`; the job
  step splits the node's CPUs at run time, `SLURM_CPUS_ON_NODE`), a smaller one gets
  `DEFAULT_CPUS_PER_GPU` CPUs per process and Slurm's default memory.

A value a profile, the config or a flag sets always wins. An exclusive job whose `cpus_per_task` is 0
gets the node's CPUs split over its processes by the job step at run time (templates/job.sh.j2).
"""

from __future__ import annotations

from relaytrain.config import SlurmConfig
from relaytrain.slurm.partition import DEFAULT_GPUS_PER_NODE, partition_facts

CHOSEN_KEYS = ("cpus_per_task", "mem", "exclusive")
DEFAULT_CPUS_PER_GPU = 4  # per process on part of a node when sinfo cannot tell the node's CPUs
OVERRIDE_HINT = "set slurm.cpus_per_task, slurm.mem or slurm.exclusive (flag, config, profile) to change it"


def choose_resources(s: SlurmConfig, given: set[str]) -> list[str]:
    """Fill the keys of CHOSEN_KEYS that are not in `given` (set by someone) into `s`; return one line
    saying what was chosen and why, or nothing when nothing was left to choose."""
    free = [key for key in CHOSEN_KEYS if key not in given]
    if not free:
        return []
    tasks = s.tasks_per_node or s.gpus_per_node
    if s.gpus_per_node == 0:
        if "cpus_per_task" not in free:
            return []
        s.cpus_per_task = 1
        return [f"resources: CPU-only nodes: 1 CPU per process (--cpus-per-task=1); {OVERRIDE_HINT}"]
    facts = partition_facts(s.partition)
    if facts is not None and facts.cpus and facts.gpus_per_node:
        whole = s.gpus_per_node >= facts.gpus_per_node
        share = 1.0 if whole else s.gpus_per_node / facts.gpus_per_node
        cpus = max(1, int(facts.cpus * share) // max(tasks, 1))
        mem = "0" if whole else (f"{int(facts.memory_mb * share)}M" if facts.memory_mb else "")
        memory = f"{facts.memory_mb} MB" if facts.memory_mb else "unknown memory"
        source = (
            f"partition {facts.partition} has {facts.gpus_per_node} GPUs, {facts.cpus} CPUs and {memory} "
            "per node (sinfo)"
        )
    else:
        whole = s.gpus_per_node >= DEFAULT_GPUS_PER_NODE
        cpus = 0 if whole else DEFAULT_CPUS_PER_GPU * s.gpus_per_node // max(tasks, 1)
        mem = "0" if whole else ""
        source = f"sinfo could not describe partition {s.partition or '(default)'}: " + (
            f"{s.gpus_per_node} GPUs per node taken as whole nodes, the step splits the node's CPUs "
            "over its processes at run time"
            if whole
            else f"{DEFAULT_CPUS_PER_GPU} CPUs per GPU, Slurm's default memory"
        )
    chosen = []
    if "exclusive" in free:
        s.exclusive = whole
        if whole:
            chosen.append("--exclusive")
    if "cpus_per_task" in free and cpus:
        s.cpus_per_task = cpus
        chosen.append(f"{cpus} CPUs per process")
    if "mem" in free and mem:
        s.mem = mem
        chosen.append("--mem=0 (all of the node's memory)" if mem == "0" else f"--mem={mem}")
    if not chosen:
        chosen.append("nothing")
    return [f"resources: {', '.join(chosen)}: {source}; {OVERRIDE_HINT}"]
