"""What a node's host memory holds while it trains, for `relaytrain plan`: per process, the interpreter,
torch, the CUDA host side and the data loader (4 GiB); with `parallel.cpu_offload` the offloaded weights,
gradients and AdamW state (relaytrain.plan.gpu_memory); with `checkpoint.mode = "async"` on GPUs the
pinned host buffers that each save copies the rank's state into before writing it while training goes on
(relaytrain.checkpoint.manager: kept and reused by every save): 12 bytes per parameter (fp32 weights and
the two AdamW moments) over the ranks that split the model (tp x pp x dp_shard x cp), for each rank of
the node (none with cpu_offload, whose state is written from host memory as it is); with
`checkpoint.snapshot_every` the snapshots (relaytrain.plan.snapshot_memory). Their sum is checked
against the node's memory.
"""

from __future__ import annotations

from relaytrain.config import Config
from relaytrain.plan.gpu_memory import GIB, MemoryEstimate
from relaytrain.plan.snapshot_memory import snapshot_bytes_per_node

TIGHT_FRACTION = 0.90


def stages_async_copies(cfg: Config, gpus: int) -> bool:
    """Whether each save copies the state into host buffers: async checkpoints of state on GPUs."""
    ck = cfg.checkpoint
    return bool(ck.enabled and ck.mode == "async" and gpus and not cfg.parallel.cpu_offload)


def async_checkpoint_bytes_per_node(cfg: Config, dims, per_node: int, parameters: int, gpus: int) -> float:
    """Pinned host buffers of async checkpoints on one node (0 when saves do not stage a copy)."""
    if not stages_async_copies(cfg, gpus):
        return 0.0
    return 12.0 * parameters / (dims.tp * dims.pp * dims.dp_shard * dims.cp) * per_node


def host_memory_parts(
    cfg: Config, mem: MemoryEstimate, dims, nodes: int, per_node: int, parameters: int, gpus: int
) -> list[tuple[str, float]]:
    """(what, bytes per node) for every consumer of host memory on a node."""
    first = "offloaded states + process overhead" if mem.offloaded else "process overhead"
    parts = [(first, mem.host_per_process() * per_node)]
    staging = async_checkpoint_bytes_per_node(cfg, dims, per_node, parameters, gpus)
    if staging:
        parts.append(("async checkpoint buffers (pinned)", staging))
    if cfg.checkpoint.enabled and cfg.checkpoint.snapshot_every:
        files, buffers = snapshot_bytes_per_node(cfg, dims, nodes, per_node, parameters)
        parts.append(("snapshots", files + buffers))
    return parts


def host_memory_check(
    cfg: Config,
    mem: MemoryEstimate,
    dims,
    nodes: int,
    per_node: int,
    parameters: int,
    gpus: int,
    host_memory: tuple[float, str] | None,
) -> tuple[str, str, str]:
    parts = host_memory_parts(cfg, mem, dims, nodes, per_node, parameters, gpus)
    need = sum(value for _, value in parts)
    listed = ", ".join(f"{name} {value / GIB:.1f} GiB" for name, value in parts)
    detail = f"{need / GIB:.1f} GiB per node for {per_node} process(es) ({listed})"
    if host_memory is None:
        hint = ": node memory unknown; pass --mem (e.g. --mem 0 for all)"
        # Offloading makes host memory the constraint; otherwise the sum is told, not yet checked.
        return ("host memory", "warn" if mem.offloaded else "ok", detail + hint)
    capacity, source = host_memory
    detail += f", of {capacity / GIB:.1f} GiB ({source})"
    if need > capacity:
        fix = "; ask for more --mem, use more nodes, or shard further"
        if any(name.startswith("async") for name, _ in parts):
            fix += ', or checkpoint.mode="sync"'
        return ("host memory", "fail", detail + fix)
    if need > capacity * TIGHT_FRACTION:
        return ("host memory", "warn", detail + " (tight: less than 10% headroom)")
    return ("host memory", "ok", detail)
