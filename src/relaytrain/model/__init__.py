"""The Llama-style transformer, parameter and FLOP counting.

Names are imported lazily: the counts (flops.py) need no torch, so that `relaytrain plan` and a config
check do not pay for importing it.
"""

from __future__ import annotations

from relaytrain.lazy import lazy_getattr

_EXPORTS = {
    "Transformer": "relaytrain.model.transformer",
    "TransformerBlock": "relaytrain.model.transformer",
    "count_parameters": "relaytrain.model.flops",
    "ffn_hidden_dim": "relaytrain.model.flops",
    "flops_per_token": "relaytrain.model.flops",
    "matmul_parameters": "relaytrain.model.flops",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)
