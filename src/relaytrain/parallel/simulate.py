"""One training step of a real layout at its real world size, on one CPU, with fake tensors.

For a representative rank of each role (first and last pipeline stage, a member of another HSDP
replica group), a fresh process joins PyTorch's fake process group as that rank of the full world,
builds the model through the trainer's own path (`parallel_model.shard_on_meta`: mesh in
`parallel.rank_order`, pipeline split, TP + SP, AC, FSDP2 / HSDP, CPU offload), then, under
FakeTensorMode, allocates it (`allocate`, as `materialize` does) and runs one step as the trainer does:
the micro batches of the local batch that reach the step's peak (`simulation_config`; through the
pipeline schedule when there is one, its stages' boundary shapes declared:
relaytrain.parallel.sim_pipeline.DeclaredStagesModel), backward,
gradient clipping, the AdamW step. Fake tensors have shapes and no data: nothing is computed and
nothing allocated, and the trackers record what a GPU would hold (sim_memory) and what it would send
(sim_comm).

The device is the CPU: parameters are cast to bf16 as `param_dtype = "auto"` does on CUDA, but the
attention kernel is the CPU one that SDPA picks (reported per rank).
"""

from __future__ import annotations

import dataclasses
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from relaytrain.config import Config
from relaytrain.entry_points import SIMULATE
from relaytrain.parallel.dims import ParallelDims


class SimulationError(Exception):
    """The simulation could not run this layout (an op fake tensors do not support, ...)."""


@dataclasses.dataclass
class RankSimulation:
    rank: int
    role: str
    coordinates: dict[str, int]
    peak_bytes: int
    categories: dict[str, int]  # bytes per category at the peak
    peak_at: str  # the moment of the peak: phase, micro batch, module
    collectives: list[dict]  # sim_comm.Collective.as_dict()
    attention_kernels: list[str]
    seconds: float
    host_peak_bytes: int  # the simulating process's own peak resident memory


def rank_with(dims: ParallelDims, **coords: int) -> int:
    """The lowest global rank with the given mesh coordinates (the others 0)."""
    stride, rank = 1, 0
    for name, size in reversed(dims.mesh_dims):
        rank += coords.get(name, 0) * stride
        stride *= size
    return rank


def representative_ranks(dims: ParallelDims) -> list[tuple[int, str]]:
    """(rank, role): the first pipeline stage, the last one, a member of a second HSDP replica group."""
    out = [(0, "first pipeline stage" if dims.pp > 1 else "every rank alike")]
    if dims.pp > 1:
        out.append((rank_with(dims, pp=dims.pp - 1), "last pipeline stage"))
    if dims.dp_replicate > 1:
        out.append((rank_with(dims, dp_replicate=1), "second replica group"))
    return out


SIMULATED_ACCUMULATION = 2


def steady_state_microbatches(parallel, dims: ParallelDims) -> int:
    """The fewest pipeline microbatches at which the schedule reaches the peak of its steady state.

    1F1B: the first stage runs pp forwards before its first backward; a backward with pp - 1 others
    in flight *and* the gradients of an earlier one already there comes first at pp + 1 microbatches.
    Interleaved (v virtual stages): the warm-up fills v - 1 rounds of pp microbatches, and every local
    stage has run a backward before its next one by v pp (2 pp with 2 virtual stages; counts must be
    multiples of pp). GPipe keeps every microbatch in flight: all of them. Each further microbatch
    repeats the steady state (checked with pp 2 on a small model: tests/test_simulate.py), except for
    the per-microbatch receive buffers, which the simulation adds (`_unrun_receive_buffers`)."""
    n = dims.grad_accum
    if parallel.pp_schedule == "1f1b":
        return min(n, dims.pp + 1)
    if parallel.pp_schedule == "interleaved_1f1b":
        return min(n, max(2, parallel.pp_virtual_stages) * dims.pp)
    return n


def simulation_config(cfg: Config, dims: ParallelDims) -> Config:
    """The config a GPU would run: bf16 compute under param_dtype 'auto', fused AdamW under
    optim.implementation 'auto', no torch.compile (whose
    kernels do not change what the step holds, and which would compile fake graphs for minutes).

    Without a pipeline, at most two accumulation steps: the first micro batch starts with no gradients,
    the second with the sharded gradients every later one also finds, so the peak is reached by the
    second; each one more costs a full fake forward and backward (half a minute for 8B on 2 cores).
    A pipeline runs the microbatches its schedule needs to reach its steady state
    (`steady_state_microbatches`), of the same size."""
    parallel = cfg.parallel
    changes = {"compile": False}
    if parallel.param_dtype == "auto":
        changes["param_dtype"] = "bfloat16"
    optim = cfg.optim
    if optim.implementation == "auto":  # what "auto" picks on CUDA: no foreach temporaries in the step
        optim = dataclasses.replace(optim, implementation="fused")
    train = cfg.train
    if dims.pp == 1 and dims.grad_accum > SIMULATED_ACCUMULATION:
        batch = dims.dp * dims.micro_batch_size * SIMULATED_ACCUMULATION
        train = dataclasses.replace(train, global_batch_size=batch)
    steady = steady_state_microbatches(parallel, dims) if dims.pp > 1 else dims.grad_accum
    if steady < dims.grad_accum:
        changes["pp_microbatches"] = steady
        train = dataclasses.replace(train, global_batch_size=dims.dp * dims.micro_batch_size * steady)
    parallel = dataclasses.replace(parallel, **changes)
    return dataclasses.replace(cfg, parallel=parallel, optim=optim, train=train)


def simulated_micro_batches(parallel, dims: ParallelDims) -> int:
    """Micro batches the simulated step runs of the `dims.grad_accum` the real one does."""
    if dims.pp > 1:
        return steady_state_microbatches(parallel, dims)
    return min(dims.grad_accum, SIMULATED_ACCUMULATION)


def simulate_rank(
    cfg: Config,
    world_size: int,
    rank: int,
    gpus_per_node: int,
    role: str = "",
    unrun_microbatches: int = 0,
    step_micro_batches: int = 0,
) -> RankSimulation:
    """Simulate `rank` of `world_size` in this process (which it leaves with the fake group joined).

    `unrun_microbatches`: pipeline microbatches of the real step that `cfg` leaves out; their receive
    buffers, which the schedule allocates once per microbatch and keeps, are allocated all the same.
    `step_micro_batches`: the real step's micro batches, to which the collectives are scaled (0: the
    simulated ones)."""
    import torch
    import torch.distributed as dist

    from relaytrain.optim import build_optimizer
    from relaytrain.parallel.parallel_model import allocate, shard_on_meta
    from relaytrain.parallel.sim_comm import CollectiveCounter, collectives
    from relaytrain.parallel.sim_memory import (
        FSDPStepTracker,
        PlainStepTracker,
        ignore_sharding_propagation,
        peak_by_category,
    )
    from relaytrain.parallel.sim_pipeline import DeclaredStagesModel
    from relaytrain.torch_private import fake_store, fake_tensor_mode

    start = time.monotonic()
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    device = torch.device("cpu")
    # The mesh's coordinate code needs real tensors: layout, mesh and sharding on meta, outside fake mode.
    sharded = shard_on_meta(cfg.parallel, cfg.model, cfg.train, device, world_size, rank, gpus_per_node)
    dims = sharded.dims
    with fake_tensor_mode(allow_non_fake_inputs=True), ignore_sharding_propagation():
        allocate(sharded, cfg.parallel, cfg.train, device, seed=cfg.run.seed)
        model = DeclaredStagesModel(sharded, cfg.parallel, cfg.train.seq_len, device)
        optimizer = build_optimizer(cfg.optim, model.model_parts, device)
        shape = (dims.local_batch_size, cfg.train.seq_len)
        inputs = torch.randint(0, cfg.model.vocab_size, shape)
        targets = torch.randint(0, cfg.model.vocab_size, shape)
        _allocate_optimizer_state(optimizer)
        tracked = model.mesh is not None
        tracker_cls = FSDPStepTracker if tracked else PlainStepTracker
        tracker = tracker_cls(model.model_parts, optimizer)
        counter = CollectiveCounter()
        with tracker, counter:
            unrun = _unrun_receive_buffers(model, unrun_microbatches)  # noqa: F841 - held through the step
            model.train_step(inputs, targets)
            counter.after_micro_batches = True
            model.clip_grad_norm_(cfg.train.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    scale = (step_micro_batches or dims.grad_accum) / max(dims.grad_accum, 1)
    peak, categories = peak_by_category(tracker)
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return RankSimulation(
        rank=rank,
        role=role,
        coordinates=dims.coordinates(rank),
        peak_bytes=peak,
        categories=categories,
        peak_at=tracker.peak_at,
        collectives=[
            c.as_dict() for c in collectives(counter, model.mesh, gpus_per_node, scale, dims.pp > 1)
        ],
        attention_kernels=sorted(counter.attention_ops),
        seconds=time.monotonic() - start,
        host_peak_bytes=host,
    )


def _unrun_receive_buffers(model, microbatches: int) -> list:
    """What the schedule's stages allocate per microbatch and keep for the step: a buffer for each
    received activation (every stage but the first) and gradient (every stage but the last)."""
    import torch

    from relaytrain.torch_private import schedule_stages, stage_declared_meta

    if model.schedule is None:
        return []
    buffers = []
    for stage in schedule_stages(model.schedule):
        inputs, outputs = stage_declared_meta(stage)
        metas = ([] if stage.is_first else inputs) + ([] if stage.is_last else outputs)
        for meta in metas:
            buffers += [torch.empty(meta.shape, dtype=meta.dtype) for _ in range(microbatches)]
    return buffers


def _allocate_optimizer_state(optimizer) -> None:
    """AdamW creates its moments at its first step; every later step starts with them: a step with
    zero gradients and no learning rate creates them (on fake tensors) before the tracked step."""
    import torch

    params = [p for group in optimizer.param_groups for p in group["params"]]
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr


def _simulate_in_child(
    cfg: Config, world_size: int, rank: int, gpus_per_node: int, role: str, unrun: int = 0, step: int = 0
) -> dict | str:
    """Runs in a fresh process (the fake process group is one per process); errors come back as text."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("torch").setLevel(logging.ERROR)
    try:
        return dataclasses.asdict(simulate_rank(cfg, world_size, rank, gpus_per_node, role, unrun, step))
    except Exception as exc:  # noqa: BLE001 - any failure of the fake step is reported, not raised
        return f"{type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else repr(exc)


def simulate(
    cfg: Config,
    dims: ParallelDims,
    gpus_per_node: int,
    progress: Callable[[str], None] = lambda line: None,
) -> list[RankSimulation]:
    """Simulate every representative rank of the layout `dims` (one process each, one at a time).

    Raises SimulationError with the op or reason when the fake step cannot run.
    """
    import torch

    from relaytrain.torch_private import simulation_gaps

    gaps = simulation_gaps()
    if gaps:
        raise SimulationError(
            f"this torch ({torch.__version__}) lacks private names the simulation uses "
            f"({', '.join(gaps)}); it was checked on torch 2.12-2.15: install one of those to simulate, "
            "or run `relaytrain plan` without --simulate"
        )
    results = []
    # A pipeline's left-out micro batches still get their receive buffers (the rest need nothing).
    unrun = dims.grad_accum - simulated_micro_batches(cfg.parallel, dims) if dims.pp > 1 else 0
    for rank, role in representative_ranks(dims):
        coords = ", ".join(f"{k} {v}" for k, v in dims.coordinates(rank).items())
        progress(f"simulating rank {rank} of {dims.world_size} ({role}; {coords})")
        sim_cfg = simulation_config(cfg, dims)
        out = _run_child((sim_cfg, dims.world_size, rank, gpus_per_node, role, unrun, dims.grad_accum))
        if isinstance(out, str):
            raise SimulationError(f"rank {rank}: {out}")
        progress(f"rank {rank}: peak {out.peak_bytes / 1024**3:.2f} GiB ({out.peak_at}), {out.seconds:.0f} s")
        results.append(out)
    return results


def _run_child(arguments: tuple) -> RankSimulation | str:
    """`python -m relaytrain.parallel.simulate RESULT` with the pickled arguments on stdin."""
    with tempfile.TemporaryDirectory(prefix="relaytrain-sim-") as tmp:
        result = Path(tmp) / "result.pickle"
        proc = subprocess.run(
            [sys.executable, "-m", SIMULATE, str(result)],
            input=pickle.dumps(arguments),
            capture_output=True,
            check=False,
        )
        if proc.returncode != 0 or not result.is_file():
            tail = proc.stderr.decode(errors="replace").strip().splitlines()
            return f"the simulating process exited {proc.returncode}: {tail[-1] if tail else 'no output'}"
        # Our own child wrote it a moment ago, in our own temporary directory.
        out = pickle.loads(result.read_bytes())  # noqa: S301
        return out if isinstance(out, str) else RankSimulation(**out)


if __name__ == "__main__":
    out = _simulate_in_child(*pickle.loads(sys.stdin.buffer.read()))  # noqa: S301 - from our parent
    Path(sys.argv[1]).write_bytes(pickle.dumps(out))
