"""Collectives of a simulated step: which, how many bytes, over which mesh dimension, across nodes or not.

CommDebugMode counts collectives by kind but not by process group; the mesh dimension is the point here
(a tensor-parallel group that leaves its node is the mistake to catch), so this mode records the group
of every c10d and functional-collective op the step dispatches, then names it by the mesh.

The simulated step runs k of the real step's n micro batches (relaytrain.parallel.simulate); `collectives`
scales what repeats with every micro batch by n / k, so that the counts are the whole step's, and keeps
once-per-step traffic as it is: everything after the forward and backward passes (gradient clipping, the
optimizer), the HSDP all-reduce across replica groups (held until the last micro batch), a pipeline
stage's FSDP all-gathers and reduce-scatters (a stage stays gathered and its reduction waits for the last
micro batch), the pipeline's loss broadcast and scalar all-reduces (the step's loss). Each record keeps
what the simulation measured beside it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from relaytrain.parallel.mesh import submesh
from relaytrain.torch_private import dispatch_mode_base, resolve_process_group, tree_leaves

_NAMESPACES = ("c10d", "_c10d_functional")
_NOT_TRAFFIC = {"wait_tensor", "barrier", "monitored_barrier"}
# Mesh dimensions that can hold a group, the 2-D HSDP mesh's own groups included.
MESH_DIMS = ("tp", "cp", "pp", "dp_shard", "dp_replicate", "dp_shard_cp", "dp")


@dataclass
class Collective:
    op: str
    mesh_dim: str
    group_size: int
    calls: int  # in the whole step (see the module doc)
    bytes: int  # the payload per call summed: the full (gathered / reduced) tensor's size, whole step
    crosses_nodes: bool
    per: str = "step"  # "micro batch": scaled from the simulated micro batches; "step": once per step
    simulated_calls: int = 0  # as measured in the simulated micro batches
    simulated_bytes: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def _bytes_of(value) -> int:
    flat = tree_leaves(value)
    return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))


class CollectiveCounter(dispatch_mode_base()):
    """Counts calls and payload bytes per (op, process group name) on local tensors."""

    def __init__(self):
        super().__init__()
        self.calls: dict[tuple[str, str, bool], list[int]] = defaultdict(lambda: [0, 0])
        self.attention_ops: set[str] = set()
        self.after_micro_batches = False  # set once the forward and backward passes are done

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t == DTensor for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if "scaled_dot_product" in name:
            self.attention_ops.add(name)
        if func.namespace in _NAMESPACES and name not in _NOT_TRAFFIC:
            group = self._group_name(args, kwargs)
            # The payload: the largest argument (the gathered output, the reduced input, the tensor sent).
            payload = max((_bytes_of(a) for a in (*args, *kwargs.values())), default=0)
            entry = self.calls[(name.rstrip("_"), group, self.after_micro_batches)]
            entry[0] += 1
            entry[1] += payload
        return func(*args, **kwargs)

    @staticmethod
    def _group_name(args, kwargs) -> str:
        flat = tree_leaves((args, kwargs))
        for a in flat:
            if isinstance(a, torch.ScriptObject):
                return dist.ProcessGroup.unbox(a).group_name
            if isinstance(a, dist.ProcessGroup):
                return a.group_name
        # Functional collectives take the group's name as their last string argument.
        names = [a for a in flat if isinstance(a, str)]
        return names[-1] if names else "?"


def group_table(mesh: DeviceMesh | None, gpus_per_node: int) -> dict[str, tuple[str, list[int]]]:
    """Process group name -> (mesh dimension, global ranks), for this rank's groups of the real mesh."""
    table: dict[str, tuple[str, list[int]]] = {}
    if mesh is None:
        return table
    for dim in MESH_DIMS:
        try:
            group = submesh(mesh, dim).get_group()
        except (KeyError, RuntimeError, ValueError):
            continue
        table.setdefault(group.group_name, (dim, dist.get_process_group_ranks(group)))
    return table


def crosses_nodes(ranks: list[int], gpus_per_node: int) -> bool:
    return len({r // gpus_per_node for r in ranks}) > 1


_FSDP_DIMS = ("dp_shard", "dp_shard_cp", "dp")


def _once_per_step(op: str, dim: str, calls: int, payload: int, after: bool, pipeline: bool) -> bool:
    """Whether a collective runs once per step rather than with every micro batch (module doc)."""
    scalar = calls and payload // calls <= 8
    return (
        after
        or op == "broadcast"
        or dim == "dp_replicate"
        or (pipeline and dim in _FSDP_DIMS)
        or (op in ("all_reduce", "allreduce") and bool(scalar))
    )


def collectives(
    counter: CollectiveCounter,
    mesh: DeviceMesh | None,
    gpus_per_node: int,
    scale: float = 1.0,
    pipeline: bool = False,
) -> list[Collective]:
    """The step's collectives: `scale` = the real step's micro batches / the simulated ones."""
    table = group_table(mesh, gpus_per_node)
    merged: dict[tuple[str, str, bool], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for (op, group, after), (calls, payload) in counter.calls.items():
        dim = table.get(group, ("other", []))[0]
        once = _once_per_step(op, dim, calls, payload, after, pipeline)
        factor = 1.0 if once else scale
        entry = merged[(op, group, once)]
        entry[0] += round(calls * factor)
        entry[1] += round(payload * factor)
        entry[2] += calls
        entry[3] += payload
    out = []
    for (op, group, once), (calls, payload, measured, measured_bytes) in sorted(merged.items()):
        dim, ranks = table.get(group, ("other", []))
        if dim == "other":
            try:  # a group the mesh does not name (e.g. DTensor's flattened multi-dim reduce)
                ranks = dist.get_process_group_ranks(resolve_process_group(group))
            except (RuntimeError, ValueError, KeyError):
                ranks = []
        per = "step" if once else "micro batch"
        crossing = crosses_nodes(ranks, gpus_per_node)
        out.append(Collective(op, dim, len(ranks), calls, payload, crossing, per, measured, measured_bytes))
    return out
