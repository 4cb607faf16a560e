"""The ring of nodes that holds each rank's replicas, and moving snapshot bytes between ranks over gloo.

Nodes are ordered by their lowest rank. The rank with local index i on node k sends its snapshot to the
rank with local index i (modulo that node's rank count) on nodes k+1 ... k+d, where d is
`checkpoint.snapshot_replicas` clipped to the number of other nodes: ranks on one node have no peer
outside it, so a single-node run keeps no replica.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ring:
    hosts: tuple[str, ...]  # rank -> node name
    degree: int  # replicas per rank after clipping

    @classmethod
    def of(cls, hosts: list[str], replicas: int) -> Ring:
        nodes = list(dict.fromkeys(hosts))
        return cls(tuple(hosts), max(0, min(replicas, len(nodes) - 1)))

    @property
    def nodes(self) -> list[str]:
        return list(dict.fromkeys(self.hosts))

    def ranks_on(self, node: str) -> list[int]:
        return [r for r, h in enumerate(self.hosts) if h == node]

    def is_node_leader(self, rank: int) -> bool:
        return self.ranks_on(self.hosts[rank])[0] == rank

    def targets(self, rank: int) -> list[int]:
        """The ranks (on the next `degree` nodes) that keep a replica of `rank`'s snapshot."""
        nodes = self.nodes
        k = nodes.index(self.hosts[rank])
        local = self.ranks_on(self.hosts[rank]).index(rank)
        out = []
        for d in range(1, self.degree + 1):
            there = self.ranks_on(nodes[(k + d) % len(nodes)])
            out.append(there[local % len(there)])
        return out

    def sources(self, rank: int) -> list[int]:
        """The ranks whose replicas `rank` keeps."""
        return [r for r in range(len(self.hosts)) if rank in self.targets(r)]


def all_gather(obj, group, world_size: int) -> list:
    if group is None:
        return [obj]
    box = [None] * world_size
    dist.all_gather_object(box, obj, group=group)
    return box


def as_bytes_tensor(data) -> torch.Tensor:
    """A uint8 tensor of a bytes-like object: a view of it when it is writable, else of a copy."""
    if not len(data):
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(data if not memoryview(data).readonly else bytearray(data), dtype=torch.uint8)


def send_blob(chunks: list[torch.Tensor], checksum: str, dst: int, group) -> list:
    """Start sending a snapshot (uint8 chunks, then the sender's checksum); the works to wait for."""
    tensors = [*chunks, as_bytes_tensor(checksum.encode())]
    lengths = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
    works = [dist.isend(lengths, dst, group=group)]
    works += [dist.isend(t, dst, group=group) for t in tensors if t.numel()]
    return works


def recv_blob(src: int, parts: int, group) -> tuple[list[memoryview], str]:
    """Receive what `send_blob` with `parts` chunks sent: (chunks, as writable views of the buffers they
    were received into, and the sender's checksum)."""
    lengths = torch.empty(parts + 1, dtype=torch.int64)
    dist.recv(lengths, src, group=group)
    received = []
    for n in lengths.tolist():
        t = torch.empty(int(n), dtype=torch.uint8)
        if n:
            dist.recv(t, src, group=group)
        received.append(t.numpy().data)
    return received[:-1], bytes(received[-1]).decode()
