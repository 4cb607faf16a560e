"""The reshard path at scale, on metadata only: a checkpoint saved by one layout, loaded by another.

For each layout the model is built through the trainer's path on the meta device (rank 0 of a fake
process group of the full world size); every other rank's chunk of every parameter follows from the
parameter's mesh and placements (DTensor's own shard arithmetic). The save side keeps one writer per
distinct chunk, as DCP's planner deduplicates replicas; the load side asks DCP's overlap function which
saved chunks each loading rank reads. "Covered exactly once": the saved chunks of a tensor are disjoint
and fill it, and every loading rank's chunk is filled by its reads with no byte read twice. Nothing is
allocated or written. Runs in a fresh process per layout (the fake process group is one per process).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from relaytrain.config import Config
from relaytrain.entry_points import SIM_RESHARD

Chunk = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclasses.dataclass
class ReshardCheck:
    tensors: int
    saved_chunks: int
    load_reads: int
    problems: list[str]  # empty when every tensor is covered exactly once


def layout_chunks(cfg: Config, world_size: int, gpus_per_node: int) -> dict[str, list[list[Chunk]]]:
    """Full parameter name -> per global rank, the chunks that rank holds (in this process)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from relaytrain.parallel.parallel_model import shard_on_meta
    from relaytrain.torch_private import fake_store, local_shape_and_offset

    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world_size)
    device = torch.device("cpu")
    sharded = shard_on_meta(cfg.parallel, cfg.model, cfg.train, device, world_size, 0, gpus_per_node)
    if sharded.dims.pp > 1:
        raise ValueError("the reshard check covers layouts without a pipeline")
    out: dict[str, list[list[Chunk]]] = {}
    for name, param in sharded.parts[0].named_parameters():
        per_rank: list[list[Chunk]] = [[] for _ in range(world_size)]
        if not isinstance(param, DTensor):
            for rank in range(world_size):
                per_rank[rank].append(((0,) * param.ndim, tuple(param.shape)))
        else:
            ranks = param.device_mesh.mesh
            for coord in itertools.product(*(range(n) for n in ranks.shape)):
                rank = int(ranks[coord])
                shape, offset = local_shape_and_offset(
                    param.shape, ranks.shape, list(coord), param.placements
                )
                if math.prod(shape):
                    per_rank[rank].append((tuple(offset), tuple(shape)))
        out[name] = per_rank
    return out


def check_reshard(saved: dict[str, list[list[Chunk]]], loaded: dict[str, list[list[Chunk]]]) -> ReshardCheck:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from relaytrain.torch_private import shard_overlap

    problems: list[str] = []
    n_saved = n_reads = 0
    for name, per_rank in saved.items():
        distinct = sorted({chunk for chunks in per_rank for chunk in chunks})  # one writer per chunk
        n_saved += len(distinct)
        full = _full_shape(distinct)
        if sum(math.prod(size) for _, size in distinct) != math.prod(full) or _overlapping(distinct):
            problems.append(f"{name}: the saved chunks do not tile the tensor")
        stored = [ChunkStorageMetadata(torch_size(off), torch_size(size)) for off, size in distinct]
        for rank, chunks in enumerate(loaded.get(name, [])):
            for off, size in chunks:
                want = ChunkStorageMetadata(torch_size(off), torch_size(size))
                read = 0
                for piece in stored:
                    overlap = shard_overlap(piece, want)
                    if overlap is not None:
                        n_reads += 1
                        read += math.prod(length for _, _, _, length in overlap)
                if read != math.prod(size):
                    problems.append(f"{name}: rank {rank} reads {read} of its {math.prod(size)} elements")
    missing = set(saved) ^ set(loaded)
    problems += [f"{name}: in one layout only" for name in sorted(missing)]
    return ReshardCheck(len(saved), n_saved, n_reads, problems)


def torch_size(values: tuple[int, ...]):
    import torch

    return torch.Size(values)


def _full_shape(chunks: list[Chunk]) -> tuple[int, ...]:
    return tuple(max(off[d] + size[d] for off, size in chunks) for d in range(len(chunks[0][0])))


def _overlapping(chunks: list[Chunk]) -> bool:
    for i, (oa, sa) in enumerate(chunks):
        for ob, sb in chunks[i + 1 :]:
            if all(oa[d] < ob[d] + sb[d] and ob[d] < oa[d] + sa[d] for d in range(len(oa))):
                return True
    return False


def chunks_of_layout(cfg: Config, world_size: int, gpus_per_node: int) -> dict[str, list[list[Chunk]]]:
    """`layout_chunks` in a fresh process: `python -m relaytrain.parallel.sim_reshard RESULT`."""
    import pickle
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="relaytrain-reshard-") as tmp:
        result = Path(tmp) / "chunks.pickle"
        proc = subprocess.run(
            [sys.executable, "-m", SIM_RESHARD, str(result)],
            input=pickle.dumps((cfg, world_size, gpus_per_node)),
            capture_output=True,
            check=False,
        )
        if proc.returncode != 0 or not result.is_file():
            tail = proc.stderr.decode(errors="replace").strip().splitlines()
            raise RuntimeError(tail[-1] if tail else f"exit {proc.returncode}")
        return pickle.loads(result.read_bytes())  # noqa: S301 - written by our own child just now


if __name__ == "__main__":
    import pickle
    import sys
    from pathlib import Path

    args = pickle.loads(sys.stdin.buffer.read())  # noqa: S301 - from our parent
    Path(sys.argv[1]).write_bytes(pickle.dumps(layout_chunks(*args)))
