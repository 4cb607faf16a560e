"""The device mesh: one named dimension per parallelism, laid out in `parallel.rank_order`."""

from __future__ import annotations

import weakref

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from relaytrain.parallel.dims import ParallelDims
from relaytrain.parallel.distributed import match_default_timeout
from relaytrain.parallel.layout import parse_rank_order
from relaytrain.torch_private import flatten_mesh

# Flattened dims of each mesh built here. PyTorch deprecates slicing flattened dims from the root mesh;
# the flattened meshes are kept instead.
_FLATTENED: weakref.WeakKeyDictionary[DeviceMesh, dict[str, DeviceMesh]] = weakref.WeakKeyDictionary()


def build_mesh(dims: ParallelDims, device_type: str, rank_order: str | None = None) -> DeviceMesh:
    """A mesh with every dimension kept, degree 1 included, so that names are the same for every layout.

    Named dims (outermost first as `rank_order` asks): "pp", "dp_replicate", "dp_shard", "cp", "tp";
    flattened (reach them with `submesh`): "dp" (dp_replicate x dp_shard: data loading, loss averaging) and
    "dp_shard_cp" (dp_shard x cp: what FSDP shards over, since context-parallel ranks hold the same weights).
    """
    if rank_order is not None and parse_rank_order(rank_order) != dims.rank_order:
        dims = ParallelDims(
            dims.dp_replicate,
            dims.dp_shard,
            dims.cp,
            dims.tp,
            dims.pp,
            dims.world_size,
            parse_rank_order(rank_order),
        )
    names = tuple(name for name, _ in dims.mesh_dims)
    shape = tuple(size for _, size in dims.mesh_dims)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    _FLATTENED[mesh] = {
        "dp": flatten_mesh(mesh[_in_mesh_order(names, ("dp_replicate", "dp_shard"))], "dp"),
        "dp_shard_cp": flatten_mesh(mesh[_in_mesh_order(names, ("dp_shard", "cp"))], "dp_shard_cp"),
    }
    # the mesh's groups were made with the backend's default timeout (NCCL: 600 s)
    match_default_timeout()
    return mesh


def _in_mesh_order(names: tuple[str, ...], wanted: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(name for name in names if name in wanted)


def submesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The 1-D mesh of a named or flattened dimension."""
    flat = _FLATTENED.get(mesh, {})
    return flat[name] if name in flat else mesh[name]


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """HSDP: 2-D (replicate, shard); otherwise 1-D over the shard (and context-parallel) ranks."""
    if dims.dp_replicate > 1:
        # Only with CP does the shard dim need the flattened (dp_shard, cp) dim of the root mesh.
        return mesh["dp_replicate", "dp_shard_cp"] if dims.cp > 1 else mesh["dp_replicate", "dp_shard"]
    return submesh(mesh, "dp_shard_cp")
