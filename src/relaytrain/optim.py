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


def lr_at(cfg: OptimConfig, step: int, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (1-based: the first update uses lr_at(1))."""
    if cfg.warmup_steps > 0 and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "wsd":
        decay_steps = max(1, round(cfg.decay_fraction * max_steps))
        decay_start = max_steps - decay_steps
        if step <= decay_start:
            return cfg.lr
        progress = min(1.0, (step - decay_start) / decay_steps)
        return cfg.lr - (cfg.lr - cfg.min_lr) * progress
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizers: list[torch.optim.Optimizer], lr: float) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr
