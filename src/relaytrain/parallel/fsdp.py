"""FSDP2 (`fully_shard`) per transformer block and on the root; HSDP on a 2-D mesh."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from relaytrain.config.schema import ParallelConfig
from relaytrain.model.transformer import Transformer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def param_dtype(pcfg: ParallelConfig, device_type: str) -> torch.dtype:
    """Compute dtype of parameters: 'auto' is bf16 on CUDA, fp32 on CPU (bf16 matmuls crawl there)."""
    if pcfg.param_dtype == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return _DTYPES[pcfg.param_dtype]


def reshard_after_forward(pcfg: ParallelConfig, pp_enabled: bool) -> bool:
    """'default': reshard, except with a pipeline, whose microbatches would all-gather again each time."""
    if pcfg.reshard_after_forward == "always":
        return True
    if pcfg.reshard_after_forward == "never":
        return False
    return not pp_enabled


def apply_fsdp(
    model: Transformer, mesh: DeviceMesh, pcfg: ParallelConfig, device_type: str, pp_enabled: bool
) -> None:
    mp = MixedPrecisionPolicy(
        param_dtype=param_dtype(pcfg, device_type), reduce_dtype=_DTYPES[pcfg.reduce_dtype]
    )
    # Pinned host memory needs an accelerator; on CPU plain memory is the only kind.
    offload = CPUOffloadPolicy(pin_memory=device_type == "cuda") if pcfg.cpu_offload else OffloadPolicy()
    reshard = reshard_after_forward(pcfg, pp_enabled)
    kwargs = {"mesh": mesh, "mp_policy": mp, "offload_policy": offload}
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again first in backward: keep them gathered.
        fully_shard(block, reshard_after_forward=reshard and i < len(blocks) - 1, **kwargs)
    fully_shard(model, reshard_after_forward=reshard, **kwargs)
