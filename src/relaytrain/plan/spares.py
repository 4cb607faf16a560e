"""What spare nodes cost (`relaytrain plan`): a job with `slurm.spare_nodes` holds K nodes beside its N
training nodes for its whole time limit, idle until one takes a failed, excluded or straggling node's
place (docs/elastic.md)."""

from __future__ import annotations

from typing import Any

from relaytrain.config import SlurmConfig
from relaytrain.config.domains import slurm_time_seconds


def spare_cost(s: SlurmConfig) -> dict[str, Any] | None:
    """{spare_nodes, allocated_nodes, idle_node_hours (per job, at its time limit; None when it has
    none), share (idle nodes / allocated nodes)}; None without spares."""
    if not s.spare_nodes:
        return None
    allocated = s.nodes + s.spare_nodes
    limit = slurm_time_seconds(s.time) if s.time else None
    hours = None if not limit else round(s.spare_nodes * limit / 3600, 2)
    return {
        "spare_nodes": s.spare_nodes,
        "allocated_nodes": allocated,
        "idle_node_hours": hours,
        "share": round(s.spare_nodes / allocated, 4),
    }


def spare_rows(s: SlurmConfig) -> list[tuple[str, str]]:
    """The plan table's row for the spares, none without."""
    cost = spare_cost(s)
    if cost is None:
        return []
    hours = cost["idle_node_hours"]
    per_job = "" if hours is None else f"{hours:g} idle node-hours per job, "
    allocated = f"sbatch --nodes={cost['allocated_nodes']}"
    share = f"{cost['share'] * 100:.1f} % of the allocation"
    return [
        ("spare nodes", f"{s.spare_nodes} idle beside {s.nodes} training ({allocated}): {per_job}{share}")
    ]
