"""Pipeline parallelism: split the model into stages and drive them with a torch.distributed schedule.

Stages are copies of the meta-device model with the layers (and embedding / norm / output) they do not
own removed; the remaining modules keep their names, so checkpoints and init seeds do not depend on the
split. With virtual stages, rank r owns stages r, r + pp, r + 2*pp, ... (the looped layout the
interleaved schedule expects).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from relaytrain.model.transformer import Transformer


def stage_layer_ranges(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous, as even as possible; earlier stages take the extra layers (later ones hold the output)."""
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def stage_ids_of(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    return [pp_rank + k * pp for k in range(virtual_stages)]


def split_stage(model: Transformer, stage_id: int, n_stages: int) -> Transformer:
    """A copy of `model` (meta device) holding only stage `stage_id`'s modules."""
    stage = copy.deepcopy(model)
    keep = {str(i) for i in stage_layer_ranges(model.cfg.n_layers, n_stages)[stage_id]}
    for name in list(stage.layers.keys()):
        if name not in keep:
            del stage.layers[name]
    if stage_id != 0:
        stage.tok_embeddings = None
    if stage_id != n_stages - 1:
        stage.norm = None
        stage.output = None
    return stage


def build_schedule(
    kind: str,
    parts: list[torch.nn.Module],
    stage_ids: list[int],
    n_stages: int,
    device: torch.device,
    group: dist.ProcessGroup,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """The schedule over this rank's stages.

    Boundary shapes are inferred on the first step by a metadata exchange, so TP-sharded activations and
    the DTensor logits of loss parallel need no declared shapes (the step simulation declares them
    instead: relaytrain.parallel.sim_pipeline).
    """
    stages = [
        PipelineStage(part, sid, n_stages, device, group=group)
        for part, sid in zip(parts, stage_ids, strict=True)
    ]
    return schedule_of(kind, stages, n_microbatches, loss_fn)


def schedule_of(
    kind: str, stages: list[PipelineStage], n_microbatches: int, loss_fn
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """The `parallel.pp_schedule` kind over built stages."""
    # scale_grads: the loss of each microbatch is a mean, so gradients are divided by the microbatch
    # count, giving the gradient of the mean loss over the local batch.
    if kind == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn, scale_grads=True)
    schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind]
    (stage,) = stages
    return schedule_cls(stage, n_microbatches, loss_fn=loss_fn, scale_grads=True)
