"""Collectives of a simulated step: which, how many bytes, over which mesh dimension, across nodes or not.

CommDebugMode counts collectives by kind but not by process group; the mesh dimension is the point here
(a tensor-parallel group that leaves its node is the mistake to catch), so this mode records the group
of every c10d and functional-collective op the step dispatches, then names it by the mesh.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from relaytrain.parallel.mesh import submesh

_NAMESPACES = ("c10d", "_c10d_functional")
_NOT_TRAFFIC = {"wait_tensor", "barrier", "monitored_barrier"}
# Mesh dimensions that can hold a group, the 2-D HSDP mesh's own groups included.
MESH_DIMS = ("tp", "cp", "pp", "dp_shard", "dp_replicate", "dp_shard_cp", "dp")


@dataclass
class Collective:
    op: str
    mesh_dim: str
    group_size: int
    calls: int
    bytes: int  # the payload per call summed: the full (gathered / reduced) tensor's size
    crosses_nodes: bool

    def as_dict(self) -> dict:
        return asdict(self)


def _bytes_of(value) -> int:
    flat, _ = tree_flatten(value)
    return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))


class CollectiveCounter(TorchDispatchMode):
    """Counts calls and payload bytes per (op, process group name) on local tensors."""

    def __init__(self):
        super().__init__()
        self.calls: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        self.attention_ops: set[str] = set()

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
            entry = self.calls[(name.rstrip("_"), group)]
            entry[0] += 1
            entry[1] += payload
        return func(*args, **kwargs)

    @staticmethod
    def _group_name(args, kwargs) -> str:
        flat, _ = tree_flatten((args, kwargs))
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


def collectives(counter: CollectiveCounter, mesh: DeviceMesh | None, gpus_per_node: int) -> list[Collective]:
    table = group_table(mesh, gpus_per_node)
    out = []
    for (op, group), (calls, payload) in sorted(counter.calls.items()):
        dim, ranks = table.get(group, ("other", []))
        if dim == "other":
            try:  # a group the mesh does not name (e.g. DTensor's flattened multi-dim reduce)
                ranks = dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(group))
            except (RuntimeError, ValueError, KeyError):
                ranks = []
        out.append(Collective(op, dim, len(ranks), calls, payload, crosses_nodes(ranks, gpus_per_node)))
    return out
