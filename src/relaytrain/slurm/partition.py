"""What the cluster says about a partition's nodes: GPUs (GRES), CPUs and memory, from `sinfo`.

Used where the user did not say it: `slurm.gpus_per_node` left at -1 takes the partition's GPU count
(0 on CPU-only nodes), and `relaytrain plan` checks host memory (CPU offload) against `--mem`, or the
node's memory when no `--mem` is given; CPUs, memory and `--exclusive` that nobody set are chosen from
them (relaytrain.slurm.resources). Where `sinfo` cannot answer (no Slurm here, controller down)
the facts are unknown.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

from relaytrain.errors import UserError
from relaytrain.slurm.client import SlurmUnavailable, run_slurm

SINFO_TIMEOUT_S = 10
DEFAULT_GPUS_PER_NODE = 8  # GPUs per node assumed when neither the user, the profile nor `sinfo` says it
_GPU_COUNT = re.compile(r"^gpu(?::[^:(]+)*?:(\d+)")
_MEM = re.compile(r"^(\d+)([KMGT]?)$", re.I)
_MEM_UNITS = {"K": 1024, "": 1024**2, "M": 1024**2, "G": 1024**3, "T": 1024**4}


@dataclass(frozen=True)
class PartitionFacts:
    partition: str
    gpus_per_node: int  # the smallest GPU count of the partition's node groups; 0: CPU-only
    memory_mb: int  # the smallest node memory (Slurm's RealMemory), 0 if unknown
    cpus: int = 0  # the smallest CPU count per node, 0 if unknown


def mem_bytes(mem: str) -> int:
    """`slurm.mem` as sbatch reads it ('64G', '500000', '512000M'; no suffix: MB) -> bytes; 0: whole node."""
    match = _MEM.match(mem.strip())
    if not match:
        raise UserError(
            f"slurm.mem={mem!r} is not a Slurm memory size; use e.g. 64G, 500000M or 0 (whole node)"
        )
    return int(match.group(1)) * _MEM_UNITS[match.group(2).upper()]


def host_memory(partition: str, mem: str) -> tuple[float, str] | None:
    """Memory per node a job gets, and where that figure comes from: --mem, else the node's in sinfo."""
    asked = mem_bytes(mem) if mem else 0
    if asked:
        return float(asked), f"--mem {mem}"
    facts = partition_facts(partition)
    if facts and facts.memory_mb:
        return facts.memory_mb * 1024.0**2, f"node memory of partition {facts.partition} (sinfo)"
    return None


def gres_gpus(gres: str) -> int:
    """GPUs in one node's GRES string: 'gpu:h100:8(S:0-1)', 'gpu:4,nvme:1', '(null)' -> 8, 4, 0."""
    total = 0
    for item in gres.split(","):
        match = _GPU_COUNT.match(item.strip())
        if match:
            total += int(match.group(1))
    return total


def _smallest(values: list[str]) -> int:
    """The smallest of sinfo's figures ('512000', '96+' for a range): 0 when none is a number."""
    known = [int(v.strip().rstrip("+")) for v in values if v.strip().rstrip("+").isdigit()]
    return min(known) if known else 0


def parse_sinfo(text: str, partition: str) -> PartitionFacts | None:
    """`sinfo -h -o '%P|%G|%m|%c'` lines -> the facts of `partition` ('' : the default partition)."""
    rows = [line.split("|") + [""] for line in text.splitlines() if line.count("|") in (2, 3)]
    if partition:
        chosen = [r for r in rows if r[0].rstrip("*") == partition]
    else:
        chosen = [r for r in rows if r[0].endswith("*")]
    if not chosen:
        return None
    return PartitionFacts(
        partition=chosen[0][0].rstrip("*"),
        gpus_per_node=min(gres_gpus(row[1]) for row in chosen),
        memory_mb=_smallest([row[2] for row in chosen]),
        cpus=_smallest([row[3] for row in chosen]),
    )


def partition_facts(partition: str) -> PartitionFacts | None:
    """Ask `sinfo` about `partition` (or the default one); None when Slurm cannot answer."""
    return _cached_facts(partition, os.environ.get("SLURM_CONF", ""), os.environ.get("PATH", ""))


@functools.lru_cache(maxsize=16)
def _cached_facts(partition: str, _slurm_conf: str, _path: str) -> PartitionFacts | None:
    try:
        done = run_slurm(["sinfo", "-h", "-o", "%P|%G|%m|%c"], timeout=SINFO_TIMEOUT_S)
    except SlurmUnavailable:
        return None  # planning off the cluster: the facts are unknown
    if done.returncode != 0:
        return None
    return parse_sinfo(done.stdout, partition)
