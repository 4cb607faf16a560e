"""What changed when a run resumes on another layout than its checkpoint was saved with."""

from __future__ import annotations

from relaytrain.parallel.dims import ParallelDims

_RESIZE_KEYS = ("world_size", "dp_replicate", "dp_shard", "micro_batch_size", "grad_accum")


def resize_fields(saved: dict | None, dims: ParallelDims, nodes: int) -> dict | None:
    """The `resize` event's fields when a run resumes on another layout than it saved with; else None.

    `saved`: the checkpoint's world size and parallel dims (with "nodes"). The global batch, the data
    order and the LR schedule do not change with the layout (see docs/elastic.md); only keys the
    checkpoint recorded are compared, so an older checkpoint never reports a resize it cannot see.
    """
    if not saved:
        return None
    now = {"nodes": nodes, **{key: getattr(dims, key) for key in _RESIZE_KEYS}}
    changed = [key for key in now if key in saved and saved[key] != now[key]]
    if not changed:
        return None

    def dp_of(layout: dict) -> int | None:
        if "dp_replicate" in layout and "dp_shard" in layout:
            return int(layout["dp_replicate"]) * int(layout["dp_shard"])
        return None

    return {
        "from_nodes": saved.get("nodes"),
        "nodes": nodes,
        "from_world_size": saved.get("world_size"),
        "world_size": dims.world_size,
        "from_dp": dp_of(saved),
        "dp": dims.dp,
        "from_micro_batch": saved.get("micro_batch_size"),
        "micro_batch": dims.micro_batch_size,
        "from_grad_accum": saved.get("grad_accum"),
        "grad_accum": dims.grad_accum,
    }
