"""AdamW and the learning-rate schedules (warmup + cosine, warmup-stable-decay, constant)."""

from __future__ import annotations

import math

import torch
from torch import nn

from relaytrain.config.schema import OptimConfig


def build_optimizer(
    cfg: OptimConfig, model_parts: list[nn.Module], device: torch.device
) -> torch.optim.AdamW:
    params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    # Norm gains and other vectors are not decayed: shrinking them only fights the normalisation.
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if device.type == "cuda" else "foreach"
    kwargs = {"fused": impl == "fused", "foreach": impl == "foreach"}
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        eps=cfg.eps,
        **kwargs,
    )


def schedule_phases(cfg: OptimConfig, max_steps: int) -> tuple[int, int]:
    """(warmup steps, decay steps) as run in a `max_steps` run.

    A run shorter than the configured phases still runs: the warmup is cut to max_steps - 1 steps so
    the peak is reached, and the wsd decay to the steps left after the warmup. Only the schedule is
    fitted; the config keeps the values the user wrote.
    """
    warmup = min(cfg.warmup_steps, max(0, max_steps - 1))
    if cfg.schedule == "constant":
        return warmup, 0
    if cfg.schedule == "wsd":
        decay = max(1, round(cfg.decay_fraction * max_steps))
        return warmup, max(1, min(decay, max_steps - warmup))
    return warmup, max(1, max_steps - warmup)


def schedule_fit_warning(cfg: OptimConfig, max_steps: int) -> str | None:
    """The one line to log when the schedule had to be fitted to a short run, else None."""
    warmup, decay = schedule_phases(cfg, max_steps)
    parts = []
    if warmup != cfg.warmup_steps:
        parts.append(f"the warmup runs {warmup} steps instead of optim.warmup_steps={cfg.warmup_steps}")
    asked = max(1, round(cfg.decay_fraction * max_steps))
    if cfg.schedule == "wsd" and decay != asked:
        parts.append(
            f"the decay runs the last {decay} steps instead of the {asked} that "
            f"optim.decay_fraction={cfg.decay_fraction} asks for"
        )
    if not parts:
        return None
    return f"train.max_steps={max_steps} is shorter than the LR schedule: " + "; ".join(parts)


def lr_at(cfg: OptimConfig, step: int, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (1-based: the first update uses lr_at(1))."""
    warmup, decay = schedule_phases(cfg, max_steps)
    if warmup > 0 and step <= warmup:
        return cfg.lr * step / warmup
    if cfg.schedule == "constant":
        return cfg.lr
    decay_start = max_steps - decay
    if step <= decay_start:  # wsd: the stable phase
        return cfg.lr
    progress = min(1.0, (step - decay_start) / decay)
    if cfg.schedule == "wsd":
        return cfg.lr - (cfg.lr - cfg.min_lr) * progress
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizers: list[torch.optim.Optimizer], lr: float) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr
