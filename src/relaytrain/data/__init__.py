"""Data: tokenizers, prepared token shards, the resumable global sampler, and the bundled corpus.

Names are imported lazily so that tokenizing worker processes never import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "build_tokenizer": "relaytrain.data.tokenizer",
    "tokenizer_name": "relaytrain.data.tokenizer",
    "ByteTokenizer": "relaytrain.data.tokenizer",
    "HFTokenizer": "relaytrain.data.tokenizer",
    "prepare_dataset": "relaytrain.data.prepare",
    "PreparedDataset": "relaytrain.data.shards",
    "resolve_sources": "relaytrain.data.sources",
    "TrainLoader": "relaytrain.data.loader",
    "ValLoader": "relaytrain.data.loader",
    "build_train_loader": "relaytrain.data.loader",
    "build_val_loader": "relaytrain.data.loader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'relaytrain.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
