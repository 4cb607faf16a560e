"""The step simulation's pipeline: what the stages pass between them, declared from the model config
instead of inferred, on a ParallelModel whose schedule is built with those declarations.

The trainer's schedule infers its stages' boundary shapes on the first step: a vote over the pipeline
ranks (an all-ones tensor read with `.item()`) and, for the shapes, a forward of the first microbatch
whose metadata travels by `send_object_list` (also read with `.item()`). Under the fake process group
of the step simulation (relaytrain.parallel.simulate) no data moves and fake tensors have no values,
so the first `.item()`, the vote's, stops the step (`aten._local_scalar_dense`).

Every rank can compute every stage's boundaries itself: the first stage takes the token ids
(microbatch, seq) as int64; between stages the residual stream is a plain local tensor
(microbatch, seq, dim) in the compute dtype, sequence-sharded over TP (sequence parallel) and CP; the
last stage returns the logits (microbatch, seq, vocab), a vocabulary-sharded DTensor under loss parallel.
With these declared on every stage, every stage votes "static", so the vote's outcome is known
without reading it (`settle_static_vote`). The trainer's build knows nothing of this: the simulation
builds a `DeclaredStagesModel`, which overrides only how the schedule is made.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor, Shard

from relaytrain.config.schema import ParallelConfig
from relaytrain.parallel.fsdp import param_dtype
from relaytrain.parallel.parallel_model import ParallelModel, ShardedOnMeta
from relaytrain.parallel.pipeline import schedule_of
from relaytrain.torch_private import (
    schedule_stages,
    skip_warmup_vote,
    stage_needs_inference,
    validate_stage_at_runtime,
)


@dataclasses.dataclass
class StageBoundary:
    """Example tensors for a PipelineStage (input_args, output_args, input_grads, output_grads)."""

    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    input_grads: tuple[torch.Tensor | None, ...] | None = None
    output_grads: tuple[torch.Tensor | None, ...] | None = None

    def stage_kwargs(self) -> dict:
        return {
            "input_args": self.inputs,
            "output_args": self.outputs,
            "input_grads": self.input_grads,
            "output_grads": self.output_grads,
        }


@dataclasses.dataclass(frozen=True)
class BoundaryShapes:
    """The sizes every stage boundary of one layout follows from."""

    microbatch: int
    seq_len: int  # the full sequence, before CP and SP shard it
    dim: int
    vocab_size: int
    dtype: torch.dtype  # the compute dtype of the residual stream and logits
    tp: int = 1
    cp: int = 1
    loss_parallel: bool = False  # logits stay a vocabulary-sharded DTensor (tp > 1 only)


def stage_boundary(
    shapes: BoundaryShapes, stage_id: int, n_stages: int, device: torch.device, tp_mesh: DeviceMesh | None
) -> StageBoundary:
    """Example tensors of stage `stage_id` (allocated in the current mode: fake under FakeTensorMode)."""
    s = shapes
    seq = s.seq_len // s.cp
    hidden = (s.microbatch, seq // s.tp, s.dim)
    if stage_id == 0:
        inputs = (torch.empty((s.microbatch, seq), dtype=torch.int64, device=device),)
    else:
        inputs = (torch.empty(hidden, dtype=s.dtype, device=device, requires_grad=True),)
    if stage_id < n_stages - 1:
        return StageBoundary(inputs, (torch.empty(hidden, dtype=s.dtype, device=device, requires_grad=True),))
    if s.tp > 1 and s.loss_parallel:
        if tp_mesh is None:
            raise ValueError("loss-parallel logits need the tensor-parallel mesh")
        local = torch.empty(
            (s.microbatch, seq, -(-s.vocab_size // s.tp)), dtype=s.dtype, device=device, requires_grad=True
        )
        logits = DTensor.from_local(
            local,
            tp_mesh,
            (Shard(2),),
            run_check=False,
            shape=torch.Size((s.microbatch, seq, s.vocab_size)),
            stride=(seq * s.vocab_size, s.vocab_size, 1),
        )
        # A DTensor among a stage's boundaries needs both gradients declared for the static mode.
        grads = tuple(t.detach() for t in inputs)
        return StageBoundary(inputs, (logits,), grads, (logits.detach(),))
    logits = torch.empty((s.microbatch, seq, s.vocab_size), dtype=s.dtype, device=device, requires_grad=True)
    return StageBoundary(inputs, (logits,))


def settle_static_vote(schedule) -> None:
    """Skip the schedule's warm-up vote, whose outcome is known: every stage declared its boundaries.

    torch's warm-up multiplies the stages' votes along the pipeline and reads the product with
    `.item()`; with declared boundaries on every rank each vote is 1 (static). Also skipped: the
    vote's side effect of opening the two-rank communicators early, which only a real group has.
    """
    stages = schedule_stages(schedule)
    for stage in stages:
        if stage_needs_inference(stage, schedule):
            raise ValueError(f"pipeline stage {stage.stage_index} lacks declared boundary metadata")
    for stage in stages:
        # Check every boundary tensor the step really passes against its declaration: a wrong
        # declaration fails the step, not a later one.
        validate_stage_at_runtime(stage)
    skip_warmup_vote(schedule)


class DeclaredStagesModel(ParallelModel):
    """The trainer's ParallelModel with its pipeline stages' boundaries declared instead of inferred on
    the first step, and the warm-up vote settled: the step simulation's fake process group cannot carry
    the inference. Everything but the schedule's construction is the trainer's."""

    def __init__(self, sharded: ShardedOnMeta, parallel: ParallelConfig, seq_len: int, device: torch.device):
        dims, cfg = sharded.dims, sharded.parts[0].cfg
        self.shapes = BoundaryShapes(
            microbatch=dims.micro_batch_size,
            seq_len=seq_len,
            dim=cfg.dim,
            vocab_size=cfg.vocab_size,
            dtype=param_dtype(parallel, device.type),
            tp=dims.tp,
            cp=dims.cp,
            loss_parallel=parallel.loss_parallel,
        )
        super().__init__(parallel, dims, sharded.mesh, device, sharded.parts, sharded.stage_ids)

    def _build_schedule(self, parallel: ParallelConfig):
        tp_mesh = self.mesh["tp"] if self.dims.tp > 1 else None
        group = self.mesh["pp"].get_group()
        stages = []
        for part, sid in zip(self.model_parts, self.stage_ids, strict=True):
            declared = stage_boundary(self.shapes, sid, self.n_stages, self.device, tp_mesh)
            stages.append(
                PipelineStage(part, sid, self.n_stages, self.device, group=group, **declared.stage_kwargs())
            )
        schedule = schedule_of(parallel.pp_schedule, stages, self.dims.grad_accum, self._loss_fn)
        settle_static_vote(schedule)
        return schedule
