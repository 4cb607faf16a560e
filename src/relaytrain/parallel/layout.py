"""Parallel layout: degrees, rank order and the checks that need no process group.

`validate_layout` is called by `relaytrain plan` and by `parallelize` before any process group or mesh
exists, so a layout that cannot work (a tensor-parallel group crossing a node boundary, heads that do not
split, a batch that does not divide) is refused with a message that names the fix. It runs three steps:
`resolve_dims` (the degrees), `check_layout` (refuses, derives nothing) and `split_batch` (the batch
split, once the checks passed).

Rank order: `parallel.rank_order` lists the dimensions innermost first. The innermost dimension gets
adjacent ranks; torchrun and Slurm number ranks node by node, so adjacent ranks share a node. Data
parallelism ("dp") expands to dp_replicate (outer, typically across nodes) and dp_shard (inner).

Batch split: the global batch is fixed; each data-parallel rank takes global / dp sequences and runs them
as `grad_accum` micro batches of `micro_batch_size`. When train.micro_batch_size does not divide the local
batch, the largest micro batch below it that does is used (`batch_split_note` says so), so one config runs
on any data-parallel degree that divides the global batch. The trainer, the step and `relaytrain plan`
read the split from the returned `ParallelDims`, never from the config; the trainer hands the data loader
its data-parallel rank, `dp` and `local_batch_size` (data/ sits below parallel/ and cannot import it).
"""

from __future__ import annotations

import dataclasses
import math

from relaytrain.config.schema import ModelConfig, ParallelConfig, TrainConfig
from relaytrain.errors import UserError
from relaytrain.model.flops import ffn_hidden_dim
from relaytrain.parallel.dims import ParallelDims

RANK_ORDER_NAMES = ("tp", "cp", "pp", "dp")
DEFAULT_RANK_ORDER = "tp,cp,pp,dp"


def parse_rank_order(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if sorted(names) != sorted(RANK_ORDER_NAMES):
        raise UserError(
            f"parallel.rank_order={text!r} must list each of tp, cp, pp, dp once, innermost "
            f"first (default {DEFAULT_RANK_ORDER!r} keeps tensor-parallel ranks on one node)"
        )
    return names


def resolve_dims(pcfg: ParallelConfig, world_size: int) -> ParallelDims:
    """Degrees with dp_shard=-1 filled in; checks only that they multiply to the world size."""
    order = parse_rank_order(pcfg.rank_order)
    for key in ("dp_replicate", "tp", "pp", "cp"):
        if getattr(pcfg, key) < 1:
            raise UserError(f"parallel.{key} must be >= 1, got {getattr(pcfg, key)}")
    others = pcfg.dp_replicate * pcfg.tp * pcfg.pp * pcfg.cp
    fixed = f"dp_replicate={pcfg.dp_replicate} x tp={pcfg.tp} x pp={pcfg.pp} x cp={pcfg.cp} = {others}"
    if pcfg.dp_shard == -1:
        if world_size % others != 0:
            raise UserError(
                f"world size {world_size} is not divisible by {fixed}; choose degrees whose "
                f"product divides {world_size}, or run with a multiple of {others} processes"
            )
        dp_shard = world_size // others
    elif pcfg.dp_shard >= 1:
        dp_shard = pcfg.dp_shard
        if dp_shard * others != world_size:
            raise UserError(
                f"parallel degrees {fixed} x dp_shard={dp_shard} = {dp_shard * others} but the "
                f"world size is {world_size}; set parallel.dp_shard=-1 to fill the remaining "
                f"ranks, or launch {dp_shard * others} processes"
            )
    else:
        raise UserError(f"parallel.dp_shard must be -1 or >= 1, got {pcfg.dp_shard}")
    return ParallelDims(
        dp_replicate=pcfg.dp_replicate,
        dp_shard=dp_shard,
        cp=pcfg.cp,
        tp=pcfg.tp,
        pp=pcfg.pp,
        world_size=world_size,
        rank_order=order,
    )


def pp_microbatches(parallel: ParallelConfig, train: TrainConfig, dp: int) -> int:
    """Pipeline micro batches per step: parallel.pp_microbatches, or with 0 as many as make micro batches
    of train.micro_batch_size sequences (the largest size up to it that splits the local batch into at
    least pp micro batches, a multiple of pp for the interleaved schedule); pp when none does (the
    layout check then names the batch that would)."""
    if parallel.pp_microbatches or parallel.pp == 1:
        return parallel.pp_microbatches or parallel.pp
    local = train.global_batch_size // max(dp, 1)
    step = parallel.pp if parallel.pp_schedule == "interleaved_1f1b" else 1
    fits = [
        d
        for d in _divisors(local)
        if d <= train.micro_batch_size and local // d >= parallel.pp and (local // d) % step == 0
    ]
    return local // max(fits) if fits else parallel.pp


def batch_split_note(train: TrainConfig, dims: ParallelDims) -> str | None:
    """The one info line for a micro batch that differs from train.micro_batch_size; None if it does not."""
    if dims.pp > 1 or dims.micro_batch_size == train.micro_batch_size:
        return None
    local = train.global_batch_size // dims.dp
    return (
        f"train.micro_batch_size={train.micro_batch_size} does not divide the {local} sequences per "
        f"data-parallel rank (global batch {train.global_batch_size} / dp {dims.dp}); using micro batch "
        f"{dims.micro_batch_size} with {dims.grad_accum} accumulation steps"
    )


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _propose_tp(model: ModelConfig, dims: ParallelDims, gpus_per_node: int) -> str:
    """A layout with the same world size whose tensor-parallel groups fit in one node."""
    m = model
    rest = dims.cp * dims.pp * dims.dp_replicate
    fits = [
        d
        for d in _divisors(math.gcd(gpus_per_node, m.n_heads, m.n_kv_heads))
        if gpus_per_node % (d * dims.cp) == 0 and dims.world_size % (d * rest) == 0
    ]
    tp = max(fits) if fits else 1
    return (
        f"parallel.tp={tp}, parallel.dp_shard=-1 (= {dims.world_size // (tp * rest)}), "
        f"parallel.rank_order={DEFAULT_RANK_ORDER!r}"
    )


def _check_inside_node(model: ModelConfig, dims: ParallelDims, dim: str, gpus_per_node: int) -> None:
    size = getattr(dims, dim)
    if size == 1 or dims.world_size <= gpus_per_node:
        return
    label = {"tp": "tensor-parallel", "cp": "context-parallel"}[dim]
    # The groups repeat every block of ranks that holds whole groups (`dim` and the dims inside it), and
    # nodes every gpus_per_node: the first crossing, if any, lies within their least common multiple.
    names = [name for name, _ in dims.mesh_dims]
    block = math.prod(n for _, n in dims.mesh_dims[names.index(dim) :])
    for start in range(min(dims.world_size, math.lcm(block, gpus_per_node))):
        group = dims.group_of(start, dim)
        if group[0] != start:
            continue
        nodes = sorted({r // gpus_per_node for r in group})
        if len(nodes) == 1:
            continue
        a, b = nodes[0], nodes[1]
        crossing = next(r for r in group if r // gpus_per_node == b)
        where = (
            f"the {label} group of ranks {group} spans nodes {nodes}: it crosses the boundary between "
            f"node {a} (ranks {a * gpus_per_node}-{(a + 1) * gpus_per_node - 1}) and node {b} (rank "
            f"{crossing} onward), with {gpus_per_node} GPUs per node"
        )
        if size > gpus_per_node:
            why = f"parallel.{dim}={size} is larger than the {gpus_per_node} GPUs of one node"
        elif gpus_per_node % size != 0 and dims.rank_order[0] == dim:
            why = f"parallel.{dim}={size} does not divide the {gpus_per_node} GPUs per node"
        else:
            why = (
                f"parallel.rank_order={','.join(dims.rank_order)!r} spreads {dim} ranks "
                f"{group[1] - group[0]} apart"
            )
        fix = (
            _propose_tp(model, dims, gpus_per_node)
            if dim == "tp"
            else f"parallel.rank_order={DEFAULT_RANK_ORDER!r} with tp*cp dividing {gpus_per_node}"
        )
        raise UserError(
            f"{why}: {where}. {label.capitalize()} traffic must stay inside a node; use e.g. {fix}"
        )


def _check_mesh_nesting(dims: ParallelDims) -> None:
    """FSDP2 composes with TP only when the TP dim is inside the data-parallel (and CP) dims of the mesh."""
    pos = {name: i for i, name in enumerate(dims.rank_order)}
    order = ",".join(dims.rank_order)
    if dims.tp > 1 and (pos["tp"] > pos["dp"] or pos["tp"] > pos["cp"]):
        raise UserError(
            f"parallel.rank_order={order!r} puts tp outside dp or cp; FSDP shards tensor-parallel weights "
            f"only when tp is the inner dimension: list tp before dp and cp (e.g. {DEFAULT_RANK_ORDER!r})"
        )
    if dims.dp_replicate > 1 and dims.cp > 1 and pos["cp"] > pos["dp"]:
        raise UserError(
            f"parallel.rank_order={order!r} puts cp outside dp; HSDP shards over dp_shard x cp inside each "
            f"replica, so list cp before dp (e.g. {DEFAULT_RANK_ORDER!r})"
        )


def validate_layout(
    parallel: ParallelConfig,
    model: ModelConfig,
    train: TrainConfig,
    world_size: int,
    gpus_per_node: int,
    device_type: str = "cuda",
) -> ParallelDims:
    """Check the parallel layout for `world_size` ranks, `gpus_per_node` per node, before any process group.

    The layout of `parallel` must fit the `model` (heads, layers, vocabulary) and the `train` batch.

    Ranks are numbered node by node (ranks 0..gpus_per_node-1 on node 0, ...). Raises UserError with the
    change to make; returns the resolved degrees with the batch split.
    """
    if world_size < 1 or gpus_per_node < 1:
        raise UserError(f"world size ({world_size}) and GPUs per node ({gpus_per_node}) must be >= 1")
    if world_size > gpus_per_node and world_size % gpus_per_node != 0:
        raise UserError(
            f"world size {world_size} is not a whole number of nodes of {gpus_per_node} GPUs; "
            f"launch the same number of processes on every node"
        )
    dims = resolve_dims(parallel, world_size)
    check_layout(parallel, model, train, dims, gpus_per_node, device_type)
    return split_batch(parallel, train, dims)


def check_layout(
    parallel: ParallelConfig,
    model: ModelConfig,
    train: TrainConfig,
    dims: ParallelDims,
    gpus_per_node: int,
    device_type: str,
) -> None:
    """Refuse resolved degrees that cannot run this model and batch on nodes of `gpus_per_node`
    (UserError naming the change to make); changes nothing."""
    p, m, t = parallel, model, train
    _check_mesh_nesting(dims)
    _check_inside_node(model, dims, "tp", gpus_per_node)
    _check_inside_node(model, dims, "cp", gpus_per_node)

    def require(ok: bool, message: str) -> None:
        if not ok:
            raise UserError(message)

    if dims.tp > 1:
        ok_tp = [d for d in _divisors(math.gcd(m.n_heads, m.n_kv_heads)) if d <= gpus_per_node]
        require(
            m.n_heads % dims.tp == 0 and m.n_kv_heads % dims.tp == 0,
            f"parallel.tp={dims.tp} must divide model.n_heads={m.n_heads} and model.n_kv_heads="
            f"{m.n_kv_heads} (each rank holds whole heads); use tp in {ok_tp}",
        )
        require(
            m.vocab_size % dims.tp == 0,
            f"model.vocab_size={m.vocab_size} must be divisible by parallel.tp={dims.tp} (the embedding "
            f"and output are split along the vocabulary); round it up to "
            f"{math.ceil(m.vocab_size / dims.tp) * dims.tp}",
        )
        hidden = ffn_hidden_dim(m)
        require(
            hidden % dims.tp == 0,
            f"the feed-forward width {hidden} must be divisible by parallel.tp={dims.tp}; set "
            f"model.ffn_dim or model.multiple_of to a multiple of {dims.tp}",
        )
        require(
            t.seq_len % dims.tp == 0,
            f"train.seq_len={t.seq_len} must be divisible by parallel.tp={dims.tp} (sequence parallelism "
            f"splits the sequence); use seq_len={math.ceil(t.seq_len / dims.tp) * dims.tp}",
        )
        require(
            not m.tie_embeddings,
            "model.tie_embeddings=true cannot be combined with parallel.tp>1 (the embedding and output "
            "are split differently); set model.tie_embeddings=false or parallel.tp=1",
        )
    if dims.cp > 1:
        require(
            device_type == "cuda",
            f"parallel.cp={dims.cp} needs CUDA: PyTorch's context parallel has no attention sharding "
            f"strategy for {device_type} (only the CUDA flash/efficient/cuDNN kernels); set parallel.cp=1",
        )
        require(
            t.seq_len % (2 * dims.cp) == 0,
            f"train.seq_len={t.seq_len} must be divisible by 2*parallel.cp={2 * dims.cp} (load-balanced "
            f"context parallel splits the sequence into 2*cp chunks)",
        )
    v = p.pp_virtual_stages
    if dims.pp > 1:
        stages = dims.pp * v
        require(
            m.n_layers >= stages,
            f"model.n_layers={m.n_layers} is fewer than parallel.pp={dims.pp} x pp_virtual_stages={v} = "
            f"{stages} pipeline stages; lower parallel.pp or pp_virtual_stages",
        )
        require(
            not m.tie_embeddings,
            "model.tie_embeddings=true cannot be combined with parallel.pp>1 (embedding and output live "
            "on different stages); set model.tie_embeddings=false or parallel.pp=1",
        )
        if p.pp_schedule == "interleaved_1f1b":
            require(
                v >= 2,
                f"parallel.pp_schedule='interleaved_1f1b' needs parallel.pp_virtual_stages >= 2 "
                f"(got {v}); or use pp_schedule='1f1b'",
            )
        else:
            require(
                v == 1,
                f"parallel.pp_schedule={p.pp_schedule!r} runs one stage per rank; set "
                f"parallel.pp_virtual_stages=1 or pp_schedule='interleaved_1f1b'",
            )
        n_mb = pp_microbatches(parallel, train, dims.dp)
        require(
            n_mb >= dims.pp,
            f"parallel.pp_microbatches={n_mb} must be >= parallel.pp={dims.pp} "
            f"(fewer microbatches than stages leaves stages idle)",
        )
        if p.pp_schedule == "interleaved_1f1b":
            require(
                n_mb % dims.pp == 0,
                f"parallel.pp_microbatches={n_mb} must be a multiple of "
                f"parallel.pp={dims.pp} for pp_schedule='interleaved_1f1b'",
            )
    else:
        require(
            v == 1,
            f"parallel.pp_virtual_stages={v} needs parallel.pp > 1 (pipeline parallelism); "
            f"set pp_virtual_stages=1",
        )
        require(
            p.pp_microbatches == 0,
            f"parallel.pp_microbatches={p.pp_microbatches} needs parallel.pp > 1; without a pipeline "
            f"the micro batch is train.micro_batch_size, so leave pp_microbatches=0",
        )
    gbs, dp = t.global_batch_size, dims.dp
    require(
        gbs % dp == 0,
        f"train.global_batch_size={gbs} must be divisible by the data-parallel degree {dp} (each "
        f"data-parallel rank takes an equal share); use global_batch_size={max(1, gbs // dp) * dp} or "
        f"{(gbs // dp + 1) * dp}",
    )
    if dims.pp > 1:
        n_mb = pp_microbatches(parallel, train, dp)
        require(
            (gbs // dp) % n_mb == 0,
            f"train.global_batch_size={gbs} must be divisible by data-parallel degree {dp} x "
            f"parallel.pp_microbatches={n_mb} = {dp * n_mb}; use global_batch_size="
            f"{max(1, gbs // (dp * n_mb)) * dp * n_mb}",
        )
    if p.cpu_offload:
        require(
            dims.world_size > 1,
            "parallel.cpu_offload needs FSDP, which runs with more than one process; launch with "
            "torchrun (or drop cpu_offload for a single process)",
        )


def split_batch(parallel: ParallelConfig, train: TrainConfig, dims: ParallelDims) -> ParallelDims:
    """`dims` with the batch split filled in; the degrees must have passed `check_layout`."""
    local = train.global_batch_size // dims.dp
    if dims.pp > 1:
        n_mb = pp_microbatches(parallel, train, dims.dp)
        micro, accum = local // n_mb, n_mb
    else:
        micro = max(d for d in _divisors(local) if d <= max(1, train.micro_batch_size))
        accum = local // micro
    return dataclasses.replace(dims, micro_batch_size=micro, grad_accum=accum)
