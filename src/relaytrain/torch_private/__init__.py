"""Every private torch name relaytrain uses, behind one function each.

pyproject.toml admits torch >=2.12.0a0,<2.16; a private name may move or change between those minors
without notice. So each use is here, once, with the torch versions it was checked on, and
tests/test_torch_private.py calls every entry on the installed torch: an upgrade that breaks one fails
that test by name instead of a training run or `plan --simulate` somewhere later. Checked on: torch
2.12.0, 2.13.0, 2.14.1 and 2.15.0 (tests/test_torch_private.py on each; 2.9, below the range, lacks
the two names `simulation_gaps` reports, and `plan --simulate` says so); an entry's own "Checked"
names where it was written. Nothing else in src/ imports a private torch module (tests/test_torch_private.py).

The simulation's memory trackers (relaytrain.parallel.sim_memory) subclass torch's private trackers and
override their private hooks; the names they override and read are listed in TRACKER_HOOKS and checked.
torchrun's agent is patched in `agent.py` here (job/torchrun.py), and the compiler's hooks the progress
board is told from are in `compiler.py` (job/clock.py), under the same rules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

# -- the production build and run ---------------------------------------------------------------------


def flatten_mesh(mesh, name: str):
    """`DeviceMesh._flatten`: one mesh dimension of several (dp of dp_replicate x dp_shard). Checked: 2.13."""
    return mesh._flatten(name)


def saved_attention_ops() -> set:
    """The SDPA kernels' private aten ops (the outputs selective activation checkpointing keeps);
    cuDNN's where this build has it. Checked: 2.13."""
    aten = torch.ops.aten
    ops = {
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
    if hasattr(aten, "_scaled_dot_product_cudnn_attention"):
        ops.add(aten._scaled_dot_product_cudnn_attention.default)
    return ops


def functional_reduce_scatter_op():
    """`torch.ops._c10d_functional.reduce_scatter_tensor`: sequence parallelism's reduce-scatter as an
    op. Checked: 2.13."""
    return torch.ops._c10d_functional.reduce_scatter_tensor.default


def group_timeout(group=None) -> timedelta | None:
    """The collective timeout of `group` (default: the default group); None for a backend that has none
    (the fake process group). Reads `_get_default_group`, `_get_backend`, `_device_types` and the
    backend options' `_timeout`. Checked: 2.13."""
    from torch.distributed import distributed_c10d as c10d

    group = group or c10d._get_default_group()
    options = getattr(group._get_backend(group._device_types[0]), "options", None)
    return getattr(options, "_timeout", None)


def process_groups() -> list:
    """Every process group this rank is in (`distributed_c10d._world.pg_map`). Checked: 2.13."""
    from torch.distributed import distributed_c10d as c10d

    return list(c10d._world.pg_map)


def set_group_timeout(group, timeout: timedelta) -> None:
    """A made group's collective timeout: the public `torch.distributed.set_timeout` where torch has it
    (2.15), else `distributed_c10d._set_pg_timeout` (2.9-2.14; 2.15 deprecates it). Checked: 2.9, 2.13,
    2.14, 2.15."""
    if hasattr(dist, "set_timeout"):
        dist.set_timeout(timeout, group)
        return
    from torch.distributed import distributed_c10d as c10d

    c10d._set_pg_timeout(timeout, group)


def resolve_process_group(group):
    """`distributed_c10d._resolve_process_group`: a group from the name a functional collective carries.
    Checked: 2.13."""
    return dist.distributed_c10d._resolve_process_group(group)


def object_collective_device() -> str:
    """`distributed_c10d._get_object_coll_device`: the device type object collectives run on.
    Checked: 2.13."""
    return dist.distributed_c10d._get_object_coll_device()


def compile_cache_counts() -> dict[str, int]:
    """`torch._dynamo.utils.counters`: this process's graphs by Inductor's FX graph cache, ``cold`` (compiled
    from scratch: a miss, or a bypass of a graph the cache cannot hold) and ``cached`` (a hit).
    Checked: 2.14.1."""
    from torch._dynamo.utils import counters  # noqa: PLC0415 - loaded on first use

    inductor = counters["inductor"]
    cold = inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"]
    return {"cold": int(cold), "cached": int(inductor["fxgraph_cache_hit"])}


def published_fsdp_comms(collective) -> tuple:
    """FSDP2's default all-gather and reduce-scatter (`_fully_shard._fsdp_collectives.DefaultAllGather`,
    `DefaultReduceScatter`) with each call inside `collective(name)` (a context manager: the progress
    board's), named `fsdp_all_gather` and `fsdp_reduce_scatter`; for the public
    `FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`. Subclasses of the defaults, so the
    collectives are the same calls and FSDP's checks for its default comms still pass. Checked: 2.14.1."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as comms

    class AllGather(comms.DefaultAllGather):
        def __call__(self, *args, **kwargs):
            with collective("fsdp_all_gather"):
                return super().__call__(*args, **kwargs)

    class ReduceScatter(comms.DefaultReduceScatter):
        def __call__(self, *args, **kwargs):
            with collective("fsdp_reduce_scatter"):
                return super().__call__(*args, **kwargs)

    return AllGather(), ReduceScatter()


_redistributions: list = []  # the collective context they are published in: the latest board's


def publish_dtensor_redistributions(collective) -> None:
    """Each DTensor redistribution (tensor parallelism's collectives) in `collective("dtensor_redistribute")`,
    waited for there (the parallel styles' async ones wait at the tensor's first use; at once, the values
    are the same). Replaced where torch imports it (`_redistribute`, `_dispatch`, `_api`) once per process;
    a later call only changes `collective`. One that keeps the layout (no communication) is not published.
    Checked: 2.14.1."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import _api, _dispatch, _redistribute

    _redistributions[:] = [collective]
    original = _redistribute.redistribute_local_tensor
    if getattr(original, "published", False):
        return

    def published(*args, **kwargs):
        current = args[1] if len(args) > 1 else kwargs["current_spec"]
        target = args[2] if len(args) > 2 else kwargs["target_spec"]
        if current.placements == target.placements and _shard_order(current) == _shard_order(target):
            return original(*args, **kwargs)  # the same layout: no communication, nothing that can hang
        with _redistributions[0]("dtensor_redistribute"):
            out = original(*args, **kwargs)
            return out.wait() if isinstance(out, AsyncCollectiveTensor) else out

    published.published = True  # type: ignore[attr-defined]
    for module in (_redistribute, _dispatch, _api):
        if getattr(module, "redistribute_local_tensor", None) is original:
            module.redistribute_local_tensor = published


def _shard_order(spec) -> object:
    """`DTensorSpec.shard_order` where the spec has one, else None. Checked: 2.14.1."""
    return getattr(spec, "shard_order", None)


def record_cuda_memory_history(enabled: bool, max_entries: int) -> None:
    """`torch.cuda.memory._record_memory_history` (CUDA only). Checked: 2.13 (signature, on CPU)."""
    torch.cuda.memory._record_memory_history(enabled="all" if enabled else None, max_entries=max_entries)


def dump_cuda_memory_snapshot(path: Path) -> None:
    """`torch.cuda.memory._dump_snapshot` (CUDA only). Checked: 2.13 (signature, on CPU)."""
    torch.cuda.memory._dump_snapshot(str(path))


def narrow_tensor_by_index(tensor: torch.Tensor, offsets, sizes) -> torch.Tensor:
    """`torch.distributed._shard._utils.narrow_tensor_by_index`: the view of `tensor` a checkpoint read
    item fills. Checked: 2.13."""
    from torch.distributed._shard._utils import narrow_tensor_by_index as narrow

    return narrow(tensor, offsets, sizes)


def set_state_element(root: dict, path, value) -> None:
    """`torch.distributed.checkpoint._traverse.set_element`: put `value` at `path` in a nested state dict.
    Checked: 2.13."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)


def split_write_items(buckets: int, items: list) -> list[list]:
    """`torch.distributed.checkpoint.filesystem._split_by_size_and_type`: a save's write items spread
    over `buckets` writer threads, tensors balanced by size. Checked: 2.13."""
    from torch.distributed.checkpoint.filesystem import _split_by_size_and_type

    return _split_by_size_and_type(buckets, items)


def storage_info(relative_path: str, offset: int, length: int, transform_descriptors=None):
    """`torch.distributed.checkpoint.filesystem._StorageInfo`: where one item lies in a checkpoint file,
    as DCP's metadata records it (so that DCP's own reader could read the file). Checked: 2.13."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length, transform_descriptors=transform_descriptors)


def optimizer_step_dtype(is_fused: bool | None = None) -> torch.dtype:
    """`torch.optim.optimizer._get_scalar_dtype`: the dtype of an Adam `step` tensor. Checked: 2.13."""
    from torch.optim.optimizer import _get_scalar_dtype

    return _get_scalar_dtype(is_fused=is_fused)


def stager_reusable(stager) -> bool:
    """Whether DCP's `DefaultStager` can stage again: torch 2.11 closes its `StateDictStager` at the end of
    every stage (`_deepcopy_dispatch` emptied, cached host buffers dropped), so a second async save with
    the same stager fails; 2.13 keeps it. Checked: 2.11 (closes), 2.13 (keeps)."""
    return bool(stager._state_dict_stager._deepcopy_dispatch)


# -- the simulation (relaytrain.parallel.simulate and sim_*) ------------------------------------------


def simulation_gaps() -> list[str]:
    """The private names below that the installed torch lacks, for a clear refusal of `plan --simulate`
    instead of an ImportError in its child process. Checked: 2.11 (both missing), 2.13 (none)."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    gaps = [] if hasattr(ShardingPropagator, "_fake_mode_lock") else ["ShardingPropagator._fake_mode_lock"]
    try:
        from torch.distributed.pipelining._utils import InferenceMode  # noqa: F401
    except ImportError:
        gaps.append("torch.distributed.pipelining._utils.InferenceMode")
    return gaps


def fake_tensor_mode(**kwargs):
    """`torch._subclasses.fake_tensor.FakeTensorMode`: tensors with shapes and no data. Checked: 2.13."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


def fake_store():
    """The store of PyTorch's fake process group (`torch.testing._internal.distributed.fake_pg`).
    Checked: 2.13."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def dispatch_mode_base() -> type:
    """`torch.utils._python_dispatch.TorchDispatchMode`, the base of a mode that sees every op.
    Checked: 2.13."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def tree_leaves(tree) -> list:
    """`torch.utils._pytree.tree_flatten`'s leaves (no public pytree module in 2.13). Checked: 2.13."""
    from torch.utils._pytree import tree_flatten

    return tree_flatten(tree)[0]


def local_shape_and_offset(shape, mesh_shape, coordinate: list[int], placements) -> tuple:
    """`torch.distributed.tensor._utils._compute_local_shape_and_global_offset`: the shard of a DTensor
    that the rank at `coordinate` holds. Checked: 2.13."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    return _compute_local_shape_and_global_offset(shape, mesh_shape, coordinate, placements)


def shard_overlap(saved, wanted) -> list | None:
    """The region of the saved chunk `saved` that a load of chunk `wanted` reads (DCP's resharding:
    `_check_shard_metadata_pair_overlap`, `_shards_get_overlap_region_wrt_saved_tensor`), as
    (dim, saved offset, wanted offset, length) per dimension; None when they do not overlap.
    Checked: 2.13."""
    from torch.distributed.checkpoint.resharding import (
        _check_shard_metadata_pair_overlap,
        _shards_get_overlap_region_wrt_saved_tensor,
    )

    if not _check_shard_metadata_pair_overlap(saved, wanted):
        return None
    return _shards_get_overlap_region_wrt_saved_tensor(saved, wanted)


def schedule_stages(schedule) -> list:
    """The PipelineStages of a schedule: `_stages` (multi-stage) or `_stage` (single). Checked: 2.13."""
    return getattr(schedule, "_stages", None) or [schedule._stage]


def stage_declared_meta(stage) -> tuple[list, list]:
    """The example inputs and outputs a PipelineStage was declared with (`_user_meta`). Checked: 2.13."""
    return list(stage._user_meta.inputs), list(stage._user_meta.outputs)


def stage_needs_inference(stage, schedule) -> bool:
    """Whether torch would infer `stage`'s boundary shapes on the first step (`InferenceMode.needs_dynamic`
    over `_user_meta` and the schedule's `_has_backward`). Checked: 2.13."""
    from torch.distributed.pipelining._utils import InferenceMode

    return InferenceMode.needs_dynamic(stage._user_meta, schedule._has_backward)


def validate_stage_at_runtime(stage) -> None:
    """Check every boundary tensor the step passes against the stage's declaration (`_runtime_validate`,
    what TORCH_DISTRIBUTED_DEBUG=DETAIL turns on). Checked: 2.13."""
    stage._runtime_validate = True


def skip_warmup_vote(schedule) -> None:
    """Replace the schedule's warm-up vote (`_warmup_p2p`, which multiplies the stages' static/dynamic
    votes along the pipeline and reads the product with `.item()`) by its known outcome: every stage
    static (`_inference_mode = InferenceMode.STATIC`). Checked: 2.13."""
    from torch.distributed.pipelining._utils import InferenceMode

    def settled(stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = settled


def mem_tracker_classes() -> tuple[type, type]:
    """(MemTracker, FSDPMemTracker) of `torch.distributed._tools`. Checked: 2.13."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker, FSDPMemTracker


def fsdp_ref_type():
    """`_FSDPRefType`: the categories FSDPMemTracker files tensors under. Checked: 2.13."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

    return _FSDPRefType


def fsdp_param_group(module):
    """An FSDP module's parameter group (`_get_fsdp_state()._fsdp_param_group`), None if it has no
    parameters of its own. Checked: 2.13."""
    return module._get_fsdp_state()._fsdp_param_group


def partial_reduce_output(group):
    """The reduce-scattered gradients HSDP holds back until the last micro batch
    (`FSDPParamGroup._partial_reduce_output`). Checked: 2.13."""
    return group._partial_reduce_output


@contextlib.contextmanager
def sharding_propagation_lock(wrap) -> Iterator[None]:
    """Swap DTensor's sharding-propagation lock (`ShardingPropagator._fake_mode_lock`) for `wrap(lock)`
    while inside, so that a tracker can tell propagation's fake tensors from the step's. Checked: 2.13."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    saved = ShardingPropagator._fake_mode_lock
    ShardingPropagator._fake_mode_lock = wrap(saved)
    try:
        yield
    finally:
        ShardingPropagator._fake_mode_lock = saved


# The private hooks relaytrain.parallel.sim_memory's trackers override or read, by the tracker class
# (mem_tracker_classes: 0 MemTracker, 1 FSDPMemTracker) that defines them; a hook torch renamed would
# silently stop being called, so the test checks each exists. Checked: 2.13.
TRACKER_HOOKS: dict[str, int] = {
    "_update_peak_stats": 0,
    "_pre_fw_hook": 0,
    "_fsdp_state_pre_forward": 1,
    "_fsdp_param_group_post_backward": 1,
    "_update_and_maybe_create_winfos": 1,
}
# Private attributes of a tracker instance sim_memory reads or sets (made by the tracker's __init__).
TRACKER_ATTRIBUTES: dict[str, int] = {"_curr_mem_snap": 0, "_in_opt": 0, "_mod_tracker": 0, "_root_mod": 1}
