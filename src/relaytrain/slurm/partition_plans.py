"""The plans `relaytrain plan` prints and launch checks: one per node count Slurm may start a job on,
each with the host memory the partition gives a node (asked of `sinfo` only when a check needs it).
"""

from __future__ import annotations

from relaytrain.config import Config, SlurmConfig
from relaytrain.plan.checks import Plan, make_plan
from relaytrain.plan.host_memory import stages_async_copies
from relaytrain.plan.step_time import DEFAULT_MFU
from relaytrain.slurm.partition import host_memory


def plan_for(cfg: Config, nodes: int = 0, mfu: float = DEFAULT_MFU) -> Plan:
    """The plan for the resolved `[slurm]` section of `cfg` at `nodes` nodes (0: slurm.nodes)."""
    s = cfg.slurm
    needs_host = (
        cfg.parallel.cpu_offload or cfg.checkpoint.snapshot_every or stages_async_copies(cfg, s.gpus_per_node)
    )
    host = host_memory(s.partition, s.mem) if needs_host else None
    return make_plan(cfg, nodes or s.nodes, s.gpus_per_node, s.gpu_type, s.tasks_per_node, host, mfu)


def node_counts(s: SlurmConfig) -> list[int]:
    """Every node count Slurm may start a job on: slurm.min_nodes..slurm.nodes, or just slurm.nodes."""
    return list(range(min(s.min_nodes or s.nodes, s.nodes), s.nodes + 1))


def plans_for(cfg: Config, mfu: float = DEFAULT_MFU) -> list[Plan]:
    """One plan per node count of the range (what launch checks and `relaytrain plan` prints)."""
    return [plan_for(cfg, nodes, mfu) for nodes in node_counts(cfg.slurm)]
