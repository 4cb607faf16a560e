"""Tensor + sequence parallelism with DTensor plans (the Megatron split, as torchtitan lays it out).

Between blocks the residual stream is sharded along the sequence (Shard(1)) as a plain local tensor;
norms run sequence-parallel, attention and the MLP all-gather their input, split heads / hidden units
column-wise and reduce-scatter back to sequence shards. The output projection is split along the
vocabulary; with loss parallel its logits stay a vocabulary-sharded DTensor that cross entropy consumes
under `loss_parallel()` without ever gathering the full [batch, seq, vocab] tensor.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from relaytrain.model.transformer import Transformer


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Shard `model` (a whole model or a pipeline stage of it) over `tp_mesh` in place."""
    outer: dict[str, object] = {}
    if model.tok_embeddings is not None:
        outer["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        outer["norm"] = SequenceParallel()
    if model.output is not None:
        outer["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if outer:
        parallelize_module(model, tp_mesh, outer)
    block_plan = {
        "attention_norm": SequenceParallel(),
        # forward(x, cos, sin): only x is an activation; the RoPE tables stay plain tensors.
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)
