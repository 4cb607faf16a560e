"""NaN/Inf guard: one all-reduced finiteness check of the loss and grad norm per step.

The trainer does not read the check on its own: ``flag`` stays on the device and travels in the stop
agreement's all-reduce (one collective and one host read per step for both), then ``decide`` applies
the policy.

Policies (resilience.nan_policy), K = resilience.nan_max_consecutive:
- ``stop``: the first bad step stops the run (marked failed, exit EXIT_NONFINITE, never requeued).
- ``skip``: drop bad steps on every rank (zero the grads, no optimizer step); K bad steps in a row stop.
- ``rollback``: drop bad steps like ``skip``; K in a row reload the last checkpoint (the trainer also
  multiplies the LR by resilience.nan_rollback_lr_scale). More than MAX_ROLLBACKS rollbacks stop.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from relaytrain.config.schema import ResilienceConfig

log = logging.getLogger(__name__)

MAX_ROLLBACKS = 3  # a run that keeps diverging after this many rollbacks needs a human


def _local(value) -> torch.Tensor:
    if hasattr(value, "full_tensor"):  # a DTensor grad norm from clip_grad_norm_ on FSDP2/TP params
        value = value.full_tensor()
    return value.detach()


class NanGuard:
    def __init__(self, resilience: ResilienceConfig, device: torch.device, group=None):
        self.policy = resilience.nan_policy
        self.max_consecutive = max(1, resilience.nan_max_consecutive)
        self.device = torch.device(device)
        self.group = group
        self.consecutive = 0
        self.bad_total = 0
        self.rollbacks = 0

    def flag(self, loss: torch.Tensor, grad_norm: torch.Tensor | float | None = None) -> torch.Tensor:
        """This rank's verdict as a 1-element int64 tensor on the device (1: the loss or the grad norm is
        not finite), computed without reading anything back to the host: the trainer folds it into the
        stop agreement's one all-reduce (``ShutdownController.agree_with``)."""
        values = [_local(loss).float().reshape(-1).to(self.device)]
        if isinstance(grad_norm, torch.Tensor):
            values.append(_local(grad_norm).float().reshape(-1).to(self.device))
        elif grad_norm is not None:
            values.append(torch.full((1,), float(grad_norm), device=self.device))
        finite = torch.isfinite(torch.cat(values)).all()
        return (~finite).to(torch.int64).reshape(1)

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor | float | None = None) -> str:
        """'ok', 'skip', 'stop' or 'rollback', the same on every rank (one MAX all-reduce, one read)."""
        bad = self.flag(loss, grad_norm)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        return self.decide(bool(bad.item()))

    def decide(self, bad: bool) -> str:
        """The policy's answer to the flag agreed over all ranks (``check`` or the stop agreement)."""
        if not bad:
            self.consecutive = 0
            return "ok"
        self.consecutive += 1
        self.bad_total += 1
        action = self._action()
        log.warning(
            "non-finite loss or grad norm (%d in a row, %d in total): nan_policy=%s -> %s",
            self.consecutive,
            self.bad_total,
            self.policy,
            action,
        )
        return action

    def _action(self) -> str:
        if self.policy == "stop":
            return "stop"
        if self.consecutive < self.max_consecutive:
            return "skip"
        if self.policy == "skip" or self.rollbacks >= MAX_ROLLBACKS:
            return "stop"
        self.rollbacks += 1
        self.consecutive = 0
        return "rollback"
