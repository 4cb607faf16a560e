"""The checkpointer's two gloo groups and the collectives it runs on them.

Decisions that depend on the file system or the clock are taken by rank 0 and broadcast on the control
group, so ranks never disagree. Asynchronous saves run their collectives on the save group from a
background thread: collectives from two threads must never interleave on one group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from relaytrain.errors import UserError
from relaytrain.torch_private import group_timeout


class Collectives:
    """Without an initialized process group (one process) every collective returns this rank's value."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.dist = dist.is_available() and dist.is_initialized()
        if world_size > 1 and not self.dist:
            raise RuntimeError("CheckpointManager with world_size > 1 needs an initialized process group")
        # with the default group's timeout (resilience.collective_timeout_s), not gloo's default 1800 s
        timeout = group_timeout() if self.dist else None  # None: the fake process group has none
        self.ctrl = dist.new_group(backend="gloo", timeout=timeout) if self.dist else None
        self.save_group = dist.new_group(backend="gloo", timeout=timeout) if self.dist else None

    def broadcast(self, obj):
        if not self.dist:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.ctrl)
        return box[0]

    def agree_flag(self, flag: bool) -> bool:
        """Rank 0's `flag` on every rank (a one-element tensor broadcast: cheap enough for every step)."""
        if not self.dist:
            return flag
        t = torch.tensor([1.0 if flag else 0.0])
        dist.broadcast(t, src=0, group=self.ctrl)
        return bool(t.item())

    def any(self, flag: bool) -> bool:
        if not self.dist:
            return flag
        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctrl)
        return bool(t.item())

    def barrier(self) -> None:
        if self.dist:
            dist.barrier(group=self.ctrl)

    def on_rank0(self, fn):
        """Run `fn` on rank 0, hand its result (or its UserError) to every rank."""
        result = None
        if self.rank == 0:
            try:
                result = ("ok", fn())
            except UserError as exc:
                result = ("error", str(exc))
        kind, value = self.broadcast(result)
        if kind == "error":
            raise UserError(value)
        return value

    def gather_dicts(self, own: dict[str, str]) -> dict[str, str]:
        """Every rank's entries merged on rank 0 (other ranks get an empty dict)."""
        if not self.dist:
            return own
        box = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(own, box, dst=0, group=self.ctrl)
        return {k: v for part in box or [] for k, v in part.items()}

    def close(self) -> None:
        for group in (self.ctrl, self.save_group):
            if group is not None and self.dist and dist.is_initialized():
                dist.destroy_process_group(group)
        self.ctrl = self.save_group = None
        self.dist = False
