"""`ParallelDims`: the resolved degrees of a layout, its batch split, and where each rank sits in the mesh.

Built and checked by `relaytrain.parallel.layout` (`validate_layout`); read by the trainer, the step,
the checkpoint record and `relaytrain plan`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    rank_order: tuple[str, ...] = ("tp", "cp", "pp", "dp")  # innermost first
    # The batch split, filled by split_batch (0 until then): sequences per forward on one rank, and
    # forwards per step (the pipeline's microbatch count under pipeline parallelism).
    micro_batch_size: int = 0
    grad_accum: int = 0

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def local_batch_size(self) -> int:
        """Sequences one data-parallel rank takes per optimizer step (global batch / dp)."""
        return self.micro_batch_size * self.grad_accum

    @property
    def mesh_dims(self) -> tuple[tuple[str, int], ...]:
        """(name, degree) of the device mesh, outermost first (the order init_device_mesh wants)."""
        sizes = {"tp": self.tp, "cp": self.cp, "pp": self.pp}
        out: list[tuple[str, int]] = []
        for name in reversed(self.rank_order):
            if name == "dp":
                out += [("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard)]
            else:
                out.append((name, sizes[name]))
        return tuple(out)

    def describe(self) -> str:
        batch = ""
        if self.micro_batch_size:  # set by split_batch: the batch split, and the global batch it makes
            steps = "pipeline microbatches" if self.pp > 1 else "accumulation steps"
            batch = (
                f", micro batch {self.micro_batch_size} x {self.grad_accum} {steps} per data-parallel rank "
                f"= global batch {self.local_batch_size * self.dp} sequences"
            )
        return (
            f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} tp={self.tp} pp={self.pp} "
            f"cp={self.cp} (world size {self.world_size}, rank order {','.join(self.rank_order)}{batch})"
        )

    def coordinates(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank: what `DeviceMesh.get_coordinate` returns, without a mesh."""
        coords: dict[str, int] = {}
        rest = rank
        for name, size in reversed(self.mesh_dims):
            coords[name] = rest % size
            rest //= size
        return coords

    def pipeline_stages(self) -> list[int]:
        """Each global rank's pipeline stage (its "pp" coordinate; all 0 without pipeline parallelism): the
        ranks of one stage do the same work, those of two stages hold different layers."""
        return [self.coordinates(rank)["pp"] for rank in range(self.world_size)]

    def group_of(self, rank: int, dim: str) -> list[int]:
        """Global ranks of `rank`'s group along mesh dimension `dim` (e.g. "tp")."""
        stride = 1
        for name, size in reversed(self.mesh_dims):
            if name == dim:
                base = rank - self.coordinates(rank)[dim] * stride
                return [base + i * stride for i in range(size)]
            stride *= size
        raise KeyError(dim)
