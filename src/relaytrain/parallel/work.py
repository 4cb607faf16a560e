"""Which modules' forward is a rank's own computation: the straggler watch times them, and compares the
times with those of the ranks doing the same work (resilience/rank/straggler.py says why those and not the
whole step)."""

from __future__ import annotations

from torch import nn

from relaytrain.model.transformer import Attention, FeedForward, Transformer
from relaytrain.parallel.dims import ParallelDims


def own_work_modules(model_parts: list[Transformer], dims: ParallelDims, compiled: bool) -> list[nn.Module]:
    """The modules of ``model_parts`` (every model chunk this rank holds of a pipeline) whose forward runs no
    collective. FSDP gathers their parameters in the hooks of their layer or of the root, before them; the
    watch's clock runs after a module's own pre-hooks and stops before its own forward hooks.

    Without tensor or context parallelism: every layer's attention and feed-forward and the output
    projection; under compile (``compiled``), every layer as a whole instead (the compiled block: the
    watch's hooks run eagerly around it, where a clock inside it would be traced, not run; a recomputation
    under activation checkpointing runs inside it, untimed). With either: every layer's linear layers and
    the output projection, as their attention (context parallelism's ring exchanges inside it) and their
    layer's input and output (tensor parallelism's all-gathers and reduce-scatters, in the hooks of the
    attention, the feed-forward and the row-wise linear layers) hold collectives; a linear layer's own
    forward under tensor parallelism multiplies the shards this rank holds and leaves the partial sums to
    the reduce-scatter in its forward hook. None with either under compile (those linear layers are inside
    the compiled blocks)."""
    leaves = dims.tp > 1 or dims.cp > 1
    if compiled and leaves:
        return []
    found: list[nn.Module] = []
    for part in model_parts:
        if compiled:
            found.extend(part.layers.values())  # the units apply_compile compiled
        else:
            for module in part.modules():
                if isinstance(module, (Attention, FeedForward)):
                    found.extend(_linear_layers(module) if leaves else [module])
        if part.output is not None:  # a pipeline stage other than the last has none
            found.append(part.output)
    return found


def _linear_layers(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, nn.Linear)]
