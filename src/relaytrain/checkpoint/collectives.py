"""The persistence front's gloo groups, created once and shared by checkpoints and snapshots, and the
collectives run on them.

One group per thread that runs collectives, because collectives from two threads must never interleave on
one group: the control group carries everything on the training loop's thread (rank 0's decisions that
depend on the file system or the clock, broadcast so ranks never disagree; agreeing on a snapshot; the
snapshot restore's transfers); the save group carries DCP's collectives (an asynchronous save runs them
on DCP's background thread, a sync save and a load on the loop's); the replica group, only when snapshots
are on, carries the snapshot writer thread's sends to and receives from the peer nodes.

The control group's collectives are published on the rank's progress board (entered, left, which): a
rank that never arrives at one is the one the hang watcher names. The other groups' are not: the board
has one writer, the loop's thread, and DCP's and the snapshot writer's collectives run on their own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from relaytrain.errors import UserError
from relaytrain.job.progress import ProgressBoard
from relaytrain.torch_private import group_timeout


class Collectives:
    """Without an initialized process group (one process) every collective returns this rank's value."""

    def __init__(self, rank: int, world_size: int, *, replicas: bool, board: ProgressBoard | None = None):
        self.rank, self.world_size = rank, world_size
        self.board = board if board is not None else ProgressBoard(None, rank, 0)
        self.dist = dist.is_available() and dist.is_initialized()
        if world_size > 1 and not self.dist:
            raise RuntimeError("Persistence with world_size > 1 needs an initialized process group")
        # with the default group's timeout (ResilienceConfig.effective_collective_timeout_s), not gloo's
        # default 1800 s
        timeout = group_timeout() if self.dist else None  # None: the fake process group has none
        self.ctrl = dist.new_group(backend="gloo", timeout=timeout) if self.dist else None
        self.save_group = dist.new_group(backend="gloo", timeout=timeout) if self.dist else None
        # `replicas`: snapshots are on (the same on every rank: every rank creates the same groups)
        replicas = replicas and self.dist
        self.replica_group = dist.new_group(backend="gloo", timeout=timeout) if replicas else None

    def broadcast(self, obj):
        if not self.dist:
            return obj
        box = [obj]
        with self.board.collective("checkpoint_broadcast"):
            dist.broadcast_object_list(box, src=0, group=self.ctrl)
        return box[0]

    def agree_flag(self, flag: bool) -> bool:
        """Rank 0's `flag` on every rank (a one-element tensor broadcast: cheap enough for every step)."""
        if not self.dist:
            return flag
        t = torch.tensor([1.0 if flag else 0.0])
        with self.board.collective("checkpoint_flag"):
            dist.broadcast(t, src=0, group=self.ctrl)
        return bool(t.item())

    def any(self, flag: bool) -> bool:
        if not self.dist:
            return flag
        t = torch.tensor([1.0 if flag else 0.0])
        with self.board.collective("checkpoint_any"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctrl)
        return bool(t.item())

    def max_of(self, values: list[float]) -> list[float]:
        """Each value's maximum over ranks (one all-reduce; a snapshot's agreement and its figures)."""
        if not self.dist:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        with self.board.collective("checkpoint_any"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctrl)
        return t.tolist()

    def barrier(self) -> None:
        if self.dist:
            with self.board.collective("checkpoint_barrier"):
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
        with self.board.collective("checkpoint_gather"):
            dist.gather_object(own, box, dst=0, group=self.ctrl)
        return {k: v for part in box or [] for k, v in part.items()}

    def close(self) -> None:
        for group in (self.ctrl, self.save_group, self.replica_group):
            if group is not None and self.dist and dist.is_initialized():
                dist.destroy_process_group(group)
        self.ctrl = self.save_group = self.replica_group = None
        self.dist = False
