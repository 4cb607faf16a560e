"""Host memory that in-memory snapshots take per node (`checkpoint.snapshot_every`), for `relaytrain plan`.

Each rank's snapshot holds what a checkpoint holds of it: fp32 weights and the two AdamW moments of its
shard, 12 bytes per parameter over the ranks that split the model (tp x pp x dp_shard x cp). A node keeps
its ranks' files of the newest two steps, and as many copies of other nodes' files as each rank has
replicas (`checkpoint.snapshot_replicas`, clipped to the other nodes), in its tmpfs; each process also
keeps one host buffer of its own snapshot, the copy that training waits for.
"""

from __future__ import annotations

from relaytrain.config import Config

GIB = 1024**3
TMPFS_SHARE = 0.5  # Linux sizes /dev/shm to half of the node's memory unless told otherwise
STEPS_KEPT = 2


def snapshot_bytes_per_node(
    cfg: Config, dims, nodes: int, per_node: int, parameters: int
) -> tuple[float, float]:
    """(bytes in the node's snapshot folder, bytes of the processes' host buffers) per node."""
    split = dims.tp * dims.pp * dims.dp_shard * dims.cp
    per_rank = 12.0 * parameters / split
    degree = max(0, min(cfg.checkpoint.snapshot_replicas, nodes - 1))
    files = per_rank * per_node * STEPS_KEPT * (1 + degree)
    return files, per_rank * per_node


def snapshot_memory_check(
    cfg: Config, dims, nodes: int, per_node: int, parameters: int, host_memory: tuple[float, str] | None
) -> tuple[str, str, str]:
    files, buffers = snapshot_bytes_per_node(cfg, dims, nodes, per_node, parameters)
    degree = max(0, min(cfg.checkpoint.snapshot_replicas, nodes - 1))
    detail = (
        f"{(files + buffers) / GIB:.1f} GiB per node: {files / GIB:.1f} GiB in {cfg.checkpoint.snapshot_dir} "
        f"(newest {STEPS_KEPT} steps of {per_node} rank(s), {degree} replica(s)) + {buffers / GIB:.1f} GiB "
        "of host buffers"
    )
    if host_memory is None:
        return ("snapshots", "warn", detail + ": node memory unknown; pass --mem (e.g. --mem 0 for all)")
    capacity, source = host_memory
    detail += f", of {capacity / GIB:.1f} GiB ({source})"
    fix = "; set checkpoint.snapshot_replicas lower, use more nodes, or checkpoint.snapshot_every=0"
    if files + buffers > capacity:
        return ("snapshots", "fail", detail + fix)
    if files > capacity * TMPFS_SHARE:
        return (
            "snapshots",
            "warn",
            detail + f" (more than the half of it a default {cfg.checkpoint.snapshot_dir} holds)",
        )
    return ("snapshots", "ok", detail)
