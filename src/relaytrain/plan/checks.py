"""Will this config fit on N nodes x G GPUs before it waits in the queue: the plan and its checks.

Per-GPU memory: relaytrain.plan.gpu_memory; host memory: relaytrain.plan.host_memory. The host memory a
node has comes from the caller (relaytrain.slurm.partition_plans asks the partition).

Checkpoint: 12 P bytes (fp32 weights + two AdamW moments), written in parallel by all ranks at
`slurm.fs_write_gbps` GB/s in aggregate; the emergency save must finish within
`resilience.hard_deadline_s`, and Slurm's signal must come early enough for the step in flight to end and
the save to run (`resilience.signal_lead_s` >= one step + the hard deadline).

The step time in that check is an estimate (relaytrain.plan.step_time), also printed with the time to
train.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from relaytrain.config import Config
from relaytrain.config.domains import slurm_time_seconds
from relaytrain.errors import UserError
from relaytrain.model import count_parameters
from relaytrain.plan.gpu_memory import (
    GB,
    GIB,
    GPU_MEMORY_GB,
    MemoryEstimate,
    estimate_memory,
    gpu_memory_bytes,
)
from relaytrain.plan.host_memory import host_memory_check, stages_async_copies
from relaytrain.plan.snapshot_memory import snapshot_memory_check
from relaytrain.plan.step_time import DEFAULT_MFU, StepEstimate, estimate_rows, estimate_step

TIGHT_FRACTION = 0.90  # above this share of the GPU's memory the verdict is "tight"
SAVE_HEADROOM = 1.2  # a suggested hard deadline leaves 20% over the save estimate
EXIT_MARGIN_S = 60  # a suggested signal lead leaves this after the hard deadline for the processes to exit
MIN_JOB_STEPS = 10  # a job that trains fewer steps within its time limit warns
MIN_TRAIN_SHARE = 0.75  # as does one that trains for less than this share of its time limit


@dataclass
class Plan:
    nodes: int
    gpus_per_node: int
    gpu: str
    parameters: int
    tasks_per_node: int = 0  # processes per node on CPU-only nodes (gpus_per_node 0)
    mode: str = "none"  # parallel.activation_checkpointing, the mode `total` is checked for
    dims: object | None = None  # relaytrain.parallel.dims.ParallelDims
    memory: MemoryEstimate | None = None
    gpu_bytes: float = 0.0
    checkpoint_bytes: float = 0.0
    save_seconds: float = 0.0
    step: StepEstimate | None = None  # None on CPU-only nodes
    checks: list[tuple[str, str, str]] = field(default_factory=list)  # (name, ok|warn|fail, detail)

    @property
    def verdict(self) -> str:
        levels = [level for _, level, _ in self.checks]
        return "impossible" if "fail" in levels else "warn" if "warn" in levels else "ok"


def make_plan(
    cfg: Config,
    nodes: int,
    gpus_per_node: int,
    gpu: str = "",
    tasks_per_node: int = 0,
    host_memory: tuple[float, str] | None = None,
    mfu: float = DEFAULT_MFU,
) -> Plan:
    """Layout, memory and checkpoint checks; never raises for a bad plan (the verdict says it).

    `host_memory`: bytes per node and where the figure comes from (relaytrain.slurm.partition_plans), checked
    when the states are offloaded to host memory.
    """
    from relaytrain.parallel.layout import validate_layout

    per_node = gpus_per_node or tasks_per_node
    plan = Plan(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        gpu=gpu,
        parameters=count_parameters(cfg.model),
        tasks_per_node=tasks_per_node,
        mode=cfg.parallel.activation_checkpointing,
    )
    world = nodes * per_node
    try:
        device_type = "cuda" if gpus_per_node else "cpu"
        plan.dims = validate_layout(cfg.parallel, cfg.model, cfg.train, world, per_node, device_type)
        plan.checks.append(("layout", "ok", plan.dims.describe()))
    except UserError as exc:
        plan.checks.append(("layout", "fail", str(exc)))
        return plan
    plan.memory = estimate_memory(cfg, plan.dims)
    mode = cfg.parallel.activation_checkpointing
    need = plan.memory.total(mode)
    capacity = gpu_memory_bytes(gpu) if gpu else None
    if gpus_per_node == 0:
        plan.checks.append(("memory", "ok", f"CPU-only nodes: about {need / GIB:.1f} GiB per process"))
    elif capacity is None:
        plan.checks.append(
            (
                "memory",
                "warn",
                f"unknown GPU {gpu!r}: pass --gpu (one of "
                f"{', '.join(sorted(GPU_MEMORY_GB))}) to check {need / GIB:.1f} GiB per GPU",
            )
        )
    else:
        plan.gpu_bytes = capacity
        detail = f"{need / GIB:.1f} GiB of {capacity / GIB:.1f} GiB per GPU (activation checkpointing {mode})"
        if need > capacity:
            better = [m for m in ("selective", "full") if plan.memory.total(m) <= capacity * TIGHT_FRACTION]
            hint = (
                f"; set parallel.activation_checkpointing={better[0]!r}"
                if better and better[0] != mode
                else _pipeline_hint(plan.dims) + "; shard more (parallel.dp_shard, tp, pp) or use more GPUs"
            )
            plan.checks.append(("memory", "fail", detail + hint))
        elif need > capacity * TIGHT_FRACTION:
            plan.checks.append(("memory", "warn", detail + " (tight: less than 10% headroom)"))
        else:
            plan.checks.append(("memory", "ok", detail))
    if plan.memory.offloaded or stages_async_copies(cfg, gpus_per_node):
        args = (cfg, plan.memory, plan.dims, nodes, per_node, plan.parameters, gpus_per_node, host_memory)
        plan.checks.append(host_memory_check(*args))
    if cfg.checkpoint.enabled and cfg.checkpoint.snapshot_every:
        args = (cfg, plan.dims, nodes, per_node, plan.parameters, host_memory)
        plan.checks.append(snapshot_memory_check(*args))
    if gpus_per_node:
        plan.step = estimate_step(cfg, world, gpu, mfu, plan.dims)
    plan.checkpoint_bytes = 12.0 * plan.parameters
    plan.save_seconds = plan.checkpoint_bytes / (cfg.slurm.fs_write_gbps * GB)
    plan.checks.append(_checkpoint_check(cfg, plan))
    plan.checks.append(_time_limit_check(cfg, plan))
    return plan


def _round_up(seconds: float, to: int = 60) -> int:
    return int(math.ceil(seconds / to) * to)


def _checkpoint_check(cfg: Config, plan: Plan) -> tuple[str, str, str]:
    """The emergency save must fit in the hard deadline, and the signal must leave time for the step in
    flight (the stop is agreed at a step boundary) and the hard deadline; a warning names values that pass."""
    r, save, step = cfg.resilience, plan.save_seconds, plan.step.seconds if plan.step else 0.0
    detail = (
        f"{plan.checkpoint_bytes / GB:.1f} GB, about {save:.0f} s at {cfg.slurm.fs_write_gbps:g} GB/s; "
        f"hard deadline {r.hard_deadline_s:g} s, signal {r.signal_lead_s} s before the time limit"
    )
    short_deadline = save > r.hard_deadline_s
    short_lead = step > 0 and r.signal_lead_s < step + r.hard_deadline_s
    if not (short_deadline or short_lead):
        return ("checkpoint", "ok", detail)
    deadline = r.hard_deadline_s
    if short_deadline:
        deadline = max(deadline, _round_up(save * SAVE_HEADROOM))
    lead = max(r.signal_lead_s, _round_up(deadline + step + EXIT_MARGIN_S))
    settings = [f"--resilience.hard_deadline_s={deadline:g}"] if short_deadline else []
    settings.append(f"--resilience.signal_lead_s={lead}")
    if short_deadline:
        why = "an emergency save cannot finish within the hard deadline"
    else:
        why = (
            f"the signal leaves less than one step (about {step:.0f} s, estimate) + the hard deadline "
            "for the stop and its save"
        )
    fix = f"{why}; these pass: {' '.join(settings)}"
    tighter = _round_up(save * SAVE_HEADROOM, 30)
    fits = step + tighter + EXIT_MARGIN_S <= r.signal_lead_s
    if not short_deadline and tighter < r.hard_deadline_s and fits:
        fix += f", or a hard deadline closer to the save estimate: --resilience.hard_deadline_s={tighter}"
    if short_deadline:
        # The same deadline holds on a filesystem fast enough (the aggregate write bandwidth is a guess).
        gbps = plan.checkpoint_bytes / (r.hard_deadline_s / SAVE_HEADROOM) / GB
        alternative = [f"--slurm.fs_write_gbps={gbps:.1f}"]
        if step > 0 and r.signal_lead_s < step + r.hard_deadline_s:
            lead_as_is = _round_up(r.hard_deadline_s + step + EXIT_MARGIN_S)
            alternative.append(f"--resilience.signal_lead_s={lead_as_is}")
        fix += f" (or, if the filesystem writes {gbps:.1f} GB/s: {' '.join(alternative)})"
    return ("checkpoint", "warn", f"{detail}: {fix}")


def _time_limit_check(cfg: Config, plan: Plan) -> tuple[str, str, str]:
    """A job must have time to train before its own time budget stops it (resilience/rank/shutdown.py stops
    when less than the save estimate + time_budget_margin_s remain, or at Slurm's signal, whichever comes
    first), after loading the checkpoint it resumes from: else the chain spends its jobs starting and
    stopping. Fewer than MIN_JOB_STEPS steps, or less than MIN_TRAIN_SHARE of the limit training, warns
    and names a limit that passes; no time to train at all fails."""
    limit, r = slurm_time_seconds(cfg.slurm.time), cfg.resilience
    if limit is None:
        return ("time limit", "ok", f"slurm.time={cfg.slurm.time!r}: no time limit, no time-budget stop")
    save = plan.save_seconds
    stop = max(save + r.time_budget_margin_s, r.signal_lead_s)
    load = plan.checkpoint_bytes / (cfg.slurm.fs_write_gbps * GB)  # reads assumed no faster than writes
    detail = (
        f"slurm.time={cfg.slurm.time} ({limit} s); the run stops itself {stop:.0f} s before the limit "
        f"(the larger of save estimate {save:.0f} s + resilience.time_budget_margin_s="
        f"{r.time_budget_margin_s:g} and resilience.signal_lead_s={r.signal_lead_s})"
    )
    if limit <= save + r.time_budget_margin_s:
        return (
            "time limit",
            "fail",
            detail + ": every job would stop after its first step; raise slurm.time or lower "
            "resilience.time_budget_margin_s",
        )
    if limit <= r.signal_lead_s:
        return (
            "time limit",
            "warn",
            detail + f"; Slurm's signal (resilience.signal_lead_s={r.signal_lead_s}) comes as the job starts",
        )
    train = limit - stop - load
    step = plan.step.seconds if plan.step else 0.0
    steps = train / step if step else None
    detail += f", and a resumed job first loads the checkpoint (about {load:.0f} s): {max(train, 0):.0f} s "
    detail += f"({max(train, 0) / limit:.0%} of the limit) train" + (
        f", about {max(steps or 0, 0):.0f} steps (estimate)" if step else ""
    )
    short = train < MIN_TRAIN_SHARE * limit or (steps is not None and steps < MIN_JOB_STEPS)
    if not short:
        return ("time limit", "ok", detail)
    overhead = stop + load
    passing = max(overhead / (1 - MIN_TRAIN_SHARE), overhead + MIN_JOB_STEPS * step)
    wanted = f"at least {MIN_JOB_STEPS} steps and {MIN_TRAIN_SHARE:.0%} of the limit training"
    level = "fail" if train <= 0 else "warn"  # a resumed job would stop after its first step
    return (
        "time limit",
        level,
        f"{detail}; for {wanted} per job this passes: --slurm.time={_round_up_time(passing)}",
    )


def _round_up_time(seconds: float) -> str:
    """Seconds rounded up to 10 minutes, as sbatch --time writes them: H:MM:SS, or D-HH:MM:SS."""
    days, rest = divmod(_round_up(seconds, 600), 86400)
    hours, rest = divmod(rest, 3600)
    text = f"{hours:02d}:{rest // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text


def range_rows(plans: list[Plan]) -> list[tuple[str, ...]]:
    """For a node range: per count, the layout, the batch split and the memory per GPU (process)."""
    rows = []
    for plan in plans:
        d = plan.dims
        layout = split = memory = "-"
        if d is not None:
            layout = f"dp {d.dp} ({d.dp_replicate} x {d.dp_shard}), tp {d.tp}, pp {d.pp}, cp {d.cp}"
            split = f"{d.micro_batch_size} x {d.grad_accum}"
        if plan.memory is not None:
            memory = f"{plan.memory.total(plan.mode) / GIB:.1f} GiB"
        world = plan.nodes * (plan.gpus_per_node or plan.tasks_per_node)
        rows.append((str(plan.nodes), str(world), layout, split, memory, plan.verdict))
    return rows


def _pipeline_hint(dims) -> str:
    """A pipeline's activations and logits grow with its micro batch, which more pipeline micro batches
    make smaller (the gathered stage and its gradients do not)."""
    if dims is None or dims.pp == 1 or dims.micro_batch_size <= 1:
        return ""
    return (
        f"; raise parallel.pp_microbatches (now {dims.grad_accum}: micro batches of "
        f"{dims.micro_batch_size} sequences)"
    )


def human_count(n: float) -> str:
    """3.1 M, 8.03 B, 512."""
    for scale, suffix, digits in ((1e12, "T", 2), (1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f} {suffix}"
    return f"{n:.0f}"


def plan_rows(plan: Plan) -> list[tuple[str, str]]:
    """Readable facts for the table printed by `relaytrain plan`."""
    rows = [
        ("parameters", human_count(plan.parameters)),
        ("nodes x GPUs", f"{plan.nodes} x {plan.gpus_per_node} ({plan.gpu or 'GPU type not given'})"),
    ]
    if plan.memory is not None:
        mem = plan.memory
        where = "per process, in host memory (cpu_offload)" if mem.offloaded else "per GPU"
        rows += [
            ("weights+grads+AdamW", f"{mem.states / GIB:.1f} GiB {where}"),
            ("gathered layers", f"{mem.working / GIB:.1f} GiB"),
            ("logits", f"{mem.logits / GIB:.1f} GiB"),
        ]
        for mode in ("none", "selective", "full"):
            rows.append(
                (
                    f"activations ({mode})",
                    f"{mem.activations[mode] / GIB:.1f} GiB -> total {mem.total(mode) / GIB:.1f} GiB",
                )
            )
    # make_plan stops at a failed layout, before the estimate
    why = "the layout failed (see the layout check)" if plan.dims is None else ""
    return rows + estimate_rows(plan.step, plan.gpu, why)
