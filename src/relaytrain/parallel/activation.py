"""Activation checkpointing and torch.compile, per transformer block.

AC replaces each block's `forward` on the instance and compile uses `nn.Module.compile`, instead of
wrapping the block in another module, so parameter names (and with them the per-name init seeds, the
checkpoint keys and the FSDP/TP plans) stay those of the plain model. Order as torchtitan:
TP -> AC -> compile -> FSDP. FSDP's hooks run around the block's forward, outside the checkpointed
region: its all-gathers are not replayed by the recompute, and the selective policy sees the same ops
in forward and recompute.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from relaytrain.model.transformer import Transformer
from relaytrain.torch_private import functional_reduce_scatter_op, saved_attention_ops

_aten = torch.ops.aten
# Ops whose outputs selective AC keeps: attention (expensive to recompute, small output) and the
# reduce-scatters of sequence parallelism (recomputing them would repeat communication).
_SAVE_OPS = {*saved_attention_ops(), functional_reduce_scatter_op(), _aten.max.default}


def _selective_policy(counts: dict[str, int], ctx, func, *args, **kwargs) -> CheckpointPolicy:
    # Keep every other matmul output: half the matmul recompute for half the memory.
    if func == _aten.mm.default:
        key = "recompute" if ctx.is_recompute else "forward"
        counts[key] += 1
        save = counts[key] % 2 == 1
    else:
        save = func in _SAVE_OPS
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(partial(_selective_policy, defaultdict(int)))


def apply_ac(model: Transformer, mode: str) -> None:
    """'full': recompute each block in backward; 'selective': recompute all but the ops worth keeping."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"unknown activation checkpointing mode {mode!r}")
    for block in model.layers.values():
        block.forward = _checkpointed(block.forward, mode)


def _checkpointed(forward, mode: str):
    extra = {"context_fn": _selective_contexts} if mode == "selective" else {}

    def checkpointed_forward(*args, **kwargs):
        # No dropout or other randomness in the model: no RNG state to stash and restore.
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **extra, **kwargs)

    return checkpointed_forward


def apply_compile(model: Transformer) -> None:
    """Compile each block as a module (``nn.Module.compile``, as torchtitan), with ``fullgraph=True``.

    The compiled region is the block's call: its forward (the checkpointed one under AC, so the
    recompute is compiled too) between the FSDP hooks, which Dynamo leaves to run eagerly. The blocks
    share one code object, so one graph serves them all (their parameters are the graph's inputs); a
    guard that failed per block would recompile once per block, and past Dynamo's recompile limit a
    region that is not ``fullgraph`` silently runs eagerly (8B has 32 blocks, 70B 80): with
    ``fullgraph=True`` that is an error instead.
    """
    for block in model.layers.values():
        block.compile(fullgraph=True)
